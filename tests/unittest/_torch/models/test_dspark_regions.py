"""DSpark drafter regions (`dspark_regions`): the eager functions are the drafter's own path, and the
inductor-compiled ones agree with them, through the device draft step (`DraftGraphRunner`: context
features -> draft context of every layer -> block through the layers -> greedy Markov drafts).

CPU (float32, tiny GQA and MLA drafters with weights at 1 / sqrt(fan_in) and random norm weights,
VANILLA attention, the step run directly): the eager regions (what a loaded drafter runs) give
bitwise the module path's draft ids, block hidden and draft-pool writes, and the unfused drafter's
within 1e-5 (also with interleaved RoPE, and MLA with q_lora; GQA's K and V are one buffer's
halves, one cache write for both); the inductor regions give the same draft ids, and hidden / pool
writes / propose logits within 1e-4 relative (max error over max value), while the compiled drafter
with one weight x3 (negative control) lands beyond 1e-2 (measured: ~0.6).
On TRITON (Triton's interpreter) a drafter's norms and RoPE run in the backend's fused append (GQA:
`forward_rope` with the layer's `HeadNorms`; MLA: `forward_mla_rope`): the same drafts, hidden and
pool writes within 1e-5; without the norms (control) beyond 1e-2. There the block joins each layer's
output to the next layer's projections (the last one's to the final norm), eager and compiled.
An MLA drafter with W_UK folded into its q projection (`fold_mla_query`) runs the same step through
one q GEMM per layer within 1e-5 (eager, TRITON) / 1e-4 (inductor) of the unfolded one.
`LLM(torch_compile_config=...)` with a DSpark drafter (MLA also with both folds) reports the drafter's
regions and its greedy output equals no-spec token for token; an FP8 drafter keeps its modules except `propose`; an
unfused drafter is refused.
GPU (bf16, TRITON attention): the step with the inductor regions captured in a CUDA graph vs run
directly with the eager regions: the pool writes within 2e-2 (norm-relative; bf16 on the CPU
measured 0.004) and the control beyond 0.08 (CPU bf16: 0.16-0.17); each row's drafts equal up to a
first divergence that is a near tie of the eager logits (within 5% of a std). The same bounds hold
for TRITON's fused appends against VANILLA through the regions' own norms and RoPE.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from torch import nn

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.attention_backend.interface import AttentionBackend, joint_kv
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.dspark_regions import DrafterRegions
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.runtime.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.runtime.step import VerifiedSegment
from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner
from tensorrt_llm._torch.speculative.dspark_worker import draft_kv_cache_spec

from tests.unittest._torch.pyexecutor.spec_runs import dspark_spec

P, Q, S = 16, 5, 4            # page, verify rows (K + 1 with K = 4 drafts, shift_label), block
# per request: (first verified position, committed tokens); 3 requests, so that no token count equals
# another dimension (dynamo's duck sizing would specialize the first trace to it)
CASES = [(20, 2), (8, 5), (30, 1)]
VOCAB, HIDDEN = 512, 64
CPU = torch.device("cpu")
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}


def _target_config() -> LlamaConfig:
    """The tiny Llama's shape (conftest), so that the LLM test reuses the compiled traces (dynamo
    guards on eps and on parameter shapes)."""
    return LlamaConfig("LlamaForCausalLM", VOCAB, HIDDEN, 2 * HIDDEN, 3, 4, 2, HIDDEN // 4, 1e-5, 1000.0, None,
                       512, True, False, 1, 2)


def _drafter(kind: str, device: torch.device, dtype: torch.dtype, fused: bool = True,
             **overrides) -> DSparkForCausalLMBase:
    """A loaded drafter (post_load_weights: fused projections, the eager regions) bound to a random
    embedding / lm_head. Weights at 1 / sqrt(fan_in) and norm weights around 1 make the drafts
    depend on context and anchor, and every weight a region reads matter."""
    d = DSparkForCausalLMBase.random_init(kind, _target_config(), seed=2, block_size=S, markov_rank=4, **overrides)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5)
    d = d.to(device=device, dtype=dtype)
    if fused:
        d.post_load_weights()
    d.bind_target(embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype))
    return d


def _module_path(d: DSparkForCausalLMBase) -> None:
    d.regions = None
    for layer in d.layers:
        layer.regions = None


def _perturbed(d: DSparkForCausalLMBase) -> None:
    with torch.no_grad():
        d.layers[0].mlp.down_proj.weight.mul_(3.0)


def _req(rid: int, start: int, n: int) -> LlmRequest:
    """A greedy generating request that committed n tokens from `start`."""
    toks = [3 + (7 * rid + i) % (VOCAB - 4) for i in range(start + n + 1)]
    req = LlmRequest(rid, toks[:6], SamplingParams(max_tokens=64, ignore_eos=True))
    req.output_token_ids = toks[6:]
    req.num_computed = start + n
    req.state = RequestState.GENERATION
    return req


def _draft_step(d: DSparkForCausalLMBase, backend: AttentionBackend, capture: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One device draft step over CASES on a fresh pool (the same random earlier context every call) ->
    (rows [B, 2 + K] int64 [committed | anchor, drafts], what it wrote into the draft pool (new - old,
    float32), the block hidden [B * S, H] (None when captured: a graph's intermediate))."""
    dev, dtype = d.norm.weight.device, d.norm.weight.dtype
    kv = KVCacheManager([KVCacheSpec("target", "gqa", 1, 2, 1, 16, dtype), draft_kv_cache_spec(d, dtype)], 24, P,
                        128, dev)
    g = torch.Generator().manual_seed(1)
    for cache in kv.layer_caches("draft"):
        cache.copy_(torch.randn(cache.shape, generator=g))
    before = kv.pools["draft"].to(torch.float32, copy=True)
    reqs = [_req(rid, start, n) for rid, (start, n) in enumerate(CASES)]
    for r in reqs:
        kv.add_sequence(r.request_id, [1], 128)
        kv.ensure_capacity(r.request_id, 48)
    items = [VerifiedSegment(r, j * Q, start, Q, j) for j, (r, (start, _)) in enumerate(zip(reqs, CASES))]
    verified = torch.tensor([[r.token_at(start + 1 + i) for i in range(n)] + [-1] * (Q - n)
                             for r, (start, n) in zip(reqs, CASES)], device=dev)
    width = d.config.fc_in_features
    captured = torch.randn(len(CASES) * Q, width, generator=g).to(device=dev, dtype=dtype)
    runner = DraftGraphRunner(d, kv, backend, kv.layer_caches("draft"), dev, len(CASES), verify_widths=[Q],
                              num_drafts=Q - 1, capture=capture)
    hidden: list[torch.Tensor] = []
    forward_block = d.forward_block

    def spy(*args):
        hidden.append(forward_block(*args))
        return hidden[-1]
    d.forward_block = spy
    try:
        ahead = runner.launch(items, [Q] * len(CASES), verified, captured)
    finally:
        del d.forward_block
    assert ahead is not None and runner.graphs.num_replays == 1
    return ahead.tokens.device.clone(), kv.pools["draft"].float() - before, None if capture else hidden[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _diverge_only_at_near_ties(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, tie: float) -> None:
    """Draft ids [R, K] of two paths agree in each row up to its first divergence, and there the
    reference's logits [R, K, V] of the two picks lie within `tie` of a std (a flipped near tie;
    the later drafts follow other Markov context)."""
    for b in range(got.shape[0]):
        j = next((j for j in range(got.shape[1]) if got[b, j] != want[b, j]), None)
        if j is not None:
            row = logits[b, j]
            gap = float((row[got[b, j]] - row[want[b, j]]).abs())
            assert gap < tie * float(row.std()), f"row {b} diverged at draft {j}: logit gap {gap:.4f}"


@pytest.mark.parametrize("kind,variant", [("gqa", {}), ("mla", {}), ("gqa", {"rope_interleave": True}),
                                          ("mla", {"q_lora_rank": 24, "rope_interleave": True})])
def test_eager_regions_are_the_module_path(kind, variant):
    d = _drafter(kind, CPU, torch.float32, **variant)
    assert d.regions == DrafterRegions.eager() and all(layer.regions == d.regions for layer in d.layers)
    rows, pool, hidden = _draft_step(d, VanillaAttention())
    if kind == "gqa":                                    # K and V one buffer's halves: one cache write for both
        with torch.inference_mode():
            planes = d._context_planes(d.layers[0], torch.randn(3, HIDDEN), torch.arange(3), d.regions)
            assert joint_kv(*planes) is not None
    _module_path(d)
    want_rows, want_pool, want_hidden = _draft_step(d, VanillaAttention())
    assert torch.equal(rows, want_rows) and torch.equal(pool, want_pool) and torch.equal(hidden, want_hidden)
    assert bool((pool != 0).any())                       # the step wrote draft KV
    # fusing q|k|v and gate|up only re-rounds: the unfused drafter (its training-time modules) agrees
    raw_rows, raw_pool, raw_hidden = _draft_step(_drafter(kind, CPU, torch.float32, fused=False, **variant),
                                                 VanillaAttention())
    assert torch.equal(raw_rows, rows) and _rel(raw_pool, pool) < 1e-5 and _rel(raw_hidden, hidden) < 1e-5
    _perturbed(d)                                        # control: the path reads the perturbed weight
    assert _rel(_draft_step(d, VanillaAttention())[2], hidden) > 1e-2


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_inductor_regions_match_eager_on_cpu(kind):
    d = _drafter(kind, CPU, torch.float32)
    want_rows, want_pool, want_hidden = _draft_step(d, VanillaAttention())
    with torch.inference_mode():        # as the engine calls propose_greedy
        anchors = want_rows[:, 1].clone()
        want_ids, _ = d.propose(want_hidden, anchors, Q - 1)                # the module path
        assert torch.equal(d.propose_greedy(want_hidden, anchors, Q - 1), want_ids)   # eager regions
        d.use_regions(DrafterRegions.inductor())
        ids = d.propose_greedy(want_hidden, anchors, Q - 1)
        other = (anchors + 1) % VOCAB         # other anchors: other first Markov biases, the same agreement
        assert torch.equal(d.propose_greedy(want_hidden, other, Q - 1), d.propose(want_hidden, other, Q - 1)[0])
    rows, pool, hidden = _draft_step(d, VanillaAttention())
    assert torch.equal(rows, want_rows) and torch.equal(ids, want_ids)
    assert torch.equal(want_rows[:, 2:], want_ids)       # the step's drafts are propose's
    assert _rel(pool, want_pool) < 1e-4 and _rel(hidden, want_hidden) < 1e-4
    _perturbed(d)                                        # control: the compiled regions read the weights passed
    assert _rel(_draft_step(d, VanillaAttention())[2], want_hidden) > 1e-2


@pytest.mark.parametrize("regions", [DrafterRegions.eager(), DrafterRegions.inductor()], ids=["eager", "inductor"])
def test_gqa_attention_inputs_are_one_qkv_buffer(regions):
    """The drafter's q, k and v are the views of one [T, Hq + 2 Hkv, D] buffer (one pointwise kernel
    compiled; k and v its halves: one cache write), equal to the eager region's. Control: k and v
    of two allocations are not joint."""
    d = _drafter("gqa", CPU, torch.float32)
    a, n, t = d.layers[0].self_attn, d.layers[0].input_layernorm, 7
    pos = torch.arange(3, 3 + t)
    args = (torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(5)), n.weight, *a._qkv, a.q_norm.weight,
            a.k_norm.weight, n.eps, pos, *a.rotary.tables(CPU), a.rotary.interleaved, a.num_heads, a.num_kv_heads,
            a.head_dim)
    with torch.inference_mode():
        q, k, v = regions.gqa_attention_inputs(*args)
        want = DrafterRegions.eager().gqa_attention_inputs(*args)
    hq, d_ = a.num_heads, a.head_dim
    assert q.stride() == k.stride() == v.stride() == ((hq + 2 * a.num_kv_heads) * d_, d_, 1)
    assert k.data_ptr() == q.data_ptr() + hq * d_ * q.element_size() and joint_kv(k, v) is not None
    assert all(_rel(x, y) < 1e-5 for x, y in zip((q, k, v), want))
    assert joint_kv(k.clone(), v.clone()) is None


def _spied_triton(calls: list, drop_norms: bool = False):
    """A TRITON backend whose fused appends record their norms (GQA: `HeadNorms`; MLA: the latent
    norm's weight); drop_norms: GQA without its norms, MLA with a unit latent norm weight."""
    pytest.importorskip("triton")
    from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
    tri = TritonAttention()
    forward_rope, forward_mla_rope = tri.forward_rope, tri.forward_mla_rope

    def gqa(*args):
        calls.append(args[-1])
        return forward_rope(*args[:-1], None if drop_norms else args[-1])

    def mla(q_lat, q_pe, kv, cos, sin, norm_weight, *rest, **projections):
        calls.append(norm_weight)
        return forward_mla_rope(q_lat, q_pe, kv, cos, sin, torch.ones_like(norm_weight) if drop_norms else norm_weight,
                                *rest, **projections)
    tri.forward_rope, tri.forward_mla_rope = gqa, mla
    return tri


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_layers_hand_norms_and_rope_to_a_fusing_backend(kind):
    """On TRITON (`fused_rope_append`) a drafter layer stops at its projections and the backend norms,
    rotates and appends in one launch: GQA's per-head q / k norms (`forward_rope` with the layer's
    `HeadNorms`), MLA's latent norm and both RoPEs (`forward_mla_rope`). The step's drafts equal
    VANILLA's (the regions' own norms and RoPE), its hidden and pool writes within 1e-5. Controls:
    the launch without the norms is far off; VANILLA refuses a fused layer by name."""
    d = _drafter(kind, CPU, torch.float32, **({"qk_rope_head_dim": 16} if kind == "mla" else {}))
    want_rows, want_pool, want_hidden = _draft_step(d, VanillaAttention())
    calls: list = []
    rows, pool, hidden = _draft_step(d, _spied_triton(calls))
    assert len(calls) == len(d.layers)
    for layer, c in zip(d.layers, calls):
        a = layer.self_attn
        assert c == a.head_norms() if kind == "gqa" else c is a.kv_a_layernorm.weight
    assert torch.equal(rows, want_rows) and _rel(pool, want_pool) < 1e-5 and _rel(hidden, want_hidden) < 1e-5
    _, bad_pool, bad_hidden = _draft_step(d, _spied_triton([], drop_norms=True))
    assert _rel(bad_hidden, want_hidden) > 1e-2 and _rel(bad_pool, want_pool) > 1e-2
    t = 3
    with pytest.raises(ValueError, match="fused_rope_append \\(VANILLA\\)"):
        d.layers[0].attention(torch.zeros(t, HIDDEN), torch.arange(t), None, None, VanillaAttention(),
                              d.rotary.cos_sin(torch.arange(t)))
    if kind == "gqa":                     # norms without the fused rotation would be dropped: refused
        a = d.layers[0].self_attn
        with pytest.raises(ValueError, match="head_norms go with rope"):
            a.core(*[torch.zeros(t, 4, 16)] * 3, None, None, VanillaAttention(), head_norms=a.head_norms())


def _counting(regions: DrafterRegions, counts: dict) -> DrafterRegions:
    """`regions` whose layer-output functions count their calls in `counts` (by field name)."""
    def counted(name: str):
        fn = getattr(regions, name)

        def run(*args):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args)
        return run
    names = ("output", "output_then_qkv", "mla_output_then_parts", "output_then_norm")
    return dataclasses.replace(regions, **{n: counted(n) for n in names})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_fused_block_joins_each_output_to_the_next_inputs(kind, compiled):
    """On a `fused_rope_append` backend the block runs one region between two attentions: each layer's
    output joined to the next layer's projections (`output_then_qkv` / `mla_output_then_parts`), the last
    one's to the final norm (`output_then_norm`); never the lone `output`. The drafts equal VANILLA's
    (layer by layer), the hidden and pool writes within 1e-5 (eager) / 1e-4 (inductor). Control: the
    second layer's input norm x3 moves the hidden beyond 1e-2 (the joined region reads the next layer's
    norm, not its own)."""
    d = _drafter(kind, CPU, torch.float32, **({"qk_rope_head_dim": 16} if kind == "mla" else {}))
    want_rows, want_pool, want_hidden = _draft_step(d, VanillaAttention())
    counts: dict = {}
    d.use_regions(_counting(DrafterRegions.inductor() if compiled else DrafterRegions.eager(), counts))
    rows, pool, hidden = _draft_step(d, _spied_triton([]))
    joined = "mla_output_then_parts" if kind == "mla" else "output_then_qkv"
    assert counts == {joined: len(d.layers) - 1, "output_then_norm": 1}
    tol = 1e-4 if compiled else 1e-5
    assert torch.equal(rows, want_rows) and _rel(pool, want_pool) < tol and _rel(hidden, want_hidden) < tol
    with torch.no_grad():
        d.layers[1].input_layernorm.weight.mul_(3.0)
    assert _rel(_draft_step(d, _spied_triton([]))[2], want_hidden) > 1e-2


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": 24}])
def test_folded_query_through_the_regions(variant):
    """`fold_mla_query` (W_UK folded into the q projection: q_lat | q_pe out of one GEMM, `q_weights`
    with W_UK None) through the device draft step: the eager regions give the unfolded drafter's drafts,
    hidden and pool writes within 1e-5 (measured <= 1e-6) and bitwise the folded module path; TRITON's
    fused append (`mla_attention_parts` -> `forward_mla_rope`) the same within 1e-5; with fold_mla_output
    too, the eager regions within 1e-5 and the inductor regions within 1e-4. Control: a fold from W_UK
    with its heads rolled lands beyond 1e-2 (measured: hidden 0.55 - 0.93)."""
    d = _drafter("mla", CPU, torch.float32, qk_rope_head_dim=16, **variant)
    want_rows, want_pool, want_hidden = _draft_step(d, VanillaAttention())

    def close(step: tuple, tol: float) -> bool:
        rows, pool, hidden = step
        return torch.equal(rows, want_rows) and _rel(pool, want_pool) < tol and _rel(hidden, want_hidden) < tol
    d.fold_mla_query()
    assert all(layer.self_attn.q_weights()[3] is None for layer in d.layers)
    eager = _draft_step(d, VanillaAttention())
    assert close(eager, 1e-5) and close(_draft_step(d, _spied_triton([])), 1e-5)
    _module_path(d)
    assert all(torch.equal(a, b) for a, b in zip(_draft_step(d, VanillaAttention()), eager))
    d.use_regions(DrafterRegions.eager())
    d.fold_mla_output()
    assert close(_draft_step(d, VanillaAttention()), 1e-5)
    d.use_regions(DrafterRegions.inductor())
    assert close(_draft_step(d, VanillaAttention()), 1e-4)
    for layer in d.layers:                               # control: the fold reads W_UK per head
        layer.self_attn.w_uk = layer.self_attn.w_uk.roll(1, dims=0)
        layer.self_attn.fold_query()
    assert _rel(_draft_step(d, VanillaAttention())[2], want_hidden) > 1e-2


@pytest.mark.parametrize("kind,folds", [("gqa", {}), ("mla", {}),
                                        ("mla", {"mla_fold_query": True, "mla_fold_output": True})])
def test_llm_with_compiled_drafter_is_lossless(make_llm, tiny_llama_dir, tiny_drafters, kind, folds):
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], [9, 10, 11, 12]]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(tiny_llama_dir).generate(prompts, sp)]
    llm = make_llm(tiny_llama_dir, speculative_config={**dspark_spec(tiny_drafters[kind]), **folds},
                   torch_compile_config={})
    assert llm.capacity_report["layer_regions"] == "inductor"
    assert llm.capacity_report["drafter_regions"] == "inductor"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    engine = llm._executor.engine
    assert engine.spec_step.num_launches > 0             # the draft step ran (inside the one-graph step)
    assert llm.get_stats()["speculative"]["draft_tokens"] > 0


def test_fp8_drafter_keeps_its_modules_but_propose():
    d = _drafter("gqa", CPU, torch.float32, quant_config=QUANT)
    want_rows, _, hidden = _draft_step(d, VanillaAttention())
    d.use_regions(DrafterRegions.inductor())
    assert d.regions.compiled and all(layer.regions is None for layer in d.layers)
    assert d.regions_summary().startswith("inductor (propose only")
    rows, _, got_hidden = _draft_step(d, VanillaAttention())
    assert torch.equal(rows, want_rows) and torch.equal(got_hidden, hidden)


def test_regions_need_fused_projections():
    d = _drafter("gqa", CPU, torch.float32, fused=False)
    with pytest.raises(ValueError, match="layer 0: drafter regions need fused"):
        d.use_regions(DrafterRegions.inductor())
    assert d.regions is None and all(layer.regions is None for layer in d.layers)   # nothing half-applied
    assert d.regions_summary() == "modules"


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_context_write_outside_graphs_can_take_the_eager_regions(kind):
    """compiled=False (the worker's prompt-context write, outside any graph) runs the eager regions
    where compiled ones are set: bitwise the eager drafter's write, and the compiled functions are not
    called (here they raise). Control: compiled=True calls them."""
    def boom(*_a, **_k):
        raise RuntimeError("compiled region called")

    d = _drafter(kind, CPU, torch.float32)
    spec = draft_kv_cache_spec(d, torch.float32)
    hidden = torch.randn(7, d.config.fc_in_features, generator=torch.Generator().manual_seed(4))
    pos, slots = torch.arange(2, 9), torch.tensor([3, 4, 5, 20, 21, 22, 40])

    def write(compiled: bool) -> list[torch.Tensor]:
        caches = [torch.zeros(spec.layer_shape(4, P)) for _ in range(spec.num_layers)]
        with torch.inference_mode():
            feats = d.context_features(hidden, compiled=compiled)
            d.write_context(feats, pos, slots, caches, VanillaAttention(), slots_valid=True, compiled=compiled)
        return caches
    want = write(True)                                  # the eager regions, as loaded
    assert all(bool((c != 0).any()) for c in want)
    d.use_regions(dataclasses.replace(DrafterRegions.eager(), features=boom, gqa_project_kv=boom, mla_latent=boom,
                                      compiled=True))
    assert all(torch.equal(a, b) for a, b in zip(write(False), want))
    with pytest.raises(RuntimeError, match="compiled region called"):
        write(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_inductor_regions_in_the_draft_graph_on_gpu(kind):
    from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
    d = _drafter(kind, torch.device("cuda"), torch.bfloat16, **({"qk_rope_head_dim": 16} if kind == "mla" else {}))
    want_rows, want_pool, hidden = _draft_step(d, TritonAttention())          # eager regions, run directly
    with torch.inference_mode():
        want_ids, logits = d.propose(hidden, want_rows[:, 1].clone(), Q - 1)
    assert torch.equal(want_ids, want_rows[:, 2:])
    d.use_regions(DrafterRegions.inductor())
    rows, pool, _ = _draft_step(d, TritonAttention(), capture=True)         # compiled, in a CUDA graph
    assert torch.equal(rows[:, :2], want_rows[:, :2])                       # committed, anchor
    _diverge_only_at_near_ties(rows[:, 2:].cpu(), want_ids.cpu(), logits.float().cpu(), 0.05)
    assert _norm_rel(pool, want_pool) < 2e-2
    _perturbed(d)                                                           # control
    _, bad_pool, _ = _draft_step(d, TritonAttention(), capture=True)
    assert _norm_rel(bad_pool, want_pool) > 0.08


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_fused_appends_match_the_regions_on_gpu(kind):
    """bf16 on the H200: TRITON's fused norm + RoPE + append (eager regions, run directly) against
    VANILLA through the regions' own norms and RoPE: committed and anchor equal, drafts equal up to
    a near tie, pool writes within 2e-2 (norm-relative); control: a perturbed weight beyond 0.08."""
    from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
    d = _drafter(kind, torch.device("cuda"), torch.bfloat16, **({"qk_rope_head_dim": 16} if kind == "mla" else {}))
    want_rows, want_pool, hidden = _draft_step(d, VanillaAttention())
    with torch.inference_mode():
        want_ids, logits = d.propose(hidden, want_rows[:, 1].clone(), Q - 1)
    calls: list = []
    rows, pool, _ = _draft_step(d, _spied_triton(calls))
    assert len(calls) == len(d.layers)
    assert torch.equal(rows[:, :2], want_rows[:, :2])
    _diverge_only_at_near_ties(rows[:, 2:].cpu(), want_ids.cpu(), logits.float().cpu(), 0.05)
    assert _norm_rel(pool, want_pool) < 2e-2
    _perturbed(d)
    _, bad_pool, _ = _draft_step(d, TritonAttention())
    assert _norm_rel(bad_pool, want_pool) > 0.08
