"""CUDA graphs for the DSpark draft step, launched from the verify step's device-side acceptance.

The draft step of a verified request needs its acceptance: the block sits after the committed
tokens and starts with the last one. Both are read on the device from the verify output, so
the draft step is launched right behind the verify step, before the host copies the verify
rows; the host learns the acceptance (one sync) while the GPU drafts, and its update and the
next target step's planning overlap the draft step. Per batch bucket one captured graph::

    start = host start + shift (a continued segment: the count committed by the step before,
    on the device; 0 otherwise); context positions and slots start..start+q-1 from the table
    verify rows [bucket, q] (-1 padded)  -> n = committed tokens (1..q), anchor = row[n - 1]
    ctx' = start + n; block positions ctx'..ctx'+S-1; block slots from the block-table rows
    captured rows [bucket*q, n*H] -> fc + norm -> draft context of all q rows at start..start+q-1
    block [anchor, MASK x (S-1)], non-causal, attention lengths ctx' + S read on the device
    (no host plan) -> greedy Markov chain -> out [bucket, 2 + k_max] = [n | anchor, drafts]

All q verified rows are written, also the rejected ones: their positions lie in
ctx'..ctx'+S-1 (q <= S + 1 and n >= 1), so the block overwrites them in the same replay and
every later step rewrites them before they are read; only committed positions are ever marked
written (`DSparkWorker.draft`, after the host update). A request whose host update caps or
stops it is finished, so a running request's host count always equals the device count.

Eligible (decided on the host before the sync): GENERATION, greedy, a verify segment of q
rows (one of the verify widths; a launch takes one q: the step's), every slot from start to
start+q+S-1 owned (to start+q_max+q+S-1 for a continued segment, whose shift is at most the
widest q); at most the largest bucket. One graph per (bucket, q). Padding rows live in the scratch page
(start 0, verify row [0, -1, ..]: ctx' = 1, block 1..S, so q, S + 1 <= P). Inputs are staged
in one pinned host buffer and sent with one non-blocking copy; the shifts are gathered on the
device::

    io: [ starts (bucket) | block_tables (bucket x max_pages int32) ]

Without CUDA graphs (`capture=False`: the CPU, or graphs off) the same step runs directly on the
batch as it is (no padding rows, no scratch page).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata, host_ints
from ..models.dspark_regions import draft_addressing
from ..pyexecutor.kv_cache.resource_manager import KVCacheManager
from ..runtime.cuda_graph import GraphCache, GraphEntry, batch_buckets, check_graph_support
from ..runtime.llm_request import LlmRequest, RequestState
from ..runtime.step import DraftsAhead, VerifiedSegment
from ..runtime.token_rows import PendingTokens, TokenRow, gather_shifts

logger = logging.getLogger("tensorrt_llm")
_GENERATION = RequestState.GENERATION    # read per request per step (`takes`)


@dataclass
class DraftPlan:
    """Host-side inputs of a draft launch (B requests)."""

    bucket: int
    q: int                    # verify rows per request of this launch
    starts: np.ndarray        # [B] int64 first committed position (the anchor's), before any shift
    rows: np.ndarray          # [B] int64 rows of kv.page_table


@dataclass
class _DraftEntry(GraphEntry):
    """Persistent inputs of one batch bucket; outputs: [bucket, 2 + k_max] int64 (committed, anchor,
    draft ids)."""

    bucket: int = 0
    q: int = 0                                 # verify rows per request
    captured: Optional[torch.Tensor] = None    # [bucket*q, n*H] target dtype
    verified: Optional[torch.Tensor] = None    # [bucket, q] int64, -1 padded
    starts: Optional[torch.Tensor] = None      # [bucket] int64 (view of io)
    shift: Optional[torch.Tensor] = None       # [bucket] int64, gathered on the device
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
                 verify_widths: Sequence[int], num_drafts: int, buckets: Optional[Sequence[int]] = None,
                 capture: bool = True):
        """verify_widths: the verify segment lengths q a launch may have (one graph per bucket and q)."""
        cfg = drafter.config
        q_max = max(verify_widths)
        if not backend.capabilities.device_lengths:
            raise ValueError(f"the draft graph needs an attention backend that reads lengths on the device; "
                             f"{backend.name} plans on the host")
        if capture:
            check_graph_support(device, backend, max(q_max, cfg.block_size + 1), kv.tokens_per_block,
                                "the drafter's attention backend")
        elif max(q_max, cfg.block_size + 1) > kv.tokens_per_block:
            raise ValueError(f"the device draft step pads in one page: {max(q_max, cfg.block_size + 1)} "
                             f"tokens exceed tokens_per_block {kv.tokens_per_block}")
        if q_max > cfg.block_size + 1 or min(verify_widths) < 1:
            raise ValueError(f"verify widths {sorted(verify_widths)} outside [1, block_size + 1 = {cfg.block_size + 1}]")
        self.drafter, self.kv, self.backend = drafter, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.widths = frozenset(verify_widths)
        self.q_max = q_max
        self.block_size = cfg.block_size
        self.k_max = num_drafts
        self.mask_token_id = cfg.mask_token_id
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_batch_size)
        # padding rows (captured graphs only: a direct run takes the batch as it is) live in this page
        self.scratch_page = kv.scratch_page() if capture else BAD_PAGE_INDEX
        self.graphs: GraphCache[_DraftEntry] = GraphCache(device, capture)
        self.num_launches = 0
        self.num_drafted = 0             # requests drafted by the graph (the rest draft after the host update)

    # ---- eligibility ---------------------------------------------------------------------
    @staticmethod
    def takes(req: LlmRequest) -> bool:
        """A request the device draft step drafts for: generating, not finished, greedy."""
        return req.state is _GENERATION and req.sampling_params.greedy    # GENERATION: not finished

    def plan(self, items: Sequence[VerifiedSegment], counts: Sequence[int]) -> tuple[list[int], Optional[DraftPlan]]:
        """(indices of the items that can launch, in order; their `DraftPlan`), ([], None) when none
        can. counts[i]: tokens of item i's verify segment (captured rows)."""
        s = self.block_size
        cand = [i for i, (it, n) in enumerate(zip(items, counts)) if n in self.widths and self.takes(it.req)]
        if not cand:
            return [], None
        q = max(counts[i] for i in cand)        # one width per launch (a step verifies one draft length)
        cand = [i for i in cand if counts[i] == q]
        rids = [items[i].req.request_id for i in cand]
        starts = np.fromiter((items[i].start for i in cand), dtype=np.int64, count=len(cand))
        shifted = np.fromiter((items[i].start_shift is not None for i in cand), dtype=bool, count=len(cand))
        rows = self.kv.rows(rids)
        # context, then the furthest block (a continued segment starts up to q_max positions later)
        owned = self.kv.owns_span(rows, starts, np.where(shifted, self.q_max + q + s, q + s))
        ok = np.flatnonzero(owned)[:self.buckets[-1]]
        if not len(ok):
            return [], None
        bucket = next(x for x in self.buckets if x >= len(ok)) if self.graphs.capture else len(ok)
        return [cand[k] for k in ok.tolist()], DraftPlan(bucket, q, starts[ok], rows[ok])

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
        q, b = plan.q, len(group)
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
        entry = self.graphs.entry((plan.bucket, q), lambda: self._new_entry(plan.bucket, q, captured.shape[1],
                                                                             captured.dtype))
        self._load_inputs(entry, b, group_captured, group_verified, plan, [it.start_shift for it in group])
        if entry.graph is None and self.graphs.capture:
            logger.info("capturing draft CUDA graph for batch bucket %d (%d verify rows, block %d)",
                        entry.bucket, q, self.block_size)
        out = self.graphs.replay(entry, self._forward)
        self.num_launches += 1
        self.num_drafted += b
        return DraftsAhead({it.req.request_id: j for j, it in enumerate(group)}, PendingTokens(out[:b].clone()))

    @torch.inference_mode()
    def capture_all(self, dtype: torch.dtype) -> int:
        """Capture every (bucket, q) entry now, on padding rows (the engine calls it once at startup);
        dtype: the target's captured rows. Returns how many were captured (0 without CUDA graphs)."""
        width, none = self.drafter.config.fc_in_features, np.empty(0, dtype=np.int64)

        def stage(e: _DraftEntry) -> None:
            self._load_inputs(e, 0, e.captured[:0], e.verified[:0], DraftPlan(e.bucket, e.q, none, none), [])
        return sum(self.graphs.capture_ahead((b, q), lambda: self._new_entry(b, q, width, dtype), stage, self._forward)
                   for b in self.buckets for q in sorted(self.widths))

    def _io_views(self, buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts [bucket] int64, block_tables [bucket, max_pages] int32) views of an io buffer."""
        width = self.kv.max_blocks_per_seq
        table = buf[bucket:].view(torch.int32)[:bucket * width].view(bucket, width)
        return buf[:bucket], table

    def block_metadata(self, bucket: int, block_tables: torch.Tensor) -> AttentionMetadata:
        """The draft block's metadata over `block_tables` [bucket, max_pages] int32 (persistent);
        slot_mapping and kv_lens_device are written by `draft_rows`."""
        s, dev = self.block_size, self.device
        return AttentionMetadata(seq_lens=[s] * bucket, num_cached=[0] * bucket, block_tables=block_tables,
                                 slot_mapping=torch.zeros(bucket * s, dtype=torch.long, device=dev),
                                 tokens_per_block=self.kv.tokens_per_block, causal=False,
                                 kv_lens_device=torch.full((bucket,), s, dtype=torch.int32, device=dev))

    def prepare_block(self, md: AttentionMetadata, bucket: int, q: int, max_start: int) -> None:
        """Host-side step of a launch: the shape and a host bound on the device lengths (VANILLA masks
        over it); the backend checks only, the graph computes the lengths."""
        md.graph_shape = (bucket, self.block_size, self.kv.max_blocks_per_seq)
        md.kv_len_bound = max_start + self.q_max + q + self.block_size
        self.backend.prepare(md)

    def _new_entry(self, bucket: int, q: int, width: int, dtype: torch.dtype) -> _DraftEntry:
        dev = self.device
        words = bucket + -(-bucket * self.kv.max_blocks_per_seq // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        starts, table = self._io_views(io, bucket)
        table.fill_(BAD_PAGE_INDEX)
        verified = torch.full((bucket, q), -1, dtype=torch.long, device=dev)
        verified[:, 0] = 0
        return _DraftEntry(bucket=bucket, q=q, captured=torch.zeros(bucket * q, width, dtype=dtype, device=dev),
                           verified=verified, starts=starts, shift=torch.zeros(bucket, dtype=torch.long, device=dev),
                           md=self.block_metadata(bucket, table), io=io, host=host,
                           host_views=tuple(t.numpy() for t in self._io_views(host, bucket)))

    def _load_inputs(self, entry: _DraftEntry, b: int, captured: torch.Tensor, verified: torch.Tensor,
                     plan: DraftPlan, shifts: Sequence[Optional[TokenRow]]) -> None:
        """Stage the padded host inputs (one non-blocking copy) and the group's device rows.
        shifts[j]: request j's start shift (`VerifiedSegment.start_shift`) or None."""
        q, bucket, scratch = entry.q, entry.bucket, self.scratch_page
        if captured.shape[0] != b * q or verified.shape != (b, q):
            raise ValueError(f"draft group of {b} requests: captured {tuple(captured.shape)}, verified "
                             f"{tuple(verified.shape)} (q={q})")
        if entry.copied is not None:
            entry.copied.synchronize()     # the previous launch's copy has left the staging buffer
        starts, table = entry.host_views
        starts[:b] = plan.starts
        starts[b:] = 0
        np.take(self.kv.page_table, plan.rows, axis=0, out=table[:b])
        table[b:] = BAD_PAGE_INDEX
        table[b:, 0] = scratch
        entry.io.copy_(entry.host, non_blocking=True)
        if entry.io.is_cuda:
            if entry.copied is None:        # one event per entry, re-recorded by every copy
                entry.copied = torch.cuda.Event()
            entry.copied.record()
        gather_shifts(entry.shift, shifts)
        entry.captured[:b * q].copy_(captured)
        entry.verified[:b].copy_(verified)
        if b < bucket:                     # padding rows: one committed token, at position 0
            entry.verified[b:] = -1
            entry.verified[b:, 0] = 0
        self.prepare_block(entry.md, bucket, q, int(plan.starts.max(initial=0)))

    def _forward(self, entry: _DraftEntry) -> torch.Tensor:
        return self.draft_rows(entry.captured, entry.verified, entry.starts + entry.shift, entry.md)

    def draft_rows(self, captured: torch.Tensor, verified: torch.Tensor, start: torch.Tensor,
                   md: AttentionMetadata) -> torch.Tensor:
        """The draft step on the device (module doc), capturable: captured [B*q, n*H] target rows,
        verified [B, q] int64 (-1 padded), start [B] int64 first verified position, md from
        `block_metadata` -> [B, 2 + k_max] int64 rows [committed | anchor, drafts]."""
        d = self.drafter
        addressing = d.regions.draft_addressing if d.regions is not None else draft_addressing
        ctx_pos, ctx_slots, committed, anchors, blk_pos, blk_ids = addressing(
            start, verified, md.block_tables, self.kv.tokens_per_block, self.block_size, self.mask_token_id,
            md.slot_mapping, md.kv_lens_device)
        feats = d.context_features(captured)
        d.write_context(feats, ctx_pos.view(-1), ctx_slots, self.kv_caches, self.backend, slots_valid=True)
        hidden = d.forward_block(blk_ids.view(-1), blk_pos.view(-1), md, self.kv_caches, self.backend)
        ids = d.propose_greedy(hidden, anchors, self.k_max)
        return torch.cat([committed[:, None], anchors[:, None], ids], 1)

