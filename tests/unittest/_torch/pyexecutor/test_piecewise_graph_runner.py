"""Piecewise CUDA graphs: any step (prompt chunks mixed with decode / verify segments) as L + 1
graph pieces around eager attention; and the whole-step graph runner's refusal of such steps.

CPU: `token_buckets`; `CUDAGraphRunner.plan` takes only whole uniform, owned, bucket-sized
steps; the piecewise runner on the CPU with a stand-in graph cache that runs each piece
directly (the same pieces, buffers, padding and packing; no capture) equals a plain eager step
for every segment's logits and captured rows, including tokens still on the device (a verify
segment's drafts, an overlapped decode token); negative control: rows read at a neighbour's
offsets are far off.
GPU: mixed steps (a prompt chunk of a newly arrived request every step, K+1 verify segments, a
shorter verify segment, a decode) through a FLASHINFER graph engine equal the same steps
through an eager engine within bf16 tolerance; the pieces are captured once per token bucket
and replayed; no step runs eagerly.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.piecewise_graph_runner import token_buckets
from tensorrt_llm._torch.runtime.step import ForwardSegment
from tensorrt_llm._torch.runtime.token_rows import PendingTokens, VerifyTokens

from test_cuda_graph import NEG_MIN, TOL, gpu, rel   # the GPU tolerances and helpers of the graph tests


def test_token_buckets():
    assert token_buckets(1) == [16]
    assert token_buckets(17) == [16, 32]
    assert token_buckets(256) == [16, 32, 64, 128, 256]
    assert token_buckets(700) == [16, 32, 64, 128, 256, 512, 768]
    assert token_buckets(2048)[-3:] == [1536, 1792, 2048]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


# ---- the whole-step runner declines mixed steps (CPU) ------------------------------------------
def _cpu_runner(kv, buckets=None, token_counts=(1, 4)):
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner

    # built for "cuda" (its device check); plan only does host work
    runner = CUDAGraphRunner(None, kv, FlashInferAttention(), [], torch.device("cuda"), 8,
                             token_counts=token_counts, buckets=buckets)
    runner.device = torch.device("cpu")
    return runner


def _cpu_kv(num_pages=200):
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    return KVCacheManager([KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)], num_pages, 16, 160,
                          torch.device("cpu"))


def test_whole_step_plan_shape_ownership_and_bucket_cap():
    kv = _cpu_kv()
    for rid in range(8):
        kv.add_sequence(rid, [1], 160)
        kv.ensure_capacity(rid, 32)
    runner = _cpu_runner(kv, buckets=[1, 2, 4])
    uniform = [ForwardSegment(r, [r + 1] * 4, 20 - r, 4) for r in (1, 4, 5)]
    plan = runner.plan(uniform)
    assert plan.q == 4 and plan.bucket == 4
    assert plan.slots.tolist() == [kv.slots(r, 20 - r, 4) for r in (1, 4, 5)]
    assert plan.starts.tolist() == [19, 16, 15]
    assert runner.plan(uniform + [ForwardSegment(0, [1] * 9, 0, 1)]) is None          # a prompt chunk
    assert runner.plan(uniform + [ForwardSegment(2, [3] * 2, 20, 2)]) is None         # a shorter segment
    assert runner.plan(uniform + [ForwardSegment(3, [4] * 4, 29, 4)]) is None         # 29..32: beyond its pages
    assert runner.plan([ForwardSegment(3, [4] * 4, 28, 4)]) is not None
    assert runner.plan([ForwardSegment(2, [3] * 3, 20, 3)]) is None                   # q 3 not captured
    assert runner.plan([ForwardSegment(2, [3] * 4, 20, 1)]) is None                   # wants 1 logit of 4
    many = [ForwardSegment(r, [7] * 4, 4, 4) for r in range(5)]
    assert runner.plan(many) is None and runner.plan(many[:4]).bucket == 4           # largest bucket: 4


# ---- the piecewise runner on the CPU ----------------------------------------------------------
class _DirectGraphs:
    """Stands in for GraphCache on the CPU: each replay runs the piece and keeps its outputs (as a
    replay refills the captured outputs)."""

    def __init__(self):
        self.num_replays = 0

    def replay(self, entry, forward):
        entry.outputs = forward(entry)
        self.num_replays += 1
        return entry.outputs


def _cpu_engine(model, layers):
    from tensorrt_llm._torch.attention_backend.resolver import create_backend
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager

    dev = torch.device("cpu")
    n_layers, n_kv, head_dim = model.kv_cache_layout()
    kv = KVCacheManager([KVCacheSpec("target", "gqa", n_layers, 2, n_kv, head_dim, torch.float32)],
                        num_pages=96, tokens_per_block=16, max_seq_len=256, device=dev)
    backend, _ = create_backend("VANILLA", dev, torch.bfloat16)
    return ModelEngine(model, kv, backend, dev, capture_layer_ids=layers)


def _mixed_step(prompts, pos, g, q, new_rid):
    """A prompt of a newly arrived request between verify segments, a shorter verify and a decode."""
    t = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()   # noqa: E731
    return [ForwardSegment(0, t(q), pos[0], q), ForwardSegment(1, t(q), pos[1], q),
            ForwardSegment(new_rid, prompts[new_rid], 0, 1),
            ForwardSegment(2, t(q - 2), pos[2], q - 2),                   # drafts cut by the page bound
            ForwardSegment(3, t(q), pos[3], q), ForwardSegment(4, t(1), pos[4], 1),
            ForwardSegment(5, t(q), pos[5], q)]


def _setup(engines, prompts, q, steps):
    for e in engines:
        for rid, pr in prompts.items():
            e.kv.add_sequence(rid, pr, len(pr) + steps * q + 8)
            e.kv.ensure_capacity(rid, len(pr) + steps * q + 8)
        with torch.inference_mode():
            e._eager([ForwardSegment(rid, pr, 0, 1) for rid, pr in prompts.items() if rid < 9])


def _check_segments(out, ref, segs, tol):
    for i, s in enumerate(segs):
        a, b = out.logits_offsets[i], ref.logits_offsets[i]
        assert rel(out.logits[a:a + s.num_logits], ref.logits[b:b + s.num_logits]) < tol, i
        a, b, n = out.token_offsets[i], ref.token_offsets[i], len(s.token_ids)
        assert rel(out.captured[a:a + n], ref.captured[b:b + n]) < tol, i


def _neighbour_rows_differ(out, segs):
    """Negative control: segment i's captured rows read at segment i+1's offset are far off."""
    for i in range(len(segs) - 1):
        n = min(len(segs[i].token_ids), len(segs[i + 1].token_ids))
        a, b = out.token_offsets[i], out.token_offsets[i + 1]
        assert rel(out.captured[a:a + n], out.captured[b:b + n]) > NEG_MIN, i


def _device_tokens(segs, q, device):
    """The same step with the verify segments' drafts and the decode token held as device rows."""
    drafts = PendingTokens(torch.tensor([s.token_ids[1:] for s in segs if len(s.token_ids) == q], device=device))
    last = PendingTokens(torch.tensor([[s.token_ids[0]] for s in segs if len(s.token_ids) == 1], device=device))
    out, j = [], 0
    for s in segs:
        t = s.token_ids
        if len(t) == q:
            t = VerifyTokens(t[0], drafts.row(j))
            j += 1
        elif len(t) == 1:
            t = last.row(0, 1)
        out.append(ForwardSegment(s.request_id, t, s.start, s.num_logits))
    return out


def test_piecewise_step_equals_eager_cpu(tiny_llama_dir):
    from tensorrt_llm._torch.models import load_target_model
    from tensorrt_llm._torch.pyexecutor.piecewise_graph_runner import PiecewiseGraphRunner

    model = load_target_model(tiny_llama_dir, torch.float32, torch.device("cpu"), max_positions=512)
    layers = [2, 0]                          # captured in this order, not layer order
    pw, ref = _cpu_engine(model, layers), _cpu_engine(model, layers)
    runner = PiecewiseGraphRunner(model, pw.kv, pw.backend, pw.kv_caches, torch.device("cpu"), 64, layers)
    runner.graphs = _DirectGraphs()
    g, q = torch.Generator().manual_seed(0), 4
    prompts = {rid: torch.randint(3, 500, (int(n),), generator=g).tolist()
               for rid, n in zip([0, 1, 2, 3, 4, 5, 9, 10], torch.randint(5, 30, (8,), generator=g))}
    _setup((pw, ref), prompts, q, steps=2)
    pos = {rid: len(pr) for rid, pr in prompts.items()}
    for step, rid in enumerate((9, 10)):
        segs = _mixed_step(prompts, pos, g, q, rid)
        n = sum(len(s.token_ids) for s in segs)
        run_segs = _device_tokens(segs, q, torch.device("cpu")) if step else segs
        with torch.inference_mode():
            out = runner.run(run_segs)
        want = ref.forward(segs)
        assert runner.bucket_for(n) > n                              # padding rows ran too
        assert out.logits.shape == want.logits.shape and out.captured.shape == want.captured.shape
        assert out.token_offsets == want.token_offsets and out.logits_offsets == want.logits_offsets
        _check_segments(out, want, segs, 1e-4)
        _neighbour_rows_differ(out, segs)
        for s in segs:
            pos[s.request_id] += len(s.token_ids)
    assert runner.num_steps == 2 and runner.graphs.num_replays == 2 * (model.config.num_hidden_layers + 1)
    # a step beyond the largest bucket is declined (the engine runs it eagerly)
    assert runner.run([ForwardSegment(0, [5] * 65, pos[0], 1)]) is None


# ---- GPU -------------------------------------------------------------------------------------
def _gpu_engine(path, use_graph: bool, q: int):
    from tensorrt_llm._torch.attention_backend.resolver import create_backend
    from tensorrt_llm._torch.models import load_target_model
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager

    dev = torch.device("cuda")
    model = load_target_model(path, torch.bfloat16, dev, max_positions=512)
    layers, kv_heads, head_dim = model.kv_cache_layout()
    kv = KVCacheManager([KVCacheSpec("target", "gqa", layers, 2, kv_heads, head_dim, torch.bfloat16)],
                        num_pages=96, tokens_per_block=16, max_seq_len=256, device=dev)
    backend, _ = create_backend("FLASHINFER", dev, torch.bfloat16)
    return ModelEngine(model, kv, backend, dev, capture_layer_ids=[1, 0], use_cuda_graph=use_graph,
                       max_batch_size=8, tokens_per_gen=q, max_num_tokens=256)


@gpu
def test_mixed_step_piecewise_graphs_match_eager(llama64_dir):
    pytest.importorskip("flashinfer")
    q, steps = 4, 3
    graph, eager = _gpu_engine(llama64_dir, True, q), _gpu_engine(llama64_dir, False, q)
    g = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(3, 500, (int(n),), generator=g).tolist()
               for rid, n in zip([0, 1, 2, 3, 4, 5, 9, 10, 11], torch.randint(5, 40, (9,), generator=g))}
    _setup((graph, eager), prompts, q, steps)
    pos = {rid: len(pr) for rid, pr in prompts.items()}
    for step in range(steps):   # the first step captures its bucket's pieces, later ones replay
        segs = _mixed_step(prompts, pos, g, q, 9 + step)     # a new request arrives every step
        run_segs = _device_tokens(segs, q, torch.device("cuda")) if step == steps - 1 else segs
        out, ref = graph.forward(run_segs), eager.forward(segs)
        assert out.logits.shape == ref.logits.shape and out.captured.shape == ref.captured.shape
        _check_segments(out, ref, segs, TOL)
        _neighbour_rows_differ(out, segs)
        for s in segs:
            pos[s.request_id] += len(s.token_ids)
    pw = graph.piecewise
    pieces = graph.model.config.num_hidden_layers + 1
    assert pw.num_steps == steps and graph.paths.eager == 0
    assert pw.graphs.num_replays == steps * pieces and pw.graphs.num_captures == pieces * len(pw._buckets)
    assert graph.graph_runner.num_declined == steps
