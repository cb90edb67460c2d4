"""CUDA graphs for the generation segments of target steps (decode, verify).

A step replays when every segment has the same token count q (1 for decode, 1 + max_draft_len
for verify, one of `token_counts`), wants logits for all of them and writes only slots its
request owns, and the batch fits a bucket; any other step is the piecewise runner's
(`piecewise_graph_runner`). The batch is padded up to the bucket with padding requests that
live in one page the runner holds::

    rows: [ seg0: q tokens | seg1 | ... | segB-1 | pad | ... | pad ]     (bucket * q rows)
    pad:  positions 0..q-1, num_cached 0, block table [scratch, BAD, ...], slots in scratch

Per (bucket, q) a `TargetGraphEntry` owns the persistent inputs: input_ids, positions, and an
`AttentionMetadata` whose slot_mapping and block_tables are persistent device buffers.
A step copies its inputs into them, lets the backend plan outside the graph
(`backend.prepare(md)` with md.graph_shape) and replays. The first
step of a (bucket, q) runs once eagerly (warm-up: lazy state, and the backend plans its
fixed-address wrappers), is captured, then replayed. The engine captures every entry at startup
(`capture_all`, on padding rows only), so no serving step waits for a capture.

Host cost per step is kept to a few numpy gathers and one copy: all four inputs are views
of one device buffer, staged in one pinned host buffer of the same layout and copied with
one non-blocking copy (an event guards the staging buffer until the copy has left it). The
copy does not wait for the GPU, so a verify step is planned and staged while the previous
draft step still runs; drafts that are still on the device (`VerifyTokens`) are gathered
into the input ids behind it on the same stream (`gather_drafts`)::

    io: [ input_ids (n) | positions (n) | slot_mapping (n) | block_tables (bucket x max_pages int32) ]
        int64 words, n = bucket * q; the table's int32 rows are packed two per word
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import (BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata, device_positions,
                                           host_ints)
from ..runtime.cuda_graph import GraphCache, GraphEntry, batch_buckets, check_graph_support, fill_padded, flat_rows
from ..runtime.step import ForwardOutput
from ..runtime.token_rows import TokenRow, VerifyTokens, gather_into, gather_shifts
from .kv_cache.resource_manager import KVCacheManager

logger = logging.getLogger("tensorrt_llm")


def gather_drafts(dst: torch.Tensor, tokens: Sequence[VerifyTokens], rows: Sequence[int]) -> None:
    """dst [bucket, q] input ids on the device: row rows[n] columns 1.. <- tokens[n]'s drafts, read
    from their `PendingTokens` device tensors, queued behind the draft step that produced them."""
    drafts, k = [t.drafts for t in tokens], dst.shape[1] - 1
    for d in drafts:
        if d.k != k:
            raise ValueError(f"verify segment of {1 + d.k} tokens in a graph of {dst.shape[1]}")
    gather_into(dst[:, 1:], drafts, rows)


def gather_rows(dst: torch.Tensor, tokens: Sequence[TokenRow], rows: Sequence[int]) -> None:
    """dst [bucket, q] input ids on the device: row rows[n] <- tokens[n] (a whole segment still on the
    device, e.g. the overlap scheduler's previous token), queued behind the step that chose it."""
    q = dst.shape[1]
    for t in tokens:
        if t.k != q:
            raise ValueError(f"segment of {t.k} device tokens in a graph of {q}")
    gather_into(dst, tokens, rows)


def host_input_ids(dst: np.ndarray, segments) -> tuple[list[int], list[int]]:
    """dst [B, q] int64 (host) <- the segments' host-known tokens (a verify segment's anchor, host
    lists; 0 where a token is still on the device). Returns (rows whose drafts, rows whose whole
    segment, `device_input_ids` gathers on the device)."""
    lazy, rows, host = [], [], []
    for j, seg in enumerate(segments):
        t = seg.token_ids
        if isinstance(t, TokenRow):     # a continued segment (the steady state: checked first)
            rows.append(j)
        elif isinstance(t, VerifyTokens):
            lazy.append(j)
        else:
            host.append(j)
    if lazy or rows:     # one bulk fill, not a numpy write per row
        dst.fill(0)
    if lazy:
        dst[lazy, 0] = [segments[j].token_ids.anchor for j in lazy]
    if host:
        dst[host] = [segments[j].token_ids for j in host]
    return lazy, rows


def device_input_ids(dst: torch.Tensor, segments, lazy: Sequence[int], rows: Sequence[int]) -> None:
    """dst [bucket, q] input ids on the device (host part already copied): the device-resident
    drafts / segments of `host_input_ids`, gathered behind the steps that produced them."""
    if lazy:
        gather_drafts(dst, [segments[j].token_ids for j in lazy], lazy)
    if rows:
        gather_rows(dst, [segments[j].token_ids for j in rows], rows)


def stage_input_ids(dst: torch.Tensor, segments) -> None:
    """dst [B, q] int64 on the device <- the segments' tokens: host values in one pinned copy, then
    device-resident drafts and rows gathered there."""
    host = np.empty(tuple(dst.shape), dtype=np.int64)
    lazy, rows = host_input_ids(host, segments)
    dst.copy_(host_ints(host, dst.device).view(dst.shape))
    device_input_ids(dst, segments, lazy, rows)


class StepPlan(NamedTuple):
    """A graphable step: its bucket, tokens per request, and host-side addressing."""

    bucket: int
    q: int
    slots: np.ndarray       # [B, q] int64, every slot >= 0
    rows: np.ndarray        # [B] int64 rows of kv.page_table
    starts: np.ndarray      # [B] int64 first position of each segment (before any shift)
    shifted: bool = False   # some segment is continued (`ForwardSegment.start_shift`)

    @classmethod
    def padding_only(cls, bucket: int, q: int, shifted: bool = False) -> "StepPlan":
        """A step of padding rows only: what captures an entry before any real step needs it."""
        none = np.empty(0, dtype=np.int64)
        return cls(bucket, q, none.reshape(0, q), none, none, shifted)


@dataclass
class TargetGraphEntry(GraphEntry):
    """Persistent buffers of one (bucket, q); outputs: (logits [bucket * q, V] float32, captured
    [bucket * q, n*H] or None)."""

    bucket: int = 0
    q: int = 0
    # continued segments: start shifts [bucket] int64 gathered on the device; positions, slots and
    # md.kv_lens_device are then computed in the graph from positions[:, 0] + shift
    shift: Optional[torch.Tensor] = None
    input_ids: Optional[torch.Tensor] = None      # [bucket * q] int64, device (view of io)
    positions: Optional[torch.Tensor] = None      # [bucket * q] int64, device (view of io)
    md: Optional[AttentionMetadata] = None        # slot_mapping / block_tables: views of io
    io: Optional[torch.Tensor] = None             # [words] int64 device buffer (layout: module doc)
    host: Optional[torch.Tensor] = None           # [words] int64 CPU staging, pinned on CUDA
    host_views: tuple[np.ndarray, ...] = ()       # numpy views of host: ids, positions, slots, table
    copied: Optional[torch.cuda.Event] = None     # the last host -> io copy (staging buffer reuse)


def _io_views(buf: torch.Tensor, bucket: int, q: int, max_pages: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, positions, slot_mapping [bucket*q] int64, block_tables [bucket, max_pages] int32)."""
    n = bucket * q
    table = buf[3 * n:].view(torch.int32)[:bucket * max_pages].view(bucket, max_pages)
    return buf[:n], buf[n:2 * n], buf[2 * n:3 * n], table


class CUDAGraphRunner:
    """Captures and replays the target forward of generation segments per (batch bucket, q)."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 kv_caches: Sequence[torch.Tensor], device: torch.device, max_batch_size: int,
                 token_counts: Sequence[int] = (1,), capture_layer_ids: Sequence[int] = (),
                 buckets: Optional[Sequence[int]] = None, capture: bool = True):
        """capture=False: the same step runs directly on the batch as it is (no padding rows); the
        CPU's path for `SpecStepGraph`, which composes this runner's entries."""
        if capture:
            check_graph_support(device, backend, max(token_counts), kv.tokens_per_block, "attention backend")
        self.model, self.kv, self.backend = model, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.token_counts = frozenset(token_counts)
        self.capture_layer_ids = list(capture_layer_ids)
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_batch_size)
        # Padding requests write here; the page is held for the runner's lifetime (never hashed).
        self.scratch_page = kv.scratch_page() if capture else BAD_PAGE_INDEX
        self.graphs: GraphCache[TargetGraphEntry] = GraphCache(device, capture)
        self.num_declined = 0            # steps left to the piecewise / eager path

    # ---- eligibility ---------------------------------------------------------------------
    def _bucket(self, n: int) -> Optional[int]:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def plan(self, segments, extra: int = 0) -> Optional[StepPlan]:
        """The step's `StepPlan`, or None when it cannot replay: segments of different lengths or of
        an uncaptured length, a segment wanting fewer logits than tokens, a slot beyond a request's
        owned pages (also the `extra` slots after the furthest segment end: a draft block), or more
        requests than the largest bucket."""
        if not segments or len(segments) > self.buckets[-1]:
            return None
        q = len(segments[0].token_ids)
        if q not in self.token_counts:
            return None
        rids, starts, shifts = [], [], []
        for s in segments:     # one pass over the step's segments
            if len(s.token_ids) != q or s.num_logits != q:
                return None
            rids.append(s.request_id)
            starts.append(s.start)
            shifts.append(s.start_shift is not None)
        rows, starts, shifts = self.kv.rows(rids), np.array(starts, dtype=np.int64), np.array(shifts, dtype=bool)
        shifted = bool(shifts.any())
        # a continued segment starts up to the widest q positions later: all of those slots must be owned
        # (its own span only: a segment read on the host starts where the host says)
        if not self.kv.owns_span(rows, starts, shifts * max(self.token_counts) + q + extra).all():
            return None
        bucket = self._bucket(len(segments)) if self.graphs.capture else len(segments)
        return StepPlan(bucket, q, self.kv.owned_slots(rows, starts, q), rows, starts, shifted)

    # ---- run -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, segments) -> Optional[ForwardOutput]:
        """Replay the step (logits [B*q, V] float32, captured [B*q, n*H] or None; segment i's rows
        start at i*q), or None when it cannot replay (`plan`)."""
        plan = self.plan(segments)
        if plan is None:
            self.num_declined += 1
            return None
        bucket, q = plan.bucket, plan.q
        entry = self.graphs.entry((bucket, q, plan.shifted), lambda: self.new_entry(bucket, q, plan.shifted))
        self.load_inputs(entry, segments, plan)
        if entry.graph is None and self.graphs.capture:
            logger.info("capturing CUDA graph for batch bucket %d x %d tokens%s", bucket, q,
                        " (continued segments)" if plan.shifted else "")
        logits, captured = self.graphs.replay(entry, self.forward)
        n = len(segments) * q
        cap = captured[:n].clone() if captured is not None else None
        offsets = list(range(0, n, q))
        return ForwardOutput(logits[:n].clone(), offsets, cap, offsets)

    @torch.inference_mode()
    def capture_all(self, continued: bool) -> int:
        """Capture every (bucket, q) entry now, on padding rows, so that no step waits for a capture
        (the engine calls it once at startup); continued: the continued-segment entries too.
        Returns how many were captured (0 without CUDA graphs)."""
        keys = [(b, q, s) for b in self.buckets for q in sorted(self.token_counts)
                for s in ((False, True) if continued else (False,))]
        return sum(self.graphs.capture_ahead(
            (b, q, s), lambda: self.new_entry(b, q, s),
            lambda e: self.load_inputs(e, [], StepPlan.padding_only(b, q, s)), self.forward) for b, q, s in keys)

    def new_entry(self, bucket: int, q: int, shifted: bool = False) -> TargetGraphEntry:
        dev, max_pages = self.device, self.kv.max_blocks_per_seq
        words = 3 * bucket * q + -(-bucket * max_pages // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        ids, pos, slots, table = _io_views(io, bucket, q, max_pages)
        table.fill_(BAD_PAGE_INDEX)
        md = AttentionMetadata(seq_lens=[q] * bucket, num_cached=[0] * bucket, block_tables=table,
                               slot_mapping=slots, tokens_per_block=self.kv.tokens_per_block, causal=True)
        if shifted:
            md.kv_lens_device = torch.zeros(bucket, dtype=torch.int32, device=dev)
        views = tuple(t.numpy() for t in _io_views(host, bucket, q, max_pages))
        return TargetGraphEntry(bucket=bucket, q=q, input_ids=ids, positions=pos, md=md, io=io, host=host,
                           host_views=views,
                           shift=torch.zeros(bucket, dtype=torch.long, device=dev) if shifted else None)

    def load_inputs(self, entry: TargetGraphEntry, segments, plan: StepPlan) -> None:
        """Stage the step's padded inputs in entry.host, copy them to entry.io in one copy, prepare.
        Drafts still on the device (`VerifyTokens`) are gathered into the input ids there."""
        b, q, bucket = len(segments), entry.q, entry.bucket
        p, max_pages = self.kv.tokens_per_block, self.kv.max_blocks_per_seq
        if entry.copied is not None:
            entry.copied.synchronize()     # the previous step's copy has left the staging buffer
        ids, pos, slot, table = entry.host_views
        if not any(isinstance(s.token_ids, (VerifyTokens, TokenRow)) for s in segments):
            ids[:b * q] = flat_rows([s.token_ids for s in segments], b * q, "token_ids")
            lazy, rows = [], []
        else:     # device-resident tokens are gathered on the device after the copy
            lazy, rows = host_input_ids(ids[:b * q].reshape(b, q), segments)
        slot[:b * q] = plan.slots.reshape(-1)
        fill_padded(pos, slot, plan.starts, b, bucket, q, self.scratch_page, p)
        np.take(self.kv.page_table, plan.rows, axis=0, out=table[:b])
        if b < bucket:
            ids[b * q:] = 0
            table[b:] = BAD_PAGE_INDEX
            table[b:, 0] = self.scratch_page
        entry.io.copy_(entry.host, non_blocking=True)
        if entry.io.is_cuda:
            if entry.copied is None:        # one event per entry, re-recorded by every copy
                entry.copied = torch.cuda.Event()
            entry.copied.record()
        device_input_ids(entry.input_ids.view(bucket, q), segments, lazy, rows)
        if entry.shift is not None:
            gather_shifts(entry.shift, [s.start_shift for s in segments])
        md = entry.md
        md.num_cached = plan.starts.tolist() + [0] * (bucket - b)
        md.graph_shape = (bucket, q, max_pages)
        if entry.shift is not None:   # a host bound on the device lengths (VANILLA masks over it)
            md.kv_len_bound = int(plan.starts.max(initial=0)) + max(self.token_counts) + q
        self.backend.prepare(md)

    def forward(self, entry: TargetGraphEntry,
                float_logits: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The entry's step -> (logits [bucket * q, V]: float32, or the lm_head's dtype with
        float_logits=False; the captured rows [bucket * q, n * H] or None)."""
        positions, md = entry.positions, entry.md
        if entry.shift is not None:     # continued segments: addressing from the device-side starts
            start = positions.view(entry.bucket, entry.q)[:, 0] + entry.shift
            pos, slots = device_positions(start, entry.q, md.block_tables, self.kv.tokens_per_block)
            md.slot_mapping.copy_(slots)
            md.kv_lens_device.copy_(start + entry.q)
            positions = pos.view(-1)
        hidden, captured = self.model(entry.input_ids, positions, self.kv_caches, md,
                                      self.backend, self.capture_layer_ids)
        logits = self.model.compute_logits(hidden, float32=float_logits)
        return logits, (torch.cat(captured, dim=-1) if captured else None)
