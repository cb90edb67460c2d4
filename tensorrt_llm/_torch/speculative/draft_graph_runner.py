"""CUDA graphs for the DSpark draft step of generation-only steps (context write + block + drafts).

After a verify step of B requests with q = K+1 tokens each (the target graph's shape), one
captured graph per batch bucket runs the whole draft step::

    captured rows [bucket*q, n*H] -> fc + norm -> draft context of all q rows at start..start+q-1
    block [anchor, MASK x (S-1)] at ctx'..ctx'+S-1 (ctx' = start + accepted), non-causal
    greedy Markov chain over the block's slots -> draft ids [bucket, k_max]

All q verified rows are written, also the rejected ones: their positions lie in
ctx'..ctx'+S-1 (q <= S + 1 and at least one token is accepted), so the block overwrites them
in the same replay and every later step rewrites them before they are read; only committed
positions are ever marked written or published. Padding requests write into a scratch page
the runner holds. Persistent inputs live in `_DraftEntry`; the block's metadata is an
`AttentionMetadata` with persistent slot_mapping / block_tables that the backend plans
outside the graph (`prepare` with md.graph_shape set) before each replay. All integer inputs
are views of one device buffer, staged in one pinned host buffer of the same layout and sent
with one non-blocking copy (the host does not wait for the GPU to stage a draft step)::

    io: [ ctx_pos | ctx_slots (n = bucket*q) | blk_ids | blk_pos | blk_slots (m = bucket*S)
          | block_tables (bucket x max_pages int32, two per int64 word) ]

Split steps: a committed entry is eligible when its request is in GENERATION (or finished),
greedy (or finished), its captured segment has exactly q rows, it commits 1..q tokens and
every slot (context and block) is owned. The eligible entries (at most the largest bucket)
replay the graph: their rows are gathered out of the step's captured tensor (a view when
they are contiguous, else one index_select) and rebased to row i*q; the other entries
(prompt chunks, shorter verify segments, sampled requests, clamped pages) take the eager
draft step with the original captured tensor and rows. Requests are independent (own
pages, own context), so the two halves may run in either order.

Captured row counts come from the row layout: the step's segments tile the captured rows
(`captured_row_counts`). An entry missing from `committed` (a request that failed in its
update) only lengthens its row-predecessor's count; when that makes a shorter segment look
like q rows, the extra rows land at positions start+n..start+q-1, which the block
overwrites in the same replay and which are never marked written (the rule above).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from ..pyexecutor.kv_cache.resource_manager import KVCacheManager
from ..runtime.cuda_graph import GraphCache, GraphEntry, batch_buckets, check_graph_support, fill_padded, owned_rows
from ..runtime.llm_request import RequestState
from ..runtime.step import StepCommit
from ..runtime.token_rows import PendingDrafts

logger = logging.getLogger("tensorrt_llm")


def captured_row_counts(row0s: Sequence[int], total_rows: int) -> list[int]:
    """Captured rows of each entry when the entries' segments tile [0, total_rows) in any
    order: the distance to the next larger row0 (or to total_rows)."""
    order = sorted(range(len(row0s)), key=lambda i: row0s[i])
    out = [0] * len(row0s)
    for a, b in zip(order, order[1:] + [None]):
        end = total_rows if b is None else row0s[b]
        if end < row0s[a] or (b is not None and end == row0s[a]):
            raise ValueError(f"row0 {row0s[a]} repeated or beyond {total_rows} captured rows")
        out[a] = end - row0s[a]
    return out


@dataclass
class DraftPlan:
    """Host-side inputs of the graph group of a draft step (B requests)."""

    bucket: int
    ctx_slots: np.ndarray             # [B, q] int64, all >= 0
    blk_slots: np.ndarray             # [B, S] int64, all >= 0
    new_ctx: list[int]                # [B] ctx' = start + accepted
    anchors: list[int]                # [B] block token 0
    rows: np.ndarray                  # [B] int64 rows of kv.page_table


@dataclass
class _DraftEntry(GraphEntry):
    """Persistent device inputs of one batch bucket; outputs: draft ids [bucket, k_max] int64."""

    bucket: int = 0
    captured: Optional[torch.Tensor] = None   # [bucket*q, n*H] target dtype
    ctx_pos: Optional[torch.Tensor] = None    # [bucket*q] int64 (view of io)
    ctx_slots: Optional[torch.Tensor] = None  # [bucket*q] int64, all >= 0 (view of io)
    blk_ids: Optional[torch.Tensor] = None    # [bucket*S] int64 (view of io)
    blk_pos: Optional[torch.Tensor] = None    # [bucket*S] int64 (view of io)
    md: Optional[AttentionMetadata] = None    # non-causal block metadata; slot_mapping, block_tables: views of io
    io: Optional[torch.Tensor] = None         # [words] int64 device buffer (layout: module doc)
    host: Optional[torch.Tensor] = None       # [words] int64 CPU staging, pinned on CUDA
    host_views: tuple[np.ndarray, ...] = ()   # numpy views of host, in io order
    copied: Optional[torch.cuda.Event] = None  # the last host -> io copy (staging buffer reuse)


class DraftGraphRunner:
    """Captures and replays the drafter's whole step per batch bucket (greedy drafting)."""

    def __init__(self, drafter: torch.nn.Module, kv: KVCacheManager, backend, kv_caches: Sequence[torch.Tensor],
                 device: torch.device, max_batch_size: int, verify_tokens: int, num_drafts: int,
                 buckets: Optional[Sequence[int]] = None):
        cfg = drafter.config
        check_graph_support(device, backend, max(verify_tokens, cfg.block_size), kv.tokens_per_block,
                            "the drafter's attention backend")
        if verify_tokens > cfg.block_size + 1:
            raise ValueError(f"verify_tokens {verify_tokens} > block_size + 1 ({cfg.block_size + 1})")
        self.drafter, self.kv, self.backend = drafter, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.q = verify_tokens
        self.block_size = cfg.block_size
        self.k_max = num_drafts
        self.mask_token_id = cfg.mask_token_id
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_batch_size)
        self.scratch_page = kv.scratch_page()
        self.graphs: GraphCache[_DraftEntry] = GraphCache(device)
        self.num_eager_fallbacks = 0     # draft steps run wholly eagerly
        self.num_split_steps = 0         # draft steps whose graph group replayed next to an eager rest

    # ---- eligibility ---------------------------------------------------------------------
    def partition(self, committed: Sequence[StepCommit],
                  rows: Sequence[int]) -> tuple[list[int], Optional[DraftPlan]]:
        """(indices of the entries that can replay, in order; their `DraftPlan`), ([], None) when
        none can. rows[i]: captured rows of committed[i]'s segment.

        The per-entry checks are cheap Python; the context and block slots of all candidates
        come from one `slots_batch` call each (no per-token Python).
        """
        q, s = self.q, self.block_size
        cand = [i for i, (c, r) in enumerate(zip(committed, rows))
                if r == q and 1 <= c.count <= q and (c.req.is_finished or (c.req.state == RequestState.GENERATION
                                                                           and c.req.sampling_params.greedy))]
        if not cand:
            return [], None
        rids = [committed[i].req.request_id for i in cand]
        starts = np.fromiter((committed[i].start for i in cand), dtype=np.int64, count=len(cand))
        new_ctx = starts + np.fromiter((committed[i].count for i in cand), dtype=np.int64, count=len(cand))
        table_rows = self.kv.rows(rids)
        ctx = self.kv.slots_batch(rids, starts, q, rows=table_rows)
        blk = self.kv.slots_batch(rids, new_ctx, s, rows=table_rows)
        ok = np.flatnonzero(owned_rows(ctx) & owned_rows(blk))[:self.buckets[-1]]
        if not len(ok):
            return [], None
        idx = [cand[k] for k in ok.tolist()]
        anchors = []
        for i, c in zip(idx, new_ctx[ok].tolist()):
            req = committed[i].req
            anchors.append(req.token_at(c) if not req.is_finished and c < req.num_tokens
                           else self.mask_token_id)
        bucket = next(x for x in self.buckets if x >= len(idx))
        return idx, DraftPlan(bucket, ctx[ok], blk[ok], new_ctx[ok].tolist(), anchors, table_rows[ok])

    # ---- run -----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, committed: Sequence[StepCommit],
              captured: torch.Tensor) -> tuple[list[int], Optional[PendingDrafts]]:
        """Replay the graph for the eligible entries of a draft step (context written, block run).

        captured: [T, n*H], the step's captured rows. Returns (indices of the replayed entries
        in committed, their draft ids [G, k_max], still on the device); ([], None) when none is
        eligible.
        """
        rows = captured_row_counts([c.row0 for c in committed], captured.shape[0])
        idx, plan = self.partition(committed, rows)
        if plan is None:
            self.num_eager_fallbacks += 1
            return [], None
        if len(idx) < len(committed):
            self.num_split_steps += 1
        q = self.q
        row0s = [committed[i].row0 for i in idx]
        base, b = row0s[0], len(idx)
        if row0s == list(range(base, base + b * q, q)):
            group_captured = captured[base:base + b * q]
        else:
            sel = (torch.tensor(row0s, dtype=torch.long).view(-1, 1) + torch.arange(q)).view(-1)
            group_captured = captured.index_select(0, sel.to(captured.device))
        group = [StepCommit(c.req, j * q, c.start, c.count) for j, c in enumerate(committed[i] for i in idx)]
        return idx, self.run(group, group_captured, plan)

    @torch.inference_mode()
    def run(self, committed: Sequence[StepCommit], captured: torch.Tensor,
            plan: DraftPlan) -> PendingDrafts:
        """Replay for a graph group (`partition`): committed[j] has row0 j*q, captured [B*q, n*H].
        Returns the draft ids [B, k_max] without waiting for them (a copy of the graph's output;
        their host copy is under way)."""
        b = len(committed)
        if captured.shape[0] != b * self.q or len(plan.anchors) != b:
            raise ValueError(f"draft graph group of {b} entries: captured has {captured.shape[0]} rows, "
                             f"plan {len(plan.anchors)} entries (q={self.q})")
        entry = self.graphs.entry(plan.bucket, lambda: self._new_entry(plan.bucket, captured.shape[1], captured.dtype))
        self._load_inputs(entry, committed, captured, plan)
        if entry.graph is None:
            logger.info("capturing draft CUDA graph for batch bucket %d (%d verify rows, block %d)",
                        entry.bucket, self.q, self.block_size)
        draft_ids = self.graphs.replay(entry, self._forward)
        return PendingDrafts(draft_ids[:b].clone())

    def _io_views(self, buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
        """(ctx_pos, ctx_slots [bucket*q], blk_ids, blk_pos, blk_slots [bucket*S] int64,
        block_tables [bucket, max_pages] int32) views of an io buffer."""
        n, m, width = bucket * self.q, bucket * self.block_size, self.kv.max_blocks_per_seq
        cuts = [0, n, 2 * n, 2 * n + m, 2 * n + 2 * m, 2 * n + 3 * m]
        ints = tuple(buf[a:b] for a, b in zip(cuts, cuts[1:]))
        table = buf[cuts[-1]:].view(torch.int32)[:bucket * width].view(bucket, width)
        return ints + (table,)

    def _new_entry(self, bucket: int, width: int, dtype: torch.dtype) -> _DraftEntry:
        q, s, dev = self.q, self.block_size, self.device
        max_pages = self.kv.max_blocks_per_seq
        words = 2 * bucket * q + 3 * bucket * s + -(-bucket * max_pages // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        ctx_pos, ctx_slots, blk_ids, blk_pos, blk_slots, table = self._io_views(io, bucket)
        table.fill_(BAD_PAGE_INDEX)
        md = AttentionMetadata(seq_lens=[s] * bucket, num_cached=[0] * bucket, block_tables=table,
                               slot_mapping=blk_slots, tokens_per_block=self.kv.tokens_per_block, causal=False)
        return _DraftEntry(bucket=bucket, captured=torch.zeros(bucket * q, width, dtype=dtype, device=dev),
                           ctx_pos=ctx_pos, ctx_slots=ctx_slots, blk_ids=blk_ids, blk_pos=blk_pos, md=md,
                           io=io, host=host, host_views=tuple(t.numpy() for t in self._io_views(host, bucket)))

    def _load_inputs(self, entry: _DraftEntry, committed: Sequence[StepCommit], captured: torch.Tensor,
                     plan: DraftPlan) -> None:
        """Stage the padded inputs in entry.host, send them with one non-blocking copy, plan the block."""
        q, s, b, bucket = self.q, self.block_size, len(committed), entry.bucket
        p, scratch = self.kv.tokens_per_block, self.scratch_page
        if entry.copied is not None:
            entry.copied.synchronize()     # the previous step's copy has left the staging buffer
        ctx_pos, ctx_slots, blk_ids, blk_pos, blk_slots, table = entry.host_views
        starts = np.fromiter((c.start for c in committed), dtype=np.int64, count=b)
        new_ctx = np.asarray(plan.new_ctx, dtype=np.int64)
        ctx_slots[:b * q] = plan.ctx_slots.reshape(-1)
        fill_padded(ctx_pos, ctx_slots, starts, b, bucket, q, scratch, p)
        blk_slots[:b * s] = plan.blk_slots.reshape(-1)
        fill_padded(blk_pos, blk_slots, new_ctx, b, bucket, s, scratch, p)
        ids = blk_ids.reshape(bucket, s)
        ids[:b] = self.mask_token_id
        ids[:b, 0] = plan.anchors
        ids[b:] = 0
        np.take(self.kv.page_table, plan.rows, axis=0, out=table[:b])
        table[b:] = BAD_PAGE_INDEX
        table[b:, 0] = scratch
        entry.io.copy_(entry.host, non_blocking=True)
        if entry.io.is_cuda:
            entry.copied = torch.cuda.Event()
            entry.copied.record()
        entry.captured[:b * q].copy_(captured)
        md = entry.md
        md.num_cached = plan.new_ctx + [0] * (bucket - b)
        md.graph_shape = (bucket, s, self.kv.max_blocks_per_seq)
        self.backend.prepare(md)

    def _forward(self, entry: _DraftEntry) -> torch.Tensor:
        d = self.drafter
        feats = d.context_features(entry.captured)
        d.write_context(feats, entry.ctx_pos, entry.ctx_slots, self.kv_caches, self.backend, slots_valid=True)
        hidden = d.forward_block(entry.blk_ids, entry.blk_pos, entry.md, self.kv_caches, self.backend)
        ids, _ = d.propose(hidden, entry.blk_ids.view(entry.bucket, self.block_size)[:, 0], self.k_max)
        return ids
