"""Packed-step graphs (TRITON: query offsets and KV lengths read on the device): any step as one
graph per token bucket.

CPU (Triton's interpreter, float32, the graph cache running each step directly: the same staging,
padding tokens and padding requests as a replay): a ragged prefill, a mixed step (a new prompt
between verify segments, a shorter verify, a decode, with drafts and a decode token still on the
device) and a prompt chunk equal the VANILLA eager engine's logits and captured rows within 1e-4;
negative control: a neighbour's rows are far off. Padding tokens write only the scratch page. A
step with a slot beyond its pages, or more tokens than the largest bucket, is declined. The
engine takes the runner for a `ragged_graphs` backend (no piecewise runner then).
GPU: the same steps replayed from captured graphs (TRITON, bf16) against the eager TRITON engine.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention  # noqa: E402
from tensorrt_llm._torch.pyexecutor.packed_graph_runner import PackedGraphRunner  # noqa: E402
from tensorrt_llm._torch.runtime.step import ForwardSegment  # noqa: E402
from tensorrt_llm._torch.runtime.token_rows import PendingTokens, VerifyTokens  # noqa: E402

LAYERS = [2, 0]          # captured in this order


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _engine(model, backend, device, dtype=torch.float32):
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    layers, kv_heads, head_dim = model.kv_cache_layout()
    kv = KVCacheManager([KVCacheSpec("target", "gqa", layers, 2, kv_heads, head_dim, dtype)],
                        num_pages=48, tokens_per_block=16, max_seq_len=192, device=device)
    return ModelEngine(model, kv, backend, device, capture_layer_ids=LAYERS, tokens_per_gen=4)


def _runner(engine, capture: bool, max_tokens=64, max_requests=8):
    from tensorrt_llm._torch.pyexecutor.packed_graph_runner import PackedGraphRunner
    return PackedGraphRunner(engine.model, engine.kv, engine.backend, engine.kv_caches, engine.device, max_tokens,
                             max_requests, LAYERS, capture=capture, max_shift=4)


def _steps(g, prompts, pos):
    """A mixed step (a new prompt between verify segments, a shorter verify, a decode), then a chunk."""
    t = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()   # noqa: E731
    mixed = [ForwardSegment(0, t(4), pos[0], 4), ForwardSegment(7, prompts[7], 0, 1),
             ForwardSegment(1, t(2), pos[1], 2), ForwardSegment(2, t(1), pos[2], 1), ForwardSegment(3, t(4), pos[3], 4)]
    return mixed, [ForwardSegment(8, prompts[8][:9], 0, 0)]


def _on_device(segs, device):
    """The same step with the 4-token verify segments' drafts and the decode token held on the device."""
    drafts = PendingTokens(torch.tensor([s.token_ids[1:] for s in segs if len(s.token_ids) == 4], device=device))
    last = PendingTokens(torch.tensor([[s.token_ids[0]] for s in segs if len(s.token_ids) == 1 and s.num_logits],
                                      device=device))
    out, j = [], 0
    for s in segs:
        t = s.token_ids
        if len(t) == 4:
            t, j = VerifyTokens(t[0], drafts.row(j)), j + 1
        elif len(t) == 1:
            t = last.row(0, 1)
        out.append(ForwardSegment(s.request_id, t, s.start, s.num_logits))
    return out


def _check(out, want, segs, tol):
    assert out.token_offsets == want.token_offsets and out.logits_offsets == want.logits_offsets
    assert out.logits.shape == want.logits.shape and out.captured.shape == want.captured.shape
    assert rel(out.logits.float(), want.logits.float()) < tol
    assert rel(out.captured.float(), want.captured.float()) < tol
    n = min(len(segs[0].token_ids), len(segs[1].token_ids))       # negative control: a neighbour's rows
    a, b = out.token_offsets[0], want.token_offsets[1]
    assert rel(out.captured[a:a + n].float(), want.captured[b:b + n].float()) > 0.1


def _run_steps(engine, ref, runner, device, tol):
    g = torch.Generator().manual_seed(0)
    lens = {0: 5, 1: 23, 2: 1, 3: 17, 7: 11, 8: 20}
    prompts = {r: torch.randint(3, 400, (n,), generator=g).tolist() for r, n in lens.items()}
    for e in (engine, ref):
        for r, pr in prompts.items():
            e.kv.add_sequence(r, pr, len(pr) + 24)
            e.kv.ensure_capacity(r, len(pr) + 24)
    first = [ForwardSegment(r, prompts[r], 0, 1) for r in (0, 1, 2, 3)]              # ragged prefill
    with torch.inference_mode():
        _check(runner.run(first), ref.forward(first), first, tol)
        pos = {r: lens[r] for r in (0, 1, 2, 3)}
        mixed, chunk = _steps(g, prompts, pos)
        _check(runner.run(_on_device(mixed, device)), ref.forward(mixed), mixed, tol)
        out, want = runner.run(chunk), ref.forward(chunk)                              # a chunk: no logits
        assert out.logits.shape[0] == want.logits.shape[0] == 0
        assert rel(out.captured.float(), want.captured.float()) < tol
        # a prompt chunk leading continued verify segments (their starts shifted on the device by 2 and 3)
        t4 = [torch.randint(3, 400, (4,), generator=g).tolist() for _ in range(2)]
        host = [ForwardSegment(8, prompts[8][9:], 9, 1), ForwardSegment(0, t4[0], 8, 4),
                ForwardSegment(3, t4[1], 21, 4)]
        want = ref.forward(host)
        cont = _continued(host, device, [2, 3])
        _check(runner.run(cont), want, host, tol)
        _check(ref.forward(_continued(host, device, [2, 3])), want, host, tol)    # the eager continued step
        _check(engine.forward(_continued(host, device, [2, 3])), want, host, tol)  # ... on the runner's backend
        saved = [c.clone() for c in ref.kv_caches]
        wrong = ref.forward(_continued(host, device, [2, 3], late=1))              # control: one position late
        for c, c0 in zip(ref.kv_caches, saved):                                    # (its KV writes undone)
            c.copy_(c0)
        assert rel(wrong.logits[1:].float(), want.logits[1:].float()) > 0.1
        # declined: a slot beyond the request's pages; more tokens than the largest bucket; a continued
        # segment whose furthest shift reaches past its pages
        beyond = [ForwardSegment(2, [5] * 4, engine.kv.owned_tokens(2) - 2, 4)]
        assert runner.run(beyond) is None
        assert runner.run([ForwardSegment(8, [5] * 65, 9, 1)]) is None
        late = _continued([ForwardSegment(2, [5] * 4, engine.kv.owned_tokens(2) - 6, 4)], device, [1])
        assert runner.run(late) is None
    assert runner.num_steps == 4 and runner.num_declined == 3


def _continued(segs, device, shifts, late=0):
    """The step with its last len(shifts) segments continued: each starts shifts[i] positions before
    its host start, that shift (+ late) on the device."""
    rows = PendingTokens(torch.tensor([[x + late] for x in shifts], device=device))
    k = len(segs) - len(shifts)
    return segs[:k] + [ForwardSegment(s.request_id, s.token_ids, s.start - x, s.num_logits, rows.row(j, 1))
                       for j, (s, x) in enumerate(zip(segs[k:], shifts))]


def test_packed_steps_equal_eager_cpu(tiny_llama_dir):
    from tensorrt_llm._torch.models import load_target_model
    dev = torch.device("cpu")
    model = load_target_model(tiny_llama_dir, torch.float32, dev, max_positions=256)
    engine, ref = _engine(model, TritonAttention(), dev), _engine(model, VanillaAttention(), dev)
    runner = _runner(engine, capture=False)
    scratch = runner.scratch_page
    assert ref.kv.scratch_page() == scratch                      # the same page ids in both pools
    before = [c[:, :, :, :].clone() for c in engine.kv_caches]
    _run_steps(engine, ref, runner, dev, 1e-4)
    # padding tokens wrote into the scratch page only: every other page matches the eager engine's
    for c, c_ref, c0 in zip(engine.kv_caches, ref.kv_caches, before):
        keep = torch.ones(c.shape[0], dtype=torch.bool)
        keep[scratch] = False
        assert torch.allclose(c[keep], c_ref[keep], atol=1e-5)
        assert not torch.equal(c[scratch], c0[scratch])          # the padding rows landed there
    # a runner without a drafter (max_shift 0) has no shift in its graphs: it declines a continued step
    plain = PackedGraphRunner(engine.model, engine.kv, engine.backend, engine.kv_caches, dev, 64, 8, LAYERS,
                              capture=False)
    with torch.inference_mode():
        assert plain.run(_continued([ForwardSegment(0, [5] * 4, 9, 4)], dev, [1])) is None
        assert plain.run([ForwardSegment(0, [5] * 4, 9, 4)]) is not None       # control: the same step read


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_prompt_draft_context_is_written_inside_the_step(make_llm, tiny_llama_dir, tiny_drafters, kind):
    """With the drafter's writer attached, a packed step writes the draft context of its leading
    prompt chunks from their captured rows: equal to the drafter's eager write of the same commits
    (the CPU runs every region eagerly), on every page but the scratch page, where every other row
    lands. The step's generation segment (not a prompt) leaves its draft slots alone; negative
    control: counted as a prompt, it writes them. ForwardOutput says which segments were written."""
    from types import SimpleNamespace

    from tensorrt_llm._torch.attention_backend.interface import stacked_layers
    from tensorrt_llm._torch.runtime.step import StepCommit
    from tests.unittest._torch.pyexecutor.spec_runs import dspark_spec
    llm = make_llm(tiny_llama_dir, speculative_config=dspark_spec(tiny_drafters[kind]))
    ex = llm._executor
    engine, kv, drafter = ex.engine, ex.kv, ex.drafter
    assert drafter.writes_forward_context
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(3, 400, (13,), generator=g).tolist(), 1: torch.randint(3, 400, (21,), generator=g).tolist(),
               2: torch.randint(3, 400, (9,), generator=g).tolist()}
    for r, pr in prompts.items():
        kv.add_sequence(r, pr, len(pr) + 24)
        kv.ensure_capacity(r, len(pr) + 8)
    runner = PackedGraphRunner(engine.model, kv, TritonAttention(), engine.kv_caches, engine.device, 64, 8,
                               drafter.capture_layer_ids, capture=False)
    runner.context = drafter
    pool = stacked_layers(drafter.kv_caches)
    scratch = runner.scratch_page
    # two prompt chunks, then request 2 as if generating (4 tokens past its prompt)
    segs = [ForwardSegment(0, prompts[0], 0, 1), ForwardSegment(1, prompts[1][:16], 0, 0),
            ForwardSegment(2, prompts[2][:4], 9, 4)]
    # a sentinel in the scratch page: the padding rows' writes there are garbage (zeros at times, as
    # the pool starts), so only a value no write reproduces shows that they landed
    pool[:, scratch] = 7.0
    start = pool.clone()
    with torch.inference_mode():
        out = runner.run(segs, prompt_segments=2)
        assert out.context_segments == 2
        inside = pool.clone()
        pool.copy_(start)
        commits = [StepCommit(SimpleNamespace(request_id=s.request_id), out.token_offsets[i], s.start,
                              len(s.token_ids)) for i, s in enumerate(segs[:2])]
        drafter._write_context(commits, out.captured)
        eager = pool.clone()
    keep = torch.ones(pool.shape[1], dtype=torch.bool)
    keep[scratch] = False
    assert torch.allclose(inside[:, keep], eager[:, keep], atol=1e-6)
    assert not torch.equal(eager[:, keep], start[:, keep])          # the prompts' context was written
    assert not torch.equal(inside[:, scratch], start[:, scratch])   # the other rows landed in scratch
    gen_slots = kv.slots(2, 9, 4)
    pages, offs = [s // kv.tokens_per_block for s in gen_slots], [s % kv.tokens_per_block for s in gen_slots]
    for pg, off in zip(pages, offs):                                 # the generation rows' slots: untouched
        assert torch.equal(inside[:, pg, ..., off, :], start[:, pg, ..., off, :])
    with torch.inference_mode():
        pool.copy_(start)
        runner.run(segs, prompt_segments=3)                          # control: request 2 as a prompt too
    assert any(not torch.equal(pool[:, pg, ..., off, :], start[:, pg, ..., off, :]) for pg, off in zip(pages, offs))
    runner.context = None                                            # without the writer: nothing written
    with torch.inference_mode():
        pool.copy_(start)
        assert runner.run(segs, prompt_segments=2).context_segments == 0
    assert torch.equal(pool, start)


def test_engine_takes_packed_graphs_for_ragged_backends(tiny_llama_dir):
    from tensorrt_llm._torch.models import load_target_model
    from tensorrt_llm._torch.pyexecutor.packed_graph_runner import PackedGraphRunner
    dev = torch.device("cpu")
    model = load_target_model(tiny_llama_dir, torch.float32, dev, max_positions=256)
    engine = _engine(model, VanillaAttention(), dev)
    with pytest.raises(ValueError, match="ragged_graphs"):
        PackedGraphRunner(model, engine.kv, engine.backend, engine.kv_caches, dev, 64, 8)
    assert TritonAttention.capabilities.ragged_graphs and not VanillaAttention.capabilities.ragged_graphs


@pytest.mark.gpu
def test_packed_graphs_equal_eager_gpu(tiny_llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tensorrt_llm._torch.models import load_target_model
    dev = torch.device("cuda")
    model = load_target_model(tiny_llama_dir, torch.bfloat16, dev, max_positions=256)
    engine, ref = _engine(model, TritonAttention(), dev, torch.bfloat16), _engine(model, TritonAttention(), dev,
                                                                                    torch.bfloat16)
    runner = _runner(engine, capture=True)
    assert runner.capture_all() == len(runner.buckets)
    _run_steps(engine, ref, runner, dev, 2e-2)
    assert runner.graphs.num_captures == len(runner.buckets) and runner.graphs.num_replays >= 3
