"""Split target steps: graph group + eager rest, stitched into one ForwardOutput.

CPU: the pure bookkeeping (`graph_candidates`, `stitched_offsets`, `cat_rows`) on fixed and
random layouts against a labelled-row reference (with a negative control: step-order offsets
miss); `CUDAGraphRunner.plan_group` (shape, ownership, bucket cap); and ModelEngine's
stitching on the CPU with a stand-in runner that "replays" the graph group eagerly: every
segment's logits and captured rows equal a plain eager step's.
GPU: a mixed step (a prompt chunk, K+1 verify segments, a shorter verify segment, a decode)
through a FLASHINFER graph engine equals the same step through an eager engine within bf16
tolerance; the runner counts split steps and replays; wrong offsets do not match.
"""
from __future__ import annotations

import random

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import GraphRun
from tensorrt_llm._torch.runtime.step import ForwardSegment
from tensorrt_llm._torch.pyexecutor.step_split import cat_rows, graph_candidates, stitched_offsets

from test_cuda_graph import NEG_MIN, TOL, gpu, rel   # the GPU tolerances and helpers of the graph tests


# ---- pure bookkeeping ----------------------------------------------------------------------
def test_graph_candidates_layouts():
    tc = {1, 4}
    assert graph_candidates([], tc) == (0, [])
    assert graph_candidates([(7, 1), (5, 0)], tc) == (0, [])                     # prefill only
    assert graph_candidates([(4, 4)] * 3, tc) == (4, [0, 1, 2])                  # all verify
    assert graph_candidates([(3, 3), (2, 2)], tc) == (0, [])                     # q not captured
    assert graph_candidates([(4, 1), (4, 4)], tc) == (4, [1])                    # wants 1 logit: eager
    layout = [(9, 1), (4, 4), (1, 1), (4, 4), (3, 3), (1, 1), (4, 4), (6, 0)]
    assert graph_candidates(layout, tc) == (4, [1, 3, 6])                        # most segments wins
    assert graph_candidates([(1, 1), (1, 1), (4, 4)], tc) == (1, [0, 1])
    assert graph_candidates([(1, 1), (4, 4)], tc) == (4, [1])                    # tie: larger q


def whole_step_plan(runner, segments):
    """The runner's StepPlan when every segment of the step can replay, else None."""
    group = runner.plan_group(segments)
    return group[1] if group is not None and len(group[0]) == len(segments) else None


def _reference_offsets(shapes, graph, q):
    """Label every row of the stitched tensors by (segment, index) the slow way; return the
    row holding each segment's first token / first logit."""
    eager = [i for i in range(len(shapes)) if i not in graph]
    tok_rows = [(i, t) for i in eager for t in range(shapes[i][0])] + [(i, t) for i in graph for t in range(q)]
    logit_rows = ([(i, t) for i in eager for t in range(shapes[i][1])]
                  + [(i, t) for i in graph for t in range(q)])
    tok = {lab: r for r, lab in enumerate(tok_rows)}
    lg = {lab: r for r, lab in enumerate(logit_rows)}
    to = [tok[(i, 0)] for i in range(len(shapes))]
    lo = []
    for i, (_, k) in enumerate(shapes):
        # a segment without logits: the offset where its (empty) run would start
        lo.append(lg[(i, 0)] if k else None)
    return lo, to, logit_rows, tok_rows


def _random_layout(rng: random.Random, q: int):
    shapes, graph = [], []
    for i in range(rng.randrange(1, 12)):
        kind = rng.choice(["prefill", "chunk", "verify", "short", "decode"])
        if kind == "verify":
            shapes.append((q, q))
            if rng.random() < 0.8:
                graph.append(i)
        else:
            n = {"prefill": rng.randrange(1, 30), "chunk": rng.randrange(1, 30),
                 "short": rng.randrange(1, q), "decode": 1}[kind] if q > 1 else rng.randrange(2, 30)
            shapes.append((n, {"prefill": 1, "chunk": 0}.get(kind, n)))
    return shapes, graph


def test_stitched_offsets_match_labelled_reference():
    rng = random.Random(0)
    fixed = [([(9, 1), (4, 4), (2, 2), (4, 4), (5, 0)], [1, 3], 4),      # interleaved
             ([(4, 4)] * 3, [0, 1, 2], 4),                              # all graph
             ([(9, 1), (3, 3), (6, 0)], [], 4),                          # all eager
             ([(4, 4), (4, 4), (1, 1), (4, 4)], [0, 1, 3], 4),           # irregular gen segments
             ([(1, 1), (7, 1), (1, 1)], [0, 2], 1)]                      # decode q=1
    layouts = fixed + [(*_random_layout(rng, q), q) for q in rng.choices([1, 2, 4, 9], k=300)]
    differs = 0
    for shapes, graph, q in layouts:
        lo, to = stitched_offsets(shapes, graph, q)
        ref_lo, ref_to, logit_rows, tok_rows = _reference_offsets(shapes, graph, q)
        assert to == ref_to, (shapes, graph)
        assert [x for x, r in zip(lo, ref_lo) if r is not None] == [r for r in ref_lo if r is not None]
        for i, (n, k) in enumerate(shapes):     # every row of a segment is its own, in order
            assert tok_rows[to[i]:to[i] + n] == [(i, t) for t in range(n)]
            assert logit_rows[lo[i]:lo[i] + k] == [(i, t) for t in range(k)]
        assert len(tok_rows) == sum(n for n, _ in shapes) and len(logit_rows) == sum(k for _, k in shapes)
        # negative control: plain step-order packing misses whenever an eager segment with
        # tokens follows a graph segment
        naive, t = [], 0
        for n, _ in shapes:
            naive.append(t)
            t += n
        if any(i < j for i in graph for j in range(len(shapes)) if j not in graph):
            assert naive != to
            differs += 1
    assert differs > 50
    assert stitched_offsets(*fixed[0]) == ([0, 3, 1, 7, 3], [0, 16, 9, 20, 11])


def test_stitched_offsets_rejects_bad_groups():
    with pytest.raises(ValueError, match="not distinct"):
        stitched_offsets([(4, 4), (4, 4)], [0, 0], 4)
    with pytest.raises(ValueError, match="not distinct"):
        stitched_offsets([(4, 4)], [1], 4)
    with pytest.raises(ValueError, match="in a graph of 4 tokens"):
        stitched_offsets([(4, 4), (3, 3)], [0, 1], 4)


def test_cat_rows():
    a, b = torch.randn(3, 5), torch.randn(4, 5)
    assert torch.equal(cat_rows(a, b), torch.cat([a, b]))
    assert cat_rows(None, None) is None and cat_rows(a, None) is None
    assert cat_rows(torch.zeros(0, 1), b) is b          # eager segments wanted no logits


# ---- the runner's group choice (CPU) ---------------------------------------------------------
def _cpu_runner(kv, buckets=None, token_counts=(1, 4)):
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner

    # built for "cuda" (its device check); plan_group only does host work
    runner = CUDAGraphRunner(None, kv, FlashInferAttention(), [], torch.device("cuda"), 8,
                             token_counts=token_counts, buckets=buckets)
    runner.device = torch.device("cpu")
    return runner


def _cpu_kv(num_pages=200):
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    return KVCacheManager([KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)], num_pages, 16, 160,
                          torch.device("cpu"))


def test_plan_group_shape_ownership_and_bucket_cap():
    kv = _cpu_kv()
    for rid in range(8):
        kv.add_sequence(rid, [1], 160)
        kv.ensure_capacity(rid, 32)
    runner = _cpu_runner(kv, buckets=[1, 2, 4])
    segs = [ForwardSegment(0, [1] * 9, 0, 1), ForwardSegment(1, [2] * 4, 20, 4),
            ForwardSegment(2, [3] * 2, 20, 2), ForwardSegment(3, [4] * 4, 29, 4),   # 29..32: beyond
            ForwardSegment(4, [5] * 4, 20, 4), ForwardSegment(5, [6] * 4, 3, 4)]
    idx, plan = runner.plan_group(segs)
    assert idx == [1, 4, 5] and plan.q == 4 and plan.bucket == 4       # request 3 writes past its pages
    assert plan.slots.tolist() == [kv.slots(r, s, 4) for r, s in ((1, 20), (4, 20), (5, 3))]
    assert plan.starts.tolist() == [20, 20, 3]
    assert whole_step_plan(runner, segs) is None                              # not the whole step
    many = [ForwardSegment(r, [7] * 4, 4, 4) for r in range(7)]
    idx, plan = runner.plan_group(many)
    assert idx == [0, 1, 2, 3] and plan.bucket == 4                    # at most the largest bucket
    assert whole_step_plan(runner, many[:4]).bucket == 4
    assert runner.plan_group([ForwardSegment(3, [1] * 4, 29, 4), segs[0]]) is None


# ---- ModelEngine stitching on the CPU --------------------------------------------------------
class _EagerReplay:
    """Stands in for CUDAGraphRunner on the CPU: its `plan_group` choice, "replayed" by an
    eager forward of the group alone (the graph's output layout: q rows per segment)."""

    def __init__(self, planner, engine):
        self.planner, self.engine = planner, engine
        self.num_split_steps = 0

    def run(self, segments):
        group = self.planner.plan_group(segments)
        if group is None:
            return None
        idx, plan = group
        self.num_split_steps += len(idx) < len(segments)
        out = self.engine._eager([segments[i] for i in idx])
        return GraphRun(idx, plan.q, out.logits, out.captured)


def _cpu_engine(model, layers):
    from tensorrt_llm._torch.attention_backend.resolver import create_backend
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager

    dev = torch.device("cpu")
    n_layers, n_kv, head_dim = model.kv_cache_layout()
    kv = KVCacheManager([KVCacheSpec("target", "gqa", n_layers, 2, n_kv, head_dim, torch.float32)],
                        num_pages=96, tokens_per_block=16, max_seq_len=256, device=dev)
    backend, _ = create_backend("VANILLA", dev)
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


def test_engine_stitches_split_step_like_eager_cpu(tiny_llama_dir):
    from tensorrt_llm._torch.models import load_target_model

    model = load_target_model(tiny_llama_dir, torch.float32, torch.device("cpu"), max_positions=512)
    split, ref = _cpu_engine(model, [0, 2]), _cpu_engine(model, [0, 2])
    split.graph_runner = _EagerReplay(_cpu_runner(split.kv), split)
    g, q = torch.Generator().manual_seed(0), 4
    prompts = {rid: torch.randint(3, 500, (int(n),), generator=g).tolist()
               for rid, n in zip([0, 1, 2, 3, 4, 5, 9], torch.randint(5, 30, (7,), generator=g))}
    _setup((split, ref), prompts, q, steps=1)
    pos = {rid: len(pr) for rid, pr in prompts.items()}
    segs = _mixed_step(prompts, pos, g, q, 9)
    out, want = split.forward(segs), ref.forward(segs)
    assert split.graph_runner.num_split_steps == 1
    assert out.logits.shape == want.logits.shape and out.captured.shape == want.captured.shape
    assert out.token_offsets != sorted(out.token_offsets)            # graph rows after eager rows
    _check_segments(out, want, segs, 1e-4)
    # negative control: the eager step's offsets read other segments' rows of the split output
    wrong = [i for i in range(len(segs)) if out.token_offsets[i] != want.token_offsets[i]]
    assert wrong
    for i in wrong:
        a, n = want.token_offsets[i], len(segs[i].token_ids)
        b = out.token_offsets[i]
        assert rel(out.captured[a:a + n], out.captured[b:b + n]) > NEG_MIN


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
    backend, _ = create_backend("FLASHINFER", dev)
    return ModelEngine(model, kv, backend, dev, capture_layer_ids=[0, 1], use_cuda_graph=use_graph,
                       max_batch_size=8, tokens_per_gen=q)


@gpu
def test_mixed_step_graph_split_matches_eager(llama64_dir):
    pytest.importorskip("flashinfer")
    q, steps = 4, 3
    graph, eager = _gpu_engine(llama64_dir, True, q), _gpu_engine(llama64_dir, False, q)
    g = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(3, 500, (int(n),), generator=g).tolist()
               for rid, n in zip([0, 1, 2, 3, 4, 5, 9, 10, 11], torch.randint(5, 40, (9,), generator=g))}
    _setup((graph, eager), prompts, q, steps)
    pos = {rid: len(pr) for rid, pr in prompts.items()}
    for step in range(steps):   # the first split step captures (bucket 4, q 4), later ones replay
        segs = _mixed_step(prompts, pos, g, q, 9 + step)     # a new request arrives every step
        out, ref = graph.forward(segs), eager.forward(segs)
        assert out.logits.shape == ref.logits.shape and out.captured.shape == ref.captured.shape
        _check_segments(out, ref, segs, TOL)
        # negative control: the graph group's rows read with the eager step's (step-order) offsets
        moved = [i for i in range(len(segs)) if out.token_offsets[i] != ref.token_offsets[i]]
        assert moved, step
        rows_a = torch.cat([out.captured[ref.token_offsets[i]:][:len(segs[i].token_ids)] for i in moved])
        rows_b = torch.cat([ref.captured[ref.token_offsets[i]:][:len(segs[i].token_ids)] for i in moved])
        assert rows_a.shape != rows_b.shape or rel(rows_a, rows_b) > NEG_MIN
        for s in segs:
            pos[s.request_id] += len(s.token_ids)
    runner = graph.graph_runner
    assert runner.num_split_steps == steps and runner.graphs.num_replays == steps
    assert runner.graphs.num_captures == 1 and runner.num_eager_fallbacks == 0
