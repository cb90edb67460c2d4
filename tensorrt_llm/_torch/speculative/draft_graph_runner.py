"""CUDA graphs for the DSpark draft step, launched from the verify step's device-side acceptance.

The draft step of a verified request needs its acceptance: the block sits after the committed
tokens and starts with the last one. Both are read on the device from the verify output, so
the draft step is launched right behind the verify step, before the host copies the verify
rows; the host learns the acceptance (one sync) while the GPU drafts, and its update and the
next target step's planning overlap the draft step. Per batch bucket one captured graph::

    verify rows [bucket, q] (-1 padded)  -> n = committed tokens (1..q), anchor = row[n - 1]
    ctx' = start + n; block positions ctx'..ctx'+S-1; block slots from the block-table rows
    captured rows [bucket*q, n*H] -> fc + norm -> draft context of all q rows at start..start+q-1
    block [anchor, MASK x (S-1)], non-causal, attention lengths ctx' + S read on the device
    (the TRITON backend: no host plan) -> greedy Markov chain -> draft ids [bucket, k_max]

All q verified rows are written, also the rejected ones: their positions lie in
ctx'..ctx'+S-1 (q <= S + 1 and n >= 1), so the block overwrites them in the same replay and
every later step rewrites them before they are read; only committed positions are ever marked
written (`DSparkWorker.draft`, after the host update). A request whose host update caps or
stops it is finished, so a running request's host count always equals the device count.

Eligible (decided on the host before the sync): GENERATION, greedy, a verify segment of q
rows, every slot from start to start+q+S-1 owned; at most the largest bucket. Padding rows
live in the scratch page (verify row [0, -1, ..]: ctx' = 1, block 1..S, so q, S + 1 <= P).
Inputs are staged in one pinned host buffer and sent with one non-blocking copy::

    io: [ ctx_pos | ctx_slots (bucket*q) | starts (bucket) | block_tables (bucket x max_pages int32) ]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata, host_ints
from ..pyexecutor.kv_cache.resource_manager import KVCacheManager
from ..runtime.cuda_graph import GraphCache, GraphEntry, batch_buckets, check_graph_support, fill_padded, owned_rows
from ..runtime.llm_request import RequestState
from ..runtime.step import DraftsAhead, VerifiedSegment
from ..runtime.token_rows import PendingTokens

logger = logging.getLogger("tensorrt_llm")


@dataclass
class DraftPlan:
    """Host-side inputs of a draft launch (B requests)."""

    bucket: int
    starts: np.ndarray        # [B] int64 first committed position (the anchor's)
    ctx_slots: np.ndarray     # [B, q] int64, all >= 0
    rows: np.ndarray          # [B] int64 rows of kv.page_table


@dataclass
class _DraftEntry(GraphEntry):
    """Persistent inputs of one batch bucket; outputs: draft ids [bucket, k_max] int64."""

    bucket: int = 0
    captured: Optional[torch.Tensor] = None    # [bucket*q, n*H] target dtype
    verified: Optional[torch.Tensor] = None    # [bucket, q] int64, -1 padded
    ctx_pos: Optional[torch.Tensor] = None     # [bucket*q] int64 (view of io)
    ctx_slots: Optional[torch.Tensor] = None   # [bucket*q] int64 (view of io)
    starts: Optional[torch.Tensor] = None      # [bucket] int64 (view of io)
    md: Optional[AttentionMetadata] = None     # block metadata: block_tables view of io; slot_mapping and
                                               # kv_lens_device written by the graph
    io: Optional[torch.Tensor] = None          # [words] int64 device buffer (layout: module doc)
    host: Optional[torch.Tensor] = None        # [words] int64 CPU staging, pinned on CUDA
    host_views: tuple[np.ndarray, ...] = ()    # numpy views of host, in io order
    copied: Optional[torch.cuda.Event] = None  # the last host -> io copy (staging buffer reuse)


class DraftGraphRunner:
    """Captures and replays the drafter's whole step per batch bucket, from device-side acceptance."""

    def __init__(self, drafter: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 kv_caches: Sequence[torch.Tensor], device: torch.device, max_batch_size: int,
                 verify_tokens: int, num_drafts: int, buckets: Optional[Sequence[int]] = None):
        cfg = drafter.config
        if not backend.capabilities.device_lengths:
            raise ValueError(f"the draft graph needs an attention backend that reads lengths on the device; "
                             f"{backend.name} plans on the host")
        check_graph_support(device, backend, max(verify_tokens, cfg.block_size + 1), kv.tokens_per_block,
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
        self.num_launches = 0
        self.num_drafted = 0             # requests drafted by the graph (the rest draft after the host update)

    # ---- eligibility ---------------------------------------------------------------------
    def plan(self, items: Sequence[VerifiedSegment], counts: Sequence[int]) -> tuple[list[int], Optional[DraftPlan]]:
        """(indices of the items that can launch, in order; their `DraftPlan`), ([], None) when none
        can. counts[i]: tokens of item i's verify segment (captured rows)."""
        q, s = self.q, self.block_size
        cand = [i for i, (it, n) in enumerate(zip(items, counts))
                if n == q and it.req.state == RequestState.GENERATION and not it.req.is_finished
                and it.req.sampling_params.greedy]
        if not cand:
            return [], None
        rids = [items[i].req.request_id for i in cand]
        starts = np.fromiter((items[i].start for i in cand), dtype=np.int64, count=len(cand))
        rows = self.kv.rows(rids)
        slots = self.kv.slots_batch(rids, starts, q + s, rows=rows)   # context, then the furthest block
        ok = np.flatnonzero(owned_rows(slots))[:self.buckets[-1]]
        if not len(ok):
            return [], None
        bucket = next(x for x in self.buckets if x >= len(ok))
        return [cand[k] for k in ok.tolist()], DraftPlan(bucket, starts[ok], slots[ok, :q], rows[ok])

    # ---- run -----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, items: Sequence[VerifiedSegment], counts: Sequence[int], verified: torch.Tensor,
               captured: torch.Tensor) -> Optional[DraftsAhead]:
        """Replay the draft graph for the eligible items (no wait on the GPU).

        verified: [G, q] int64 verify output on the device (-1 padded); captured: [T, n*H] the
        step's captured rows. Returns the launched requests' drafts (still on the device, their
        host copy under way), or None when no item is eligible.
        """
        idx, plan = self.plan(items, counts)
        if plan is None:
            return None
        group = [items[i] for i in idx]
        q, b = self.q, len(group)
        row0s = [it.row0 for it in group]
        if row0s == list(range(row0s[0], row0s[0] + b * q, q)):
            group_captured = captured[row0s[0]:row0s[0] + b * q]
        else:
            sel = (np.asarray(row0s, dtype=np.int64)[:, None] + np.arange(q)).reshape(-1)
            group_captured = captured.index_select(0, host_ints(sel, captured.device))
        vrows = [it.verify_row for it in group]
        if vrows == list(range(vrows[0], vrows[0] + b)):
            group_verified = verified[vrows[0]:vrows[0] + b]
        else:
            group_verified = verified.index_select(0, host_ints(vrows, verified.device))
        entry = self.graphs.entry(plan.bucket, lambda: self._new_entry(plan.bucket, captured.shape[1],
                                                                        captured.dtype))
        self._load_inputs(entry, b, group_captured, group_verified, plan)
        if entry.graph is None:
            logger.info("capturing draft CUDA graph for batch bucket %d (%d verify rows, block %d)",
                        entry.bucket, q, self.block_size)
        draft_ids = self.graphs.replay(entry, self._forward)
        self.num_launches += 1
        self.num_drafted += b
        return DraftsAhead({it.req.request_id: j for j, it in enumerate(group)},
                           PendingTokens(draft_ids[:b].clone()))

    def _io_views(self, buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
        """(ctx_pos, ctx_slots [bucket*q], starts [bucket] int64, block_tables [bucket, max_pages]
        int32) views of an io buffer."""
        n, width = bucket * self.q, self.kv.max_blocks_per_seq
        table = buf[2 * n + bucket:].view(torch.int32)[:bucket * width].view(bucket, width)
        return buf[:n], buf[n:2 * n], buf[2 * n:2 * n + bucket], table

    def _new_entry(self, bucket: int, width: int, dtype: torch.dtype) -> _DraftEntry:
        q, s, dev = self.q, self.block_size, self.device
        words = 2 * bucket * q + bucket + -(-bucket * self.kv.max_blocks_per_seq // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        ctx_pos, ctx_slots, starts, table = self._io_views(io, bucket)
        table.fill_(BAD_PAGE_INDEX)
        md = AttentionMetadata(seq_lens=[s] * bucket, num_cached=[0] * bucket, block_tables=table,
                               slot_mapping=torch.zeros(bucket * s, dtype=torch.long, device=dev),
                               tokens_per_block=self.kv.tokens_per_block, causal=False,
                               kv_lens_device=torch.full((bucket,), s, dtype=torch.int32, device=dev))
        verified = torch.full((bucket, q), -1, dtype=torch.long, device=dev)
        verified[:, 0] = 0
        return _DraftEntry(bucket=bucket, captured=torch.zeros(bucket * q, width, dtype=dtype, device=dev),
                           verified=verified, ctx_pos=ctx_pos, ctx_slots=ctx_slots, starts=starts, md=md,
                           io=io, host=host, host_views=tuple(t.numpy() for t in self._io_views(host, bucket)))

    def _load_inputs(self, entry: _DraftEntry, b: int, captured: torch.Tensor, verified: torch.Tensor,
                     plan: DraftPlan) -> None:
        """Stage the padded host inputs (one non-blocking copy) and the group's device rows."""
        q, bucket, p, scratch = self.q, entry.bucket, self.kv.tokens_per_block, self.scratch_page
        if captured.shape[0] != b * q or verified.shape != (b, q):
            raise ValueError(f"draft group of {b} requests: captured {tuple(captured.shape)}, verified "
                             f"{tuple(verified.shape)} (q={q})")
        if entry.copied is not None:
            entry.copied.synchronize()     # the previous launch's copy has left the staging buffer
        ctx_pos, ctx_slots, starts, table = entry.host_views
        ctx_slots[:b * q] = plan.ctx_slots.reshape(-1)
        fill_padded(ctx_pos, ctx_slots, plan.starts, b, bucket, q, scratch, p)
        starts[:b] = plan.starts
        starts[b:] = 0
        np.take(self.kv.page_table, plan.rows, axis=0, out=table[:b])
        table[b:] = BAD_PAGE_INDEX
        table[b:, 0] = scratch
        entry.io.copy_(entry.host, non_blocking=True)
        if entry.io.is_cuda:
            entry.copied = torch.cuda.Event()
            entry.copied.record()
        entry.captured[:b * q].copy_(captured)
        entry.verified[:b].copy_(verified)
        if b < bucket:                     # padding rows: one committed token, at position 0
            entry.verified[b:] = -1
            entry.verified[b:, 0] = 0
        entry.md.graph_shape = (bucket, self.block_size, self.kv.max_blocks_per_seq)
        self.backend.prepare(entry.md)     # host-side checks only: the graph computes the lengths

    def _forward(self, entry: _DraftEntry) -> torch.Tensor:
        d, md, s, p = self.drafter, entry.md, self.block_size, self.kv.tokens_per_block
        committed = (entry.verified >= 0).sum(1)                              # [bucket] 1..q
        anchors = entry.verified.gather(1, (committed - 1)[:, None])[:, 0]
        new_ctx = entry.starts + committed
        blk_pos = new_ctx[:, None] + torch.arange(s, device=new_ctx.device)   # [bucket, S]
        pages = md.block_tables.long().gather(1, blk_pos // p)
        md.slot_mapping.copy_((pages * p + blk_pos % p).view(-1))
        md.kv_lens_device.copy_(new_ctx + s)
        blk_ids = torch.full_like(blk_pos, self.mask_token_id)
        blk_ids[:, 0] = anchors
        feats = d.context_features(entry.captured)
        d.write_context(feats, entry.ctx_pos, entry.ctx_slots, self.kv_caches, self.backend, slots_valid=True)
        hidden = d.forward_block(blk_ids.view(-1), blk_pos.view(-1), md, self.kv_caches, self.backend)
        ids, _ = d.propose(hidden, anchors, self.k_max)
        return ids
