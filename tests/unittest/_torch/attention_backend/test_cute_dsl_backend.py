"""CUTEDSL (`cute_dsl_backend`): TRITON attention with the drafter's norm + RoPE prep in the CuTe DSL kernel.

The drafter-level check: one device draft step (context write of every layer -> block through the layers
-> greedy Markov drafts, `DraftGraphRunner`) on CUTEDSL gives TRITON's drafts, and its draft-pool writes
and block hidden within 1e-5 (float32) of TRITON's fused appends; the prep ran on every layer (GQA: q and
k; MLA: the query's rope part, the block's latents and the context latents of all layers). Negative
control: a prep one normed column short lands beyond 1e-2. CPU: the prep's torch reference and Triton's
interpreter (the wiring); GPU (H200): the kernel, the step captured in a CUDA graph, float32 (drafts
equal) and bfloat16 (writes within 2e-2 norm-relative, drafts equal up to a near tie, as
`test_dspark_regions`); the engine with CUDA graphs (TRITON target) keeps CUTEDSL for its draft graphs
and its greedy output equals no-spec's. Refusals: an explicit CUTEDSL on the CPU through `LLM`; a drafter
whose layers cannot hand their inputs over unrotated (interleaved RoPE) at load.
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
    """Every prep call (the backend's and an MLA drafter's context write) recorded by its norm_dim into
    prep["calls"]; prep["short"] = True: one normed column fewer (the negative control)."""
    real, state = cute_norm_rope.norm_rope, {"calls": [], "short": False}

    def spy(x, cos, sin, out, norm_dim, weight=None, **kw):
        state["calls"].append(norm_dim)
        if state["short"] and norm_dim > 1:
            norm_dim, weight = norm_dim - 1, weight[..., :-1].contiguous()
        return real(x, cos, sin, out, norm_dim, weight, **kw)
    monkeypatch.setattr(cute_dsl_backend, "norm_rope", spy)
    monkeypatch.setattr(cute_norm_rope, "norm_rope", spy)
    return state


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_drafter_step_on_cutedsl_equals_triton(kind, device, prep):
    d = _drafter(kind, torch.device(device), torch.float32, **(MLA_WIDTHS if kind == "mla" else {}))
    capture = device == "cuda"
    want_rows, want_pool, want_hidden = _draft_step(d, TritonAttention(), capture)
    rows, pool, hidden = _draft_step(d, CuteDslAttention(), capture)
    cfg, layers = d.config, len(d.layers)
    # GQA: q and k of every layer; MLA: the context latents of all layers at once, then per layer the
    # query's rope part and the block's latents (captured: the warm-up run and the capture run)
    one = [cfg.head_dim] * 2 * layers if kind == "gqa" else [cfg.kv_lora_rank] + [0, cfg.kv_lora_rank] * layers
    assert prep["calls"] == one * (2 if capture else 1)
    assert torch.equal(rows, want_rows) and _rel(pool, want_pool) < 1e-5
    if not capture:
        assert _rel(hidden, want_hidden) < 1e-5
    prep["short"] = True
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
    from tensorrt_llm._torch.attention_backend.cute_norm_rope_kernel import compiled_norm_rope
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
    assert stats["draft_tokens"] > 0 and compiled_norm_rope.cache_info().currsize > 0
