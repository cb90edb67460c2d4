"""fp32 CPU logits of the paged engine model vs transformers on the same checkpoint.

The engine path is the real one: `load_target_model` -> `KVCacheManager` pages ->
`ModelEngine.forward` with VANILLA attention, prompts prefilled whole or in chunks.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch

from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models import load_target_model
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
from tensorrt_llm._torch.runtime.step import ForwardSegment
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper

TOL = 1e-4
CPU = torch.device("cpu")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def engine_logits(model: LlamaForCausalLM, ids: Sequence[int], chunks: Optional[Sequence[int]] = None,
                  tokens_per_block: int = 16, device: torch.device = CPU) -> torch.Tensor:
    """[len(ids), V] logits (on CPU) of every prompt position, prefilled in `chunks` (default: one)."""
    chunks = list(chunks or [len(ids)])
    assert sum(chunks) == len(ids)
    layers, kv_heads, head_dim = model.kv_cache_layout()
    spec = KVCacheSpec("target", "gqa", layers, 2, kv_heads, head_dim, torch.float32)
    pages = -(-len(ids) // tokens_per_block) + 2
    kv = KVCacheManager([spec], pages, tokens_per_block, len(ids) + 1, device)
    # Shuffle page order so a request's pages are not 0, 1, 2, ... (catches identity-table bugs).
    kv.pool.free_queue.move_to_end(0)
    engine = ModelEngine(model, kv, VanillaAttention(), device)
    kv.add_sequence(7, ids, len(ids))
    out, start = [], 0
    for n in chunks:
        kv.ensure_capacity(7, start + n)
        fo = engine.forward([ForwardSegment(7, list(ids[start:start + n]), start, n)])
        out.append(fo.logits.cpu())
        start += n
    return torch.cat(out)


def load(folder: Path, device: torch.device = CPU) -> LlamaForCausalLM:
    return load_target_model(folder, torch.float32, device, max_positions=600)


def prompt_ids(folder: Path, text: str, repeat: int = 1) -> list[int]:
    return TokenizerWrapper(folder).encode(" ".join([text] * repeat))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, hf_reference):
    ids = prompt_ids(tiny_llama_dir, "the quick brown fox jumps over the lazy dog", repeat=4)
    return tiny_llama_dir, ids, hf_reference.logits(hf_reference.load(tiny_llama_dir), ids)


def test_config_reads_transformers_v5_rope_parameters(tiny_llama_dir):
    """transformers >= 5 nests rope_theta under `rope_parameters`; it must not fall back to 1e4."""
    import json
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 1000.0
    assert load(tiny_llama_dir).config.rope_theta == 1000.0
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"} | {"rope_theta": 123.0}
    assert LlamaConfig.from_dict(legacy, "x").rope_theta == 123.0


@pytest.mark.parametrize("chunks", [None, [5, 11, 7], [16, 1, 1]], ids=["whole", "3chunks", "page-edge"])
def test_tiny_llama_logits_match_hf(tiny, chunks):
    folder, ids, ref = tiny
    if chunks is not None:
        chunks = chunks + [len(ids) - sum(chunks)]
    assert ids and len(ids) > 32          # spans several 16-token pages
    err = rel_err(engine_logits(load(folder), ids, chunks), ref)
    assert err < TOL, f"relative error {err:.2e}"


def test_negative_control_perturbed_weight(tiny):
    folder, ids, ref = tiny
    model = load(folder)
    with torch.no_grad():
        w = model.model.layers[1].self_attn.o_proj.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std())
    err = rel_err(engine_logits(model, ids), ref)
    assert err > 100 * TOL, f"perturbed weight still within tolerance ({err:.2e})"


def test_negative_control_wrong_rope_theta(tiny):
    folder, ids, ref = tiny
    good = load(folder)
    cfg = dataclasses.replace(good.config, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg, max_positions=600).eval()
    model.load_state_dict(good.state_dict())
    err = rel_err(engine_logits(model, ids), ref)
    assert err > 100 * TOL, f"wrong rope theta still within tolerance ({err:.2e})"


def test_tiny_qwen2_bias_logits_match_hf(tiny_qwen2_dir, hf_reference):
    ids = prompt_ids(tiny_qwen2_dir, "hello world, what is the capital of france?", repeat=2)
    ref = hf_reference.logits(hf_reference.load(tiny_qwen2_dir), ids)
    model = load(tiny_qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert float(model.model.layers[0].self_attn.k_proj.bias.detach().abs().sum()) > 0
    for chunks in (None, [9, len(ids) - 9]):
        err = rel_err(engine_logits(model, ids, chunks), ref)
        assert err < TOL, f"chunks={chunks}: relative error {err:.2e}"
    # negative control: dropping the q/k/v biases is visible
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.zero_()
    assert rel_err(engine_logits(model, ids), ref) > 100 * TOL


def test_real_model_logits_match_hf(real_model, hf_reference):
    ids = prompt_ids(real_model, "The capital of France is Paris. The capital of Germany is")
    ref = hf_reference.logits(hf_reference.load(real_model), ids)
    model = load(real_model)
    for chunks in (None, [4, 3, len(ids) - 7]):
        err = rel_err(engine_logits(model, ids, chunks), ref)
        assert err < TOL, f"chunks={chunks}: relative error {err:.2e}"


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_logits_match_hf(kind, tmp_path, hf_reference, write_checkpoint):
    """rope_parameters with a scaling type (as transformers 5 writes them), past the original window."""
    folder = write_checkpoint(tmp_path / kind, "llama", num_layers=2, seed=4,
                                   rope_parameters={"rope_theta": 5000.0, **ROPE_SCALINGS[kind]})
    ids = prompt_ids(folder, "the quick brown fox jumps over the lazy dog", repeat=5)
    assert len(ids) > 64
    model = load(folder)
    assert model.config.rope_scaling["rope_type"] == kind
    err = rel_err(engine_logits(model, ids, [40, len(ids) - 40]), hf_reference.logits(hf_reference.load(folder), ids))
    assert err < TOL, f"{kind}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_vanilla_logits_match_hf(arch, tiny_llama_dir, tiny_qwen2_dir, hf_reference):
    """The same paged fp32 path on CUDA (tables, slots, rotary tables all on the device)."""
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    ids = prompt_ids(folder, "the quick brown fox jumps over the lazy dog", repeat=4)
    ref = hf_reference.logits(hf_reference.load(folder), ids)
    model = load(folder, torch.device("cuda"))
    for chunks in (None, [21, len(ids) - 21]):
        err = rel_err(engine_logits(model, ids, chunks, device=torch.device("cuda")), ref)
        assert err < TOL, f"chunks={chunks}: relative error {err:.2e}"
