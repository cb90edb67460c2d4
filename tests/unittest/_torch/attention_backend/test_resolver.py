"""AUTO backend resolution from a fixed preference list, with mocked environment probes."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from tensorrt_llm import LLM
from tensorrt_llm._torch.attention_backend import resolver
from tensorrt_llm._torch.attention_backend.interface import AttentionBackend
from tensorrt_llm._torch.attention_backend.resolver import Probe, create_backend, resolve_name
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention

CPU = Probe(device_type="cpu", sm=0, flashinfer_importable=False)
H100 = Probe(device_type="cuda", sm=90, flashinfer_importable=True)
B200 = Probe(device_type="cuda", sm=100, flashinfer_importable=True)
H100_NO_FI = Probe(device_type="cuda", sm=90, flashinfer_importable=False,
                   flashinfer_error="ModuleNotFoundError: No module named 'flashinfer'")


def test_cpu_auto_is_vanilla():
    for mla in (False, True):
        assert resolve_name("AUTO", CPU, mla=mla, dtype=torch.bfloat16).name == "VANILLA"
    backend, res = create_backend("AUTO", torch.device("cpu"), torch.bfloat16)
    assert isinstance(backend, VanillaAttention) and res.name == "VANILLA"


def test_explicit_flashinfer_on_cpu_raises_with_reason():
    with pytest.raises(ValueError, match=r"FLASHINFER.*CUDA"):
        resolve_name("FLASHINFER", CPU, mla=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"FLASHINFER.*CUDA"):
        create_backend("FLASHINFER", torch.device("cpu"), torch.bfloat16)


def test_explicit_flashinfer_on_cpu_raises_through_llm(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"FLASHINFER.*CUDA"):
        LLM(str(tiny_llama_dir), device="cpu", attn_backend="FLASHINFER")


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="unknown attention backend 'FAST'"):
        resolve_name("FAST", H100, mla=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend 'vanilla'"):
        resolve_name("vanilla", CPU, mla=False, dtype=torch.bfloat16)     # names are exact, no silent case folding


def test_names_without_kernels_are_unknown():
    # TRTLLM kernels are not in this package: the name is refused like any unknown one, and the message
    # lists the names that can load.
    for probe in (H100, B200):
        with pytest.raises(ValueError, match=r"unknown attention backend 'TRTLLM'; "
                                             r"known: AUTO, VANILLA, FLASHINFER, TRITON, CUTEDSL$"):
            resolve_name("TRTLLM", probe, mla=False, dtype=torch.bfloat16)
    assert resolve_name("VANILLA", H100, mla=False, dtype=torch.bfloat16).name == "VANILLA"
    assert resolve_name("FLASHINFER", H100, mla=True, dtype=torch.bfloat16).name == "FLASHINFER"


HOPPER_CUTE = Probe(device_type="cuda", sm=90, flashinfer_importable=True, triton_importable=True,
                    cute_dsl_importable=True)


def test_cutedsl_is_an_explicit_choice_where_its_predicate_holds():
    for mla in (False, True):
        res = resolve_name("CUTEDSL", HOPPER_CUTE, mla=mla, dtype=torch.bfloat16)
        assert res.name == "CUTEDSL" and res.reason == "explicit choice"
        # AUTO keeps its list where CUTEDSL could run (TRITON norms and rotates inside its append already)
        assert resolve_name("AUTO", HOPPER_CUTE, mla=mla, dtype=torch.bfloat16).name == "FLASHINFER"
    assert resolve_name("CUTEDSL", replace(HOPPER_CUTE, sm=100), mla=True, dtype=torch.bfloat16).name == "CUTEDSL"


@pytest.mark.parametrize("probe,message", [
    (CPU, r"CUTEDSL cannot run: CUTEDSL needs a CUDA device \(device is cpu\)"),
    (replace(HOPPER_CUTE, sm=80), r"CUTEDSL cannot run: the CuTe DSL norm \+ RoPE kernel needs sm90\+ \(Hopper\), "
                                  r"device is sm80"),
    (replace(HOPPER_CUTE, cute_dsl_importable=False, cute_dsl_error="ModuleNotFoundError: No module named 'cutlass'"),
     r"CUTEDSL cannot run: nvidia-cutlass-dsl is not importable \(ModuleNotFoundError: No module named 'cutlass'\); "
     r"install the 'cutedsl' extra"),
    (replace(HOPPER_CUTE, triton_importable=False), "CUTEDSL cannot run: triton is not importable"),
])
def test_explicit_cutedsl_that_cannot_run_raises(probe, message):
    with pytest.raises(ValueError, match=message):
        resolve_name("CUTEDSL", probe, mla=False, dtype=torch.bfloat16)


def test_explicit_cutedsl_on_cpu_raises_through_create_backend():
    with pytest.raises(ValueError, match=r"CUTEDSL cannot run: CUTEDSL needs a CUDA device \(device is cpu\)"):
        create_backend("CUTEDSL", torch.device("cpu"), torch.bfloat16, mla=True)
    assert create_backend("AUTO", torch.device("cpu"), torch.bfloat16, mla=True)[1].name == "VANILLA"


def test_the_cpu_probe_does_not_import_the_cute_dsl():
    probe = resolver.probe_environment(torch.device("cpu"), cute_dsl=True)
    assert not probe.cute_dsl_importable and probe.cute_dsl_error == "not probed"


def test_triton_is_explicit_only():
    with_triton = Probe(device_type="cuda", sm=90, flashinfer_importable=True, triton_importable=True)
    res = resolve_name("TRITON", with_triton, mla=True, dtype=torch.bfloat16)
    assert res.name == "TRITON" and res.reason == "explicit choice"
    assert resolve_name("AUTO", with_triton, mla=False, dtype=torch.bfloat16).name == "FLASHINFER"   # AUTO never picks it
    with pytest.raises(ValueError, match="TRITON cannot run: triton is not importable"):
        resolve_name("TRITON", H100, mla=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="TRITON cannot run: TRITON needs a CUDA device"):
        resolve_name("TRITON", CPU, mla=False, dtype=torch.bfloat16)


def test_every_known_backend_has_a_loader():
    assert set(resolver.KNOWN_BACKENDS) == set(resolver._LOADERS)


def test_sm90_with_flashinfer():
    assert resolve_name("AUTO", H100, mla=False, dtype=torch.bfloat16).name == "FLASHINFER"
    assert resolve_name("AUTO", H100, mla=True, dtype=torch.bfloat16).name == "FLASHINFER"


def test_sm100_gqa_auto_is_flashinfer_with_logged_reason(monkeypatch, caplog):
    res = resolve_name("AUTO", B200, mla=False, dtype=torch.bfloat16)
    assert res.name == "FLASHINFER" and res.reason == "AUTO on CUDA sm100: FLASHINFER"

    class FakeFlashInfer(AttentionBackend):
        name = "FLASHINFER"

        def forward(self, q, k, v, kv_cache, metadata, scale):
            raise NotImplementedError

    monkeypatch.setitem(resolver._LOADERS, "FLASHINFER", lambda: FakeFlashInfer)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm"):
        backend, res = create_backend("AUTO", torch.device("cpu"), torch.bfloat16, probe=B200)
    assert isinstance(backend, FakeFlashInfer)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "attention backend FLASHINFER (AUTO on CUDA sm100: FLASHINFER)" in logged


def test_no_flashinfer_mla_raises_naming_flashinfer():
    with pytest.raises(ValueError, match=r"(?s)MLA.*flashinfer.*No module named 'flashinfer'"):
        resolve_name("AUTO", H100_NO_FI, mla=True, dtype=torch.bfloat16)


def test_no_flashinfer_gqa_degrades_to_vanilla():
    res = resolve_name("AUTO", H100_NO_FI, mla=False, dtype=torch.bfloat16)
    assert res.name == "VANILLA" and "flashinfer" in res.reason


def test_flashinfer_mla_needs_sm80():
    with pytest.raises(ValueError, match="sm80"):
        resolve_name("AUTO", Probe("cuda", 75, True), mla=True, dtype=torch.bfloat16)
    assert resolve_name("AUTO", Probe("cuda", 75, True), mla=False, dtype=torch.bfloat16).name == "FLASHINFER"


def test_flashinfer_load_failure_is_a_clear_error(monkeypatch):
    def broken():
        raise ImportError("flashinfer_backend missing")
    monkeypatch.setitem(resolver._LOADERS, "FLASHINFER", broken)
    with pytest.raises(ValueError, match="FLASHINFER cannot be loaded"):
        create_backend("AUTO", torch.device("cpu"), torch.bfloat16, probe=H100)


def test_capacity_report_names_backend_and_reason(tiny_llama_dir, make_llm):
    rep = make_llm(tiny_llama_dir).capacity_report["attention_backend"]["target"]
    assert rep["name"] == "VANILLA" and "cpu" in rep["reason"]


def test_auto_with_an_fp8_kv_pool_skips_backends_without_fp8_kv(monkeypatch):
    """AUTO on CUDA with an fp8 KV pool: FLASHINFER declares fp8 KV (GQA pools), so it is picked; a
    FLASHINFER without it would be skipped for VANILLA, with the reason (a bf16 pool still gets it)."""
    from dataclasses import replace
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    assert resolve_name("AUTO", H100, mla=False, dtype=torch.bfloat16, fp8_kv=True).name == "FLASHINFER"
    assert resolve_name("AUTO", CPU, mla=False, dtype=torch.bfloat16, fp8_kv=True).name == "VANILLA"
    monkeypatch.setattr(FlashInferAttention, "capabilities", replace(FlashInferAttention.capabilities, fp8_kv=False))
    res = resolve_name("AUTO", H100, mla=False, dtype=torch.bfloat16, fp8_kv=True)
    assert res.name == "VANILLA" and "FLASHINFER: no fp8 KV" in res.reason
    assert resolve_name("AUTO", H100, mla=False, dtype=torch.bfloat16, fp8_kv=False).name == "FLASHINFER"


def test_dtype_is_checked_against_declared_capabilities():
    with_triton = Probe(device_type="cuda", sm=90, flashinfer_importable=True, triton_importable=True)
    f32 = torch.float32
    # explicit: a backend whose kernels do not take the model's dtype is refused, naming both
    with pytest.raises(ValueError, match="FLASHINFER cannot run: FLASHINFER runs float16/bfloat16 "
                                         "activations, the model runs float32"):
        resolve_name("FLASHINFER", H100, mla=False, dtype=f32)
    assert resolve_name("TRITON", with_triton, mla=True, dtype=f32).name == "TRITON"
    # AUTO, GQA: flashinfer is skipped with the reason, VANILLA runs float32
    res = resolve_name("AUTO", H100, mla=False, dtype=f32)
    assert res.name == "VANILLA" and "float32" in res.reason
    # AUTO, MLA: TRITON's absorbed-MLA decode where flashinfer cannot run float32; never VANILLA
    res = resolve_name("AUTO", with_triton, mla=True, dtype=f32)
    assert res.name == "TRITON" and "float32" in res.reason
    with pytest.raises(ValueError, match=r"(?s)never degrades: FLASHINFER: .*float32.*TRITON: triton is not"):
        resolve_name("AUTO", H100, mla=True, dtype=f32)
    # control: the same probes with bfloat16 keep flashinfer
    for mla in (False, True):
        assert resolve_name("AUTO", with_triton, mla=mla, dtype=torch.bfloat16).name == "FLASHINFER"
