"""The draft step launched from the device-side verify output (`DraftGraphRunner`, `draft_ahead`).

CPU (no triton needed): `plan` picks greedy GENERATION requests with a full verify segment and
every slot up to start+q+S-1 owned (start+2q+S-1 for a continued segment), capped at the largest
bucket; the launch's staged inputs (one padded host buffer, device-gathered shifts) lay out as
the graph reads them.
CPU (Triton's interpreter): a whole launch without capture (the step run directly), then `draft` after the host update, equals the eager draft step after the update:
the same drafts and the same draft KV at every committed position, GQA and MLA, with
acceptance lengths from 1 to q; negative controls: verify rows claiming one more accepted
token give other drafts; captured rows of the wrong request give other draft KV.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm import DSparkDecodingConfig, SamplingParams
from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX
from tensorrt_llm._torch.attention_backend.resolver import Resolution
from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.spec_step_graph import SpecStepGraph
from tensorrt_llm._torch.runtime.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.runtime.sampler import Sampler
from tensorrt_llm._torch.runtime.step import StepCommit, VerifiedSegment
from tensorrt_llm._torch.runtime.token_rows import TokenRow
from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker

P, Q, S = 16, 5, 4          # page, verify rows (K+1; K = 4 drafts with shift_label), block


def _runner(kv, drafter=None, kv_caches=(), buckets=None):
    drafter = drafter or SimpleNamespace(config=SimpleNamespace(block_size=S, mask_token_id=511))
    return DraftGraphRunner(drafter, kv, TritonAttention(), list(kv_caches), torch.device("cpu"), 8,
                            verify_widths=[Q], num_drafts=Q - 1, buckets=buckets, capture=False)


def _padded_runner(kv, buckets=None):
    """A runner laid out as a captured one (batch buckets, padding rows in the scratch page); its
    plan and staging run on the CPU, nothing is captured."""
    runner = _runner(kv, buckets=buckets)
    runner.graphs.capture = True
    runner.scratch_page = kv.scratch_page()
    return runner


def _req(rid, start, n, state=RequestState.GENERATION, greedy=True, prompt=6):
    """A request after its update: start + n committed tokens, the last verified one pending."""
    total = start + n + (state != RequestState.CONTEXT)
    sp = (SamplingParams(max_tokens=64, ignore_eos=True) if greedy else
          SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True))
    toks = [3 + (7 * rid + i) % 400 for i in range(max(total, prompt))]
    req = LlmRequest(rid, toks[:min(prompt, total)], sp)
    req.output_token_ids = toks[min(prompt, total):total]
    req.num_computed = start + n
    req.state = state
    return req


def _kv(num_pages=64, draft_spec=None):
    specs = [KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)]
    if draft_spec is not None:
        specs.append(draft_spec)
    return KVCacheManager(specs, num_pages, P, 128, torch.device("cpu"))


def _verify_row(req, start, n):
    """The verify output row of a request that committed n tokens from `start`: the accepted
    drafts and the target's token (positions start+1..start+n), -1 padded to q."""
    return [req.token_at(start + 1 + i) for i in range(n)] + [-1] * (Q - n)


def test_plan_picks_launchable_requests():
    kv = _kv()
    for rid in range(9):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    fin = _req(6, 20, 2)
    fin.finish("length")
    items = [VerifiedSegment(_req(0, 20, 2), 0, 20, Q, 0),                        # yes
             VerifiedSegment(_req(1, 20, 2, greedy=False), 5, 20, Q, 1),          # sampled
             VerifiedSegment(_req(2, 20, 4), 10, 20, Q, 2),                       # yes
             VerifiedSegment(_req(3, 20, 1), 15, 20, 2, 3),                       # a shorter segment
             VerifiedSegment(_req(4, 40, 1), 17, 40, Q, 4),                       # 40..48: block beyond its pages
             VerifiedSegment(_req(5, 39, 1), 22, 39, Q, 5),                       # 39..47: owned
             VerifiedSegment(fin, 27, 20, Q, 6),                                  # failed in its verify
             VerifiedSegment(_req(7, 10, 4), 32, 10, Q, 7)]                       # yes
    runner = _padded_runner(kv)
    idx, plan = runner.plan(items, [it.num_tokens for it in items])
    assert idx == [0, 2, 5, 7] and plan.bucket == 4
    assert plan.starts.tolist() == [20, 20, 39, 10]
    assert plan.rows.tolist() == kv.rows([0, 2, 5, 7]).tolist()
    idx, _ = _padded_runner(kv, buckets=[1, 2]).plan(items, [it.num_tokens for it in items])
    assert idx == [0, 2]                                                     # the largest bucket
    assert runner.plan(items[1:2], [Q]) == ([], None)


def test_plan_of_continued_segments_owns_the_furthest_shift():
    """A continued segment (start shift on the device, up to q) launches only when every slot up to
    start + 2q + S - 1 is owned; an unshifted one at the same start needs start + q + S - 1."""
    from tensorrt_llm._torch.runtime.token_rows import PendingTokens
    kv = _kv()
    for rid in range(2):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    shift = PendingTokens(torch.tensor([[2], [2]]))
    runner = _runner(kv)
    at_edge = 48 - Q - S          # 39: an unshifted block ends on the last owned slot
    plain = VerifiedSegment(_req(0, at_edge, 1), 0, at_edge, Q, 0)
    cont = VerifiedSegment(_req(1, at_edge, 1), Q, at_edge, Q, 1, shift.row(1))
    assert runner.plan([plain, cont], [Q, Q])[0] == [0]
    cont_ok = VerifiedSegment(_req(1, at_edge - Q, 1), Q, at_edge - Q, Q, 1, shift.row(1))
    assert runner.plan([plain, cont_ok], [Q, Q])[0] == [0, 1]


def test_load_inputs_stages_one_padded_buffer():
    kv = _kv()
    for rid in range(3):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    reqs = [_req(0, 20, 2), _req(1, 8, 5), _req(2, 30, 1)]
    items = [VerifiedSegment(r, j * Q, s, Q, j) for j, (r, s) in enumerate(zip(reqs, (20, 8, 30)))]
    runner = _padded_runner(kv, buckets=[4])
    idx, plan = runner.plan(items, [Q] * 3)
    assert idx == [0, 1, 2] and plan.bucket == 4
    entry = runner._new_entry(4, Q, 6, torch.float32)
    captured = torch.randn(3 * Q, 6)
    verified = torch.tensor([_verify_row(r, s, n) for r, s, n in zip(reqs, (20, 8, 30), (2, 5, 1))])
    from tensorrt_llm._torch.runtime.token_rows import PendingTokens
    shifts = PendingTokens(torch.tensor([[0, 9], [0, 3]]))
    runner._load_inputs(entry, 3, captured, verified, plan, [None, shifts.row(1, 1, offset=1), None])
    scratch = runner.scratch_page
    assert entry.starts.tolist() == [20, 8, 30, 0]
    assert entry.shift.tolist() == [0, 3, 0, 0]          # gathered from the device row's column 1
    assert torch.equal(entry.verified[:3], verified) and entry.verified[3].tolist() == [0] + [-1] * (Q - 1)
    tables = kv.block_tables([0, 1, 2], torch.device("cpu"))
    bt, w = entry.md.block_tables, tables.shape[1]
    assert torch.equal(bt[:3, :w], tables) and (bt[:3, w:] == BAD_PAGE_INDEX).all()
    assert bt[3, 0] == scratch and (bt[3, 1:] == BAD_PAGE_INDEX).all()
    assert torch.equal(entry.captured[:3 * Q], captured)


# ---- a whole launch on the CPU (Triton's interpreter) -------------------------------------------
def _worker(tiny_llama_dir, kind):
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "t")
    extra = {"qk_rope_head_dim": 16} if kind == "mla" else {}      # the kernel's dot widths: >= 16
    drafter = DSparkForCausalLMBase.random_init(kind, tc, seed=2, block_size=S, **extra)
    torch.manual_seed(0)     # the bound embedding / head: the same in every twin
    drafter.bind_target(torch.nn.Embedding(tc.vocab_size, tc.hidden_size),
                        torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False))
    worker = DSparkWorker(DSparkDecodingConfig(speculative_model="unused"), drafter, VanillaAttention(),
                          Resolution("VANILLA", "test"), torch.device("cpu"), torch.float32, "test")
    kv = _kv(draft_spec=worker.kv_cache_spec)
    worker.bind(kv, Sampler(0, torch.device("cpu")))
    g = torch.Generator().manual_seed(1)
    for cache in worker.kv_caches:          # earlier context: the same random pages in every twin
        cache.copy_(torch.randn(cache.shape, generator=g))
    return worker, kv, len(drafter.config.target_layer_ids) * tc.hidden_size


CASES = [(0, 20, 2), (1, 8, 5), (2, 30, 1), (3, 12, 3)]      # (request, start, committed tokens)


def _launch(tiny_llama_dir, kind, ahead: bool, shift: bool = False, swap_rows: bool = False):
    worker, kv, width = _worker(tiny_llama_dir, kind)
    for rid, _, _ in CASES:
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    reqs = [_req(rid, start, n) for rid, start, n in CASES]
    commits = [StepCommit(r, j * Q, start, n) for j, (r, (_, start, n)) in enumerate(zip(reqs, CASES))]
    captured = torch.randn(len(CASES) * Q, width, generator=torch.Generator().manual_seed(0))
    if not ahead:
        worker.draft(commits, captured)      # no graph runner: the eager draft step
        return worker, kv, commits
    runner = _runner(kv, worker.drafter, worker.kv_caches)
    worker.graph_runner = runner
    rows = [_verify_row(r, start, n) for r, (_, start, n) in zip(reqs, CASES)]
    if shift:    # negative control: one more token accepted than committed (a token 7 after them)
        rows = [(row[:n] + [7] + [-1] * Q)[:Q] for row, (_, _, n) in zip(rows, CASES)]
    row0 = [j * Q for j in range(len(CASES))]
    if swap_rows:   # negative control: two requests read each other's captured rows
        row0[0], row0[1] = row0[1], row0[0]
    items = [VerifiedSegment(r, row0[j], start, Q, j) for j, (r, (_, start, _)) in enumerate(zip(reqs, CASES))]
    got = worker.draft_ahead(items, torch.tensor(rows), captured)
    assert got is not None and sorted(got.rows) == [0, 1, 2, 3] and runner.graphs.num_replays == 1
    worker.draft(commits, captured, got)
    return worker, kv, commits


def _committed_kv(kv, commits) -> torch.Tensor:
    pool, rows = kv.pools["draft"], []
    for c in commits:
        for s in kv.slots(c.req.request_id, 0, c.start + c.count):
            rows.append(pool[:, s // P, :, :, s % P])
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_launched_draft_step_equals_eager(tiny_llama_dir, kind):
    pytest.importorskip("triton")
    _, kv_e, ref = _launch(tiny_llama_dir, kind, ahead=False)
    _, kv_a, got = _launch(tiny_llama_dir, kind, ahead=True)
    for a, b in ((x.req, y.req) for x, y in zip(ref, got)):
        assert isinstance(b.draft_tokens, TokenRow) and len(b.draft_tokens) == Q - 1
        assert list(a.draft_tokens) == list(b.draft_tokens), a.request_id
        assert kv_e.seqs[a.request_id].num_draft_valid_tokens == kv_a.seqs[b.request_id].num_draft_valid_tokens
    assert torch.allclose(_committed_kv(kv_a, got), _committed_kv(kv_e, ref), atol=1e-4)
    # negative controls: verify rows that claim one more accepted token draft differently;
    # captured rows of the wrong request write other context
    _, _, wrong = _launch(tiny_llama_dir, kind, ahead=True, shift=True)
    assert [list(c.req.draft_tokens) for c in wrong] != [list(c.req.draft_tokens) for c in ref]
    _, kv_w, wrong = _launch(tiny_llama_dir, kind, ahead=True, swap_rows=True)
    assert not torch.allclose(_committed_kv(kv_w, wrong), _committed_kv(kv_e, ref), atol=1e-3)


def test_executor_launches_drafts_ahead_losslessly_within_owned_pages(make_llm, tiny_llama_dir, tiny_drafters,
                                                                      monkeypatch):
    """The executor's whole flow on the CPU (graphs stood in by direct runs, Triton's interpreter):
    more requests than the batch, staggered max_tokens (arrivals next to verify steps, requests
    finishing mid-block): greedy output equals no-spec token for token, most drafts are launched
    ahead, and every page the attention kernel reads (kv_lens / P of each table row) is a real
    page of the pool, never a BAD_PAGE_INDEX."""
    pytest.importorskip("triton")
    from tensorrt_llm._torch.attention_backend import triton_paged_kernel

    prompts = [[5 + i, 6, 7, 8 + i, 9, 10 + 2 * i][: 3 + i % 4] for i in range(10)]
    max_tokens = [23, 9, 31, 4, 17, 28, 12, 2, 25, 19]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    base = make_llm(tiny_llama_dir, max_batch_size=4)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]

    bad, calls = [], []
    real = triton_paged_kernel.paged_attention

    def checked(q, kv_cache, block_tables, kv_lens, *a, **k):
        p = kv_cache.shape[3]
        for b, n in enumerate(kv_lens.tolist()):
            pages = block_tables[b, :-(-n // p)]
            if bool((pages < 0).any()) or bool((pages >= kv_cache.shape[0]).any()):
                bad.append((b, n, pages.tolist()))
        calls.append(len(kv_lens))
        return real(q, kv_cache, block_tables, kv_lens, *a, **k)
    monkeypatch.setattr(triton_paged_kernel, "paged_attention", checked)

    spec = {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}
    llm = make_llm(tiny_llama_dir, max_batch_size=4, speculative_config=spec)
    worker = llm._executor.drafter
    k = worker.max_draft_len
    runner = DraftGraphRunner(worker.drafter, worker.kv, TritonAttention(), worker.kv_caches, torch.device("cpu"),
                              4, verify_widths=[k + 1], num_drafts=k, capture=False)
    worker.graph_runner = runner
    engine = llm._executor.engine            # the one-graph step drafts through the same runner
    engine.spec_step = SpecStepGraph(engine.spec_step.target, runner)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert not bad, bad[:3]
    launches = runner.num_launches + engine.spec_step.num_launches
    assert calls and launches > 10 and runner.num_drafted > 2 * launches


def test_verify_gathers_draft_rows_of_several_steps_on_the_device(monkeypatch):
    """The verify step's draft ids: rows of two draft steps (a launched graph and an eager group)
    and a host list together; rows are gathered from their device tensors, never read on the host."""
    from tensorrt_llm._torch.runtime.token_rows import PendingTokens
    a = PendingTokens(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    b = PendingTokens(torch.tensor([[7, 8], [9, 10], [11, 12]]))
    reqs = [SimpleNamespace(draft_tokens=d) for d in (a.row(1), [20, 21], b.row(2), a.row(0, 2))]

    def no_host_read(self):
        raise AssertionError("a draft row was read on the host")
    monkeypatch.setattr(PendingTokens, "rows", no_host_read)
    ids = DSparkWorker._draft_ids([r.draft_tokens for r in reqs], 3, torch.device("cpu"))
    got = [row[:len(r.draft_tokens)] for row, r in zip(ids.tolist(), reqs)]
    assert got == [[4, 5, 6], [20, 21], [11, 12], [1, 2]]
    with pytest.raises(AssertionError, match="read on the host"):     # control: reading a row does
        list(reqs[0].draft_tokens)


@pytest.mark.parametrize("error,recovers", [(RuntimeError("capture refused"), True),
                                            (torch.cuda.OutOfMemoryError("CUDA out of memory"), False),
                                            (RuntimeError("CUDA error: an illegal memory access"), False)])
def test_draft_ahead_turns_the_graph_off_only_for_non_device_errors(tiny_llama_dir, error, recovers):
    """A launch the runtime refuses: drafting goes eager from then on; a device fault propagates (the
    executor fails every request) and the graph stays as it was."""
    worker, kv, _ = _worker(tiny_llama_dir, "gqa")

    class Failing:
        def launch(self, *a):
            raise error
    worker.graph_runner = runner = Failing()
    items = [VerifiedSegment(_req(0, 20, 2), 0, 20, Q, 0)]
    if recovers:
        assert worker.draft_ahead(items, torch.zeros(1, Q, dtype=torch.long), torch.zeros(Q, 8)) is None
        assert worker.graph_runner is None and worker.graph_backend.startswith("off after an error")
    else:
        with pytest.raises(type(error)):
            worker.draft_ahead(items, torch.zeros(1, Q, dtype=torch.long), torch.zeros(Q, 8))
        assert worker.graph_runner is runner
