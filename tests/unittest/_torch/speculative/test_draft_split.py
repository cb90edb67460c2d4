"""Split draft steps: the graph group (q captured rows, GENERATION or finished, greedy, owned
slots) replays, the rest drafts eagerly with the step's original rows.

CPU: `captured_row_counts` on tiled layouts; `DraftGraphRunner.partition` on every kind of
entry; and a whole split draft step (the graph "replayed" by the eager draft step on the
gathered, rebased rows) equals the plain eager draft step: same drafts, same draft KV at
every committed position; a wrong row layout changes the KV (negative control).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm._torch.runtime.step import StepCommit
from tensorrt_llm import DSparkDecodingConfig, SamplingParams
from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
from tensorrt_llm._torch.attention_backend.resolver import Resolution
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.runtime.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.runtime.sampler import Sampler
from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner, captured_row_counts
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
from tensorrt_llm._torch.runtime.token_rows import DraftRow, PendingDrafts

P, Q, S = 16, 5, 4          # page, verify rows (K+1; K = 4 drafts with shift_label), block


def test_captured_row_counts():
    assert captured_row_counts([0, 4, 8], 12) == [4, 4, 4]
    assert captured_row_counts([9, 0, 13, 5], 17) == [4, 5, 4, 4]      # stitched: eager rows first
    assert captured_row_counts([3], 10) == [7]
    assert captured_row_counts([], 0) == []
    with pytest.raises(ValueError, match="repeated"):
        captured_row_counts([0, 0], 8)
    with pytest.raises(ValueError, match="beyond"):
        captured_row_counts([0, 9], 8)


def _runner(kv, buckets=None):
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=S, mask_token_id=511))
    runner = DraftGraphRunner(drafter, kv, FlashInferAttention(), [], torch.device("cuda"), 8,
                              verify_tokens=Q, num_drafts=Q - 1, buckets=buckets)
    runner.device = torch.device("cpu")    # built for "cuda" (its device check); host work only
    return runner


def _req(rid, start, n, state=RequestState.GENERATION, greedy=True, prompt=6):
    """A request after its update: start + n committed tokens, the last sampled one pending."""
    total = start + n + (state != RequestState.CONTEXT)
    sp = (SamplingParams(max_tokens=64, ignore_eos=True) if greedy else
          SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True))
    prompt = max(prompt, min(total, start + n)) if state == RequestState.CONTEXT else min(prompt, total)
    toks = [3 + (7 * rid + i) % 400 for i in range(max(total, prompt))]
    req = LlmRequest(rid, toks[:prompt], sp)
    req.output_token_ids = toks[prompt:total]
    req.num_computed = start + n
    req.state = state
    return req


def _kv(num_pages=64, draft_spec=None):
    specs = [KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)]
    if draft_spec is not None:
        specs.append(draft_spec)
    return KVCacheManager(specs, num_pages, P, 128, torch.device("cpu"))


def test_partition_picks_graphable_entries():
    kv = _kv()
    for rid in range(9):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    fin = _req(6, 20, 2)
    fin.finish("length")
    committed = [StepCommit(*c) for c in [(_req(0, 20, 2), 0, 20, 2),                                 # graph
                 (_req(1, 0, 5, RequestState.CONTEXT, prompt=30), 5, 0, 5),  # prompt chunk of q rows
                 (_req(2, 20, 4), 10, 20, 4),                                # graph
                 (_req(3, 20, 1, greedy=False), 15, 20, 1),                  # sampled
                 (_req(4, 20, 1), 20, 20, 1),                                # 2 rows: shorter verify
                 (_req(5, 44, 2), 22, 44, 2),                                # context 44..48: not owned
                 (fin, 27, 20, 2),                                           # finished: graph
                 (_req(7, 10, 4), 32, 10, 4)]]                                # graph
    rows = captured_row_counts([c.row0 for c in committed], 37)
    assert rows == [5, 5, 5, 5, 2, 5, 5, 5]
    runner = _runner(kv)
    idx, plan = runner.partition(committed, rows)
    assert idx == [0, 2, 6, 7] and plan.bucket == 4
    assert plan.new_ctx == [22, 24, 22, 14]
    assert plan.anchors == [committed[0].req.token_at(22), committed[2].req.token_at(24), 511,
                            committed[7].req.token_at(14)]
    assert plan.ctx_slots.tolist() == [kv.slots(r, c, Q) for r, c in ((0, 20), (2, 20), (6, 20), (7, 10))]
    assert plan.blk_slots.tolist() == [kv.slots(r, c, S) for r, c in ((0, 22), (2, 24), (6, 22), (7, 14))]
    idx, _ = _runner(kv, buckets=[1, 2]).partition(committed, rows)
    assert idx == [0, 2]                                                     # the largest bucket
    assert runner.partition(committed[1:2], rows[1:2]) == ([], None)


def test_load_inputs_stages_one_padded_buffer():
    """The graph inputs of a draft step: one host buffer, laid out as the views the graph reads."""
    from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX
    kv = _kv()
    for rid in range(3):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    committed = [StepCommit(_req(0, 20, 2), 0, 20, 2), StepCommit(_req(1, 8, 5), Q, 8, 5),
                 StepCommit(_req(2, 30, 1), 2 * Q, 30, 1)]
    runner = _runner(kv, buckets=[4])
    prepared = []
    runner.backend = SimpleNamespace(prepare=prepared.append)
    idx, plan = runner.partition(committed, [Q] * 3)
    assert idx == [0, 1, 2] and plan.bucket == 4
    entry = runner._new_entry(4, 6, torch.float32)
    captured = torch.randn(3 * Q, 6)
    runner._load_inputs(entry, committed, captured, plan)
    scratch, ar_q, ar_s = runner.scratch_page, torch.arange(Q), torch.arange(S)
    starts, new_ctx = [20, 8, 30], [22, 13, 31]
    assert entry.ctx_pos.view(4, Q).tolist() == [(st + ar_q).tolist() for st in starts] + [ar_q.tolist()]
    assert entry.ctx_slots.view(4, Q).tolist() == plan.ctx_slots.tolist() + [(scratch * P + ar_q).tolist()]
    assert entry.blk_pos.view(4, S).tolist() == [(c + ar_s).tolist() for c in new_ctx] + [ar_s.tolist()]
    anchors = [committed[i].req.token_at(c) for i, c in enumerate(new_ctx)]
    assert entry.blk_ids.view(4, S).tolist() == [[a] + [511] * (S - 1) for a in anchors] + [[0] * S]
    md = entry.md
    assert prepared == [md] and md.num_cached == new_ctx + [0] and md.graph_shape == (4, S, kv.max_blocks_per_seq)
    assert md.slot_mapping.view(4, S).tolist() == plan.blk_slots.tolist() + [(scratch * P + ar_s).tolist()]
    tables = kv.block_tables([0, 1, 2], torch.device("cpu"))
    w = tables.shape[1]
    assert torch.equal(md.block_tables[:3, :w], tables) and (md.block_tables[:3, w:] == BAD_PAGE_INDEX).all()
    assert md.block_tables[3, 0] == scratch and (md.block_tables[3, 1:] == BAD_PAGE_INDEX).all()
    assert not torch.equal(md.block_tables[0], md.block_tables[1])     # each request its own row
    assert torch.equal(entry.captured[:3 * Q], captured)


# ---- a whole split draft step on the CPU -------------------------------------------------------
def _worker(tiny_llama_dir):
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "t")
    drafter = DSparkForCausalLMBase.random_init("gqa", tc, seed=2, block_size=S)
    torch.manual_seed(0)     # the bound embedding / head: the same in every twin
    drafter.bind_target(torch.nn.Embedding(tc.vocab_size, tc.hidden_size),
                        torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False))
    worker = DSparkWorker(DSparkDecodingConfig(speculative_model="unused"), drafter, VanillaAttention(),
                          Resolution("VANILLA", "test"), torch.device("cpu"), torch.float32, "test")
    kv = _kv(draft_spec=worker.kv_cache_spec)
    worker.bind(kv, Sampler(0, torch.device("cpu")))
    return worker, kv, len(drafter.config.target_layer_ids) * tc.hidden_size


LAYOUTS = {   # row0 of requests 0..5 in a stitched captured tensor of 29 rows
    "contiguous": [9, 0, 14, 7, 19, 24],      # eager rows (prompt 0..6, short verify 7..8) first
    "gathered": [7, 0, 14, 12, 19, 24],       # the short verify between graph rows: index_select
}


def _step(tiny_llama_dir, graph: bool, layout: str, swap_rows: bool = False):
    """One draft step over a stitched layout; returns (worker, kv, committed)."""
    worker, kv, width = _worker(tiny_llama_dir)
    for rid in range(6):
        kv.add_sequence(rid, [1], 128)
        kv.ensure_capacity(rid, 48)
    fin = _req(5, 16, 3)
    fin.finish("length")
    r = LAYOUTS[layout]
    committed = [(_req(0, 20, 2), r[0], 20, 2), (_req(1, 0, 7, RequestState.CONTEXT, prompt=30), r[1], 0, 7),
                 (_req(2, 12, 4), r[2], 12, 4), (_req(3, 20, 1), r[3], 20, 1), (fin, r[4], 16, 3),
                 (_req(4, 8, 3), r[5], 8, 3)]
    if swap_rows:
        (r0, a, s0, n0), (r2, b, s2, n2) = committed[0], committed[2]
        committed[0], committed[2] = (r0, b, s0, n0), (r2, a, s2, n2)
    committed = [StepCommit(*c) for c in committed]
    captured = torch.randn(29, width, generator=torch.Generator().manual_seed(0))
    if graph:
        runner = _runner(kv)
        replays = []

        def eager_replay(group, group_captured, plan):   # the graph's job, done eagerly
            assert [c.row0 for c in group] == [j * Q for j in range(len(group))]
            worker._eager_draft(group, group_captured)
            replays.append(len(group))
            return PendingDrafts(torch.tensor([list(req.draft_tokens) + [511] * (Q - 1 - len(req.draft_tokens))
                                               for req in (c.req for c in group)]))

        runner.run = eager_replay
        worker.graph_runner = runner
    worker.draft(committed, captured)
    if graph:
        assert replays == [4] and runner.num_split_steps == 1 and runner.num_eager_fallbacks == 0
        assert worker.stats()["draft_cuda_graph"]["split_steps"] == 1
    return worker, kv, committed


def _committed_kv(kv, committed) -> torch.Tensor:
    pool, rows = kv.pools["draft"], []
    for req, start, n in ((c.req, c.start, c.count) for c in committed):
        for s in kv.slots(req.request_id, 0, start + n):
            rows.append(pool[:, s // P, :, :, s % P])
    return torch.stack(rows)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_draft_step_equals_eager(tiny_llama_dir, layout):
    _, kv_e, ref = _step(tiny_llama_dir, False, layout)
    _, kv_g, got = _step(tiny_llama_dir, True, layout)
    for a, b in ((x.req, y.req) for x, y in zip(ref, got)):
        assert list(a.draft_tokens) == list(b.draft_tokens), a.request_id
        assert kv_e.seqs[a.request_id].num_draft_valid_tokens == kv_g.seqs[b.request_id].num_draft_valid_tokens
    live = [c.req for c in got if c.req.state == RequestState.GENERATION]
    assert all(len(req.draft_tokens) == Q - 1 for req in live)
    # the graph group's drafts stay device-resident rows until read; the eager rest are lists
    assert sum(isinstance(req.draft_tokens, DraftRow) for req in live) == 3
    assert torch.allclose(_committed_kv(kv_g, got), _committed_kv(kv_e, ref), atol=1e-5)
    # negative control: two graph entries' rows swapped write other context
    _, kv_w, wrong = _step(tiny_llama_dir, True, layout, swap_rows=True)
    assert not torch.allclose(_committed_kv(kv_w, wrong), _committed_kv(kv_e, ref), atol=1e-3)
