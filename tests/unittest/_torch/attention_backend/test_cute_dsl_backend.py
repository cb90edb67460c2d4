"""CUTEDSL (`cute_dsl_backend`): TRITON attention with the drafter's norm + RoPE prep and the page-bounded
K/V (latent) append as one CuTe DSL launch per layer (`cute_rope_append`).

The drafter-level check: one device draft step (context write of every layer -> block through the layers
-> greedy Markov drafts, `DraftGraphRunner`) on CUTEDSL gives TRITON's drafts, and its draft-pool writes
and block hidden within 1e-5 (float32) of TRITON's fused appends; the fused op ran once per layer (GQA:
`cute_rope_append`; MLA: `cute_mla_rope_append`, after the CuTe norm + RoPE of the context latents of all
layers) and nothing else prepared rows. Negative control: the fused op given tables one position off lands
beyond 1e-2. CPU: the op's torch reference and Triton's interpreter (the wiring); GPU (H200): the kernels,
the step captured in a CUDA graph, float32 (drafts equal) and bfloat16 (writes within 2e-2 norm-relative,
drafts equal up to a near tie, as `test_dspark_regions`); an eager GQA step launches as many kernels on
CUTEDSL as on TRITON; the engine with CUDA graphs (TRITON target) keeps CUTEDSL for its draft graphs, its
greedy output equals no-spec's (bf16), and in float32 its outputs and acceptance equal a TRITON drafter's.
Refusals: an explicit CUTEDSL on the CPU through `LLM`; a drafter whose layers cannot hand their inputs over
unrotated (interleaved RoPE) at load.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm import SamplingParams  # noqa: E402
from tensorrt_llm._torch.attention_backend import cute_dsl_backend, cute_norm_rope  # noqa: E402
from tensorrt_llm._torch.attention_backend.cute_dsl_backend import CuteDslAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.resolver import Resolution  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention  # noqa: E402
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase  # noqa: E402
from tensorrt_llm._torch.speculative import dspark_worker  # noqa: E402

from tests.unittest._torch.models.test_dspark_regions import (_diverge_only_at_near_ties, _draft_step,  # noqa: E402
                                                              _drafter, _norm_rel, _rel)
from tests.unittest._torch.pyexecutor.spec_runs import dspark_spec  # noqa: E402

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
MLA_WIDTHS = {"qk_rope_head_dim": 16}      # the TRITON MLA kernel's smallest rope width


@pytest.fixture
def prep(monkeypatch) -> dict:
    """Every prep call recorded into prep["calls"]: "gqa" / "mla" for the backend's fused op, the norm_dim
    of a norm_rope call (an MLA drafter's context write); prep["shift"] = True: the fused op gets tables
    one position off (the negative control)."""
    state = {"calls": [], "shift": False}
    real_norm_rope = cute_norm_rope.norm_rope

    def fused(kind: str, real):
        def spy(*args, **kw):
            state["calls"].append(kind)
            if state["shift"]:
                a = list(args)                   # cos, sin follow (q, k, v) / (q_lat, q_pe, kv)
                a[3], a[4] = torch.roll(a[3], 1, 0), torch.roll(a[4], 1, 0)
                args = tuple(a)
            return real(*args, **kw)
        return spy

    def norm_spy(x, cos, sin, out, norm_dim, weight=None, **kw):
        state["calls"].append(norm_dim)
        return real_norm_rope(x, cos, sin, out, norm_dim, weight, **kw)
    monkeypatch.setattr(cute_dsl_backend, "cute_rope_append", fused("gqa", cute_dsl_backend.cute_rope_append))
    monkeypatch.setattr(cute_dsl_backend, "cute_mla_rope_append",
                        fused("mla", cute_dsl_backend.cute_mla_rope_append))
    monkeypatch.setattr(cute_norm_rope, "norm_rope", norm_spy)
    return state


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_drafter_step_on_cutedsl_equals_triton(kind, device, prep):
    d = _drafter(kind, torch.device(device), torch.float32, **(MLA_WIDTHS if kind == "mla" else {}))
    capture = device == "cuda"
    want_rows, want_pool, want_hidden = _draft_step(d, TritonAttention(), capture)
    rows, pool, hidden = _draft_step(d, CuteDslAttention(), capture)
    cfg, layers = d.config, len(d.layers)
    # GQA: one fused launch per layer; MLA: the context latents of all layers at once, then one fused
    # launch per layer (captured: the warm-up run and the capture run)
    one = ["gqa"] * layers if kind == "gqa" else [cfg.kv_lora_rank] + ["mla"] * layers
    assert prep["calls"] == one * (2 if capture else 1)
    assert torch.equal(rows, want_rows) and _rel(pool, want_pool) < 1e-5
    if not capture:
        assert _rel(hidden, want_hidden) < 1e-5
    prep["shift"] = True
    _, bad_pool, _ = _draft_step(d, CuteDslAttention(), capture)
    assert _rel(bad_pool, want_pool) > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_bfloat16_drafter_step_on_cutedsl_is_tritons_within_bf16(kind):
    d = _drafter(kind, torch.device("cuda"), torch.bfloat16, **(MLA_WIDTHS if kind == "mla" else {}))
    want_rows, want_pool, hidden = _draft_step(d, TritonAttention())
    with torch.inference_mode():
        want_ids, logits = d.propose(hidden, want_rows[:, 1].clone(), want_rows.shape[1] - 2)
    rows, pool, _ = _draft_step(d, CuteDslAttention(), capture=True)
    assert torch.equal(rows[:, :2], want_rows[:, :2]) and _norm_rel(pool, want_pool) < 2e-2
    _diverge_only_at_near_ties(rows[:, 2:].cpu(), want_ids.cpu(), logits.float().cpu(), 0.05)


def test_explicit_cutedsl_on_cpu_raises_through_llm(make_llm, tiny_llama_dir, tiny_drafters):
    spec = {**dspark_spec(tiny_drafters["mla"]), "attention_backend": "CUTEDSL"}
    with pytest.raises(ValueError, match=r"attention backend CUTEDSL cannot run: CUTEDSL needs a CUDA device"):
        make_llm(tiny_llama_dir, speculative_config=spec)


def test_drafter_that_cannot_hand_over_unrotated_inputs_is_refused(make_llm, tiny_llama_dir, tiny_drafters,
                                                                   tmp_path, monkeypatch):
    """The resolver passed (as on an H200): a drafter with interleaved RoPE (its layers rotate q / k
    themselves) is refused at load, naming the layers; control: the shipped layout loads on CUTEDSL."""
    monkeypatch.setattr(dspark_worker, "create_backend",
                        lambda *a, **k: (CuteDslAttention(), Resolution("CUTEDSL", "explicit choice")))
    from tensorrt_llm._torch.models.checkpoint import read_config
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "target")
    DSparkForCausalLMBase.random_init("gqa", tc, seed=3, rope_interleave=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"attention backend CUTEDSL norms and rotates the drafter's q / k .* "
                                         r"layers \[0, 1\] of .* cannot hand them over unrotated"):
        make_llm(tiny_llama_dir, speculative_config={**dspark_spec(str(tmp_path)), "attention_backend": "CUTEDSL"})
    llm = make_llm(tiny_llama_dir, speculative_config={**dspark_spec(tiny_drafters["gqa"]),
                                                       "attention_backend": "CUTEDSL"})
    assert llm.capacity_report["attention_backend"]["draft"]["name"] == "CUTEDSL"
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_engine_with_a_cutedsl_drafter_is_lossless_in_graphs(llama64_dir, tmp_path_factory, kind):
    """The engine on the H200: a drafter at the shipped widths (GQA 2 KV heads x 64; MLA 512 + 64) on CUTEDSL
    with CUDA graphs keeps its backend for the draft graphs (the kernel captured there and in the one-graph
    step), and greedy output equals the no-spec graph engine's token for token."""
    from tensorrt_llm import LLM
    from tensorrt_llm._torch.attention_backend.cute_rope_append_kernel import (compiled_mla_rope_append,
                                                                               compiled_rope_append)
    from tests.unittest._torch.speculative.test_draft_graph import PROMPTS
    from tests.unittest._torch.speculative.test_draft_graph import _drafter as graph_drafter
    drafter = graph_drafter(tmp_path_factory, llama64_dir, kind)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 17, 29, 8, 33, 21)]
    common = dict(device="cuda", attn_backend="TRITON", max_batch_size=4, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    with LLM(str(llama64_dir), **common) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    spec = {**dspark_spec(str(drafter)), "attention_backend": "CUTEDSL"}
    with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
        assert llm.capacity_report["attention_backend"]["draft"]["name"] == "CUTEDSL"
        worker = llm._executor.drafter
        assert isinstance(worker.backend, CuteDslAttention) and worker.graph_runner.backend is worker.backend
        toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.get_stats()["speculative"]
    assert toks == baseline
    fused = compiled_rope_append if kind == "gqa" else compiled_mla_rope_append
    assert stats["draft_tokens"] > 0 and fused.cache_info().currsize > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_float32_engine_drafts_on_cutedsl_equal_tritons(llama64_dir, tmp_path_factory, kind):
    """The engine on the H200 in float32 (CUDA graphs, TRITON target): a CUTEDSL drafter and a TRITON
    drafter (the same checkpoint) give the same outputs and the same acceptance, i.e. the same drafts
    (float32: the kernels agree within ~1e-6, far from a tie between logits)."""
    from tensorrt_llm import LLM
    from tests.unittest._torch.speculative.test_draft_graph import PROMPTS
    from tests.unittest._torch.speculative.test_draft_graph import _drafter as graph_drafter
    drafter = graph_drafter(tmp_path_factory, llama64_dir, kind)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 17, 29, 8, 33, 21)]
    common = dict(device="cuda", dtype="float32", attn_backend="TRITON", max_batch_size=4, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    runs = {}
    for name in ("TRITON", "CUTEDSL"):
        spec = {**dspark_spec(str(drafter)), "attention_backend": name}
        with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
            assert llm.capacity_report["attention_backend"]["draft"]["name"] == name
            toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            stats = llm.get_stats()["speculative"]
            runs[name] = (toks, stats["draft_tokens"], stats["accepted_tokens"])
    assert runs["CUTEDSL"] == runs["TRITON"] and runs["TRITON"][1] > 0


@pytest.mark.gpu
def test_an_eager_gqa_draft_step_launches_as_many_kernels_as_on_triton():
    """The point of the fused op: a GQA drafter's eager draft step on CUTEDSL launches the same number of
    GPU kernels as on TRITON (one prep + append launch per layer each), and none of Triton's rope appends."""
    from torch.profiler import ProfilerActivity, profile
    d = _drafter("gqa", torch.device("cuda"), torch.float32)
    counts, names = {}, {}
    for backend in (TritonAttention(), CuteDslAttention()):
        _draft_step(d, backend)                                  # warm-up: compiles
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _draft_step(d, backend)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "emcpy" not in e.name and "emset" not in e.name]
        counts[backend.name], names[backend.name] = len(kernels), kernels
    assert sum("_rope_append_kernel" in n for n in names["TRITON"]) == len(d.layers)
    assert not any("_rope_append_kernel" in n for n in names["CUTEDSL"])
    assert counts["CUTEDSL"] == counts["TRITON"], (names["CUTEDSL"], names["TRITON"])
