"""Packed-step CUDA graphs: any step (prompt chunks mixed with decode / verify segments) as ONE
graph, on an attention backend that reads query offsets and KV lengths on the device (TRITON).

The piecewise graphs (`piecewise_graph_runner.py`) replay the token-wise work and launch each
layer's attention eagerly: per step L attention launches with their host-side checks and L + 1
graph launches, ~0.1 ms of host time per layer, while every running request waits (a DSpark
arrival step on the H200 spent ~15-19 ms, most of it on the host). A backend declaring
`ragged_graphs` takes attention into the graph: nothing in it depends on a host value of the step,
only on device tensors staged with one copy. Per token bucket T, one graph over R = min(T,
max_requests) request rows::

    io (int64 words): [ input_ids (T) | positions (T) | slot_mapping (T) | draft_slots (T) |
                        shift_index (T) | shifts (R + 1) |
                        int32: kv_lens (R) | qo_indptr (R + 1) | block_tables (R x W) ]

    real segments    : rows 0..n-1 packed in step order (request b: qo_indptr[b]..qo_indptr[b+1]-1)
    padding requests : rows B..R-1: no query rows (qo_indptr = n), KV length 0, table [scratch, -1..]
    padding tokens   : rows n..T-1: position 0, slots in the scratch page (written, never read)
    continued        : a generation segment whose start lies on the device (`start_shift`, the
                       overlap scheduler's DSpark step beside prompt chunks): shifts[b] is gathered
                       from the step in flight's rows; its tokens' shift_index is b, every other
                       token's R (shifts[R] = 0); the graph moves their positions, slots and the
                       request's KV length by it (`shift_tokens`; a runner without a drafter,
                       max_shift 0, declines such steps and leaves the shift out of its graphs)

The forward is the model's own (`model(...)`, attention inside): hidden [T, H] and the captured
rows [T, c*H] are the graph's outputs; the logits of the wanted rows are computed after it. With a
drafter that writes context inside the forward (`context`, `Drafter.write_forward_context`) the
graph also writes the draft context of the step's leading prompt chunks from their captured rows,
at their target slots (the pools share page ids); every other row writes into the scratch page
(`draft_slots`), so a prompt step needs no eager context write on the host. A
step with a slot beyond its request's pages (written as -1: skipped) or more tokens than the
largest bucket is declined (the engine runs it another way). Without CUDA graphs (`capture=False`)
the same staging runs the forward directly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata
from ..runtime.cuda_graph import GraphCache, GraphEntry
from ..runtime.step import ForwardOutput, ForwardSegment
from ..runtime.token_rows import gather_shifts
from ..speculative.interface import Drafter
from .kv_cache.resource_manager import KVCacheManager
from .piecewise_graph_runner import STARTUP_CAPTURE_TOKENS, pack_segments, segment_lengths, token_buckets

logger = logging.getLogger("tensorrt_llm")


@dataclass
class _PackedEntry(GraphEntry):
    """Persistent inputs of one token bucket (views of `io`, layout in the module doc) and their
    pinned host staging; outputs (hidden [T, H], captured [T, c*H] or None)."""

    tokens: int = 0
    requests: int = 0
    io: Optional[torch.Tensor] = None            # [words] int64 on the device
    host: Optional[torch.Tensor] = None          # [words] int64 staging, pinned on CUDA
    host_views: tuple[np.ndarray, ...] = ()      # numpy views of host, in io order
    md: Optional[AttentionMetadata] = None
    shifts: Optional[torch.Tensor] = None        # [R + 1] int64 view of io: continued segments' start shifts
    copied: Optional[torch.cuda.Event] = None    # the last host -> io copy (staging buffer reuse)


class PackedGraphRunner:
    """Replays a target forward over any packed segments as one captured graph per token bucket."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 kv_caches: Sequence[torch.Tensor], device: torch.device, max_tokens: int, max_requests: int,
                 capture_layer_ids: Sequence[int] = (), capture: bool = True, max_shift: int = 0):
        """max_shift: the most positions a continued segment starts late (the widest verify segment); 0:
        no step has continued segments (no drafter), and the graphs leave the shift out."""
        if not (backend.capabilities.ragged_graphs and backend.capabilities.device_lengths):
            raise ValueError(f"packed-step graphs need an attention backend with device query offsets and "
                             f"lengths (ragged_graphs); {backend.name} has none")
        self.model, self.kv, self.backend = model, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.capture_layer_ids = list(capture_layer_ids)
        self.buckets = token_buckets(max_tokens)
        self.max_requests = max_requests
        self.max_shift = max_shift
        self.scratch_page = kv.scratch_page()
        self.graphs: GraphCache[_PackedEntry] = GraphCache(device, capture)
        self.num_steps = 0
        self.num_declined = 0
        # writes the prompt chunks' draft context inside the graph; set before any capture
        self.context: Optional[Drafter] = None

    def bucket_for(self, n: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def run(self, segments: Sequence[ForwardSegment], prompt_segments: int = 0) -> Optional[ForwardOutput]:
        """The forward of `segments` packed in step order, or None when this runner declines the step
        (more tokens than the largest bucket, a slot beyond a request's pages, or a continued
        segment's furthest shifted slot beyond them). The first `prompt_segments` are prompt chunks:
        with `context` set, their draft context is written too (`ForwardOutput.context_segments`)."""
        lens = segment_lengths(segments)
        n, b = sum(lens), len(segments)
        t = self.bucket_for(n)
        if t is None or b > self.max_requests:
            self.num_declined += 1
            return None
        kv = self.kv
        rows = kv.rows([s.request_id for s in segments])
        starts = np.fromiter((s.start for s in segments), dtype=np.int64, count=b)
        _, slots = kv.packed_slots(rows, starts, lens)
        shifts = [s.start_shift for s in segments]
        shifted = np.fromiter((sh is not None for sh in shifts), dtype=bool, count=b)
        if (slots < 0).any() or (shifted.any() and (not self.max_shift or not kv.owns_span(
                rows[shifted], starts[shifted], np.asarray(lens)[shifted] + self.max_shift).all())):
            self.num_declined += 1
            return None
        e = self.graphs.entry(t, lambda: self._new_entry(t))
        if e.copied is not None:
            e.copied.synchronize()     # the previous step of this bucket has left the staging buffer
        ids, pos, slot, dslot, shift_index, _, lens_v, qo, table = e.host_views
        packed = pack_segments(segments, lens, ids, pos)
        slot[:n] = slots
        self._pad_rows(e, n)
        if shifted.any():
            shift_index[:n] = shifted_token_rows(shifted, lens, e.requests)
        prompt_rows = sum(lens[:prompt_segments]) if self.context is not None else 0
        dslot[:prompt_rows] = slots[:prompt_rows]
        lens_v[:b] = starts + np.asarray(lens, dtype=np.int64)
        lens_v[b:] = 0
        qo[0] = 0
        np.cumsum(lens, out=qo[1:b + 1])
        qo[b + 1:] = n
        np.take(kv.page_table, rows, axis=0, out=table[:b])
        e.io.copy_(e.host, non_blocking=True)
        packed.gather_device_tokens(e.io[:t])          # queued behind the steps that made them
        if shifted.any():
            gather_shifts(e.shifts, shifts)
        if e.io.is_cuda:
            if e.copied is None:          # one event per entry, re-recorded by every copy
                e.copied = torch.cuda.Event()
            e.copied.record()
        hidden, captured = self.graphs.replay(e, self._forward)
        self.num_steps += 1
        out = packed.output(self.model, hidden[:n], captured[:n] if captured is not None else None)
        out.context_segments = prompt_segments if self.context is not None else 0
        return out

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every token bucket up to `STARTUP_CAPTURE_TOKENS` now, on padding rows only (the engine
        calls it once at startup; larger buckets at their first step). Returns how many were captured."""
        def stage(e: _PackedEntry) -> None:
            ids, pos, _, _, _, _, lens_v, qo, _ = e.host_views
            ids[:] = 0
            pos[:] = 0
            self._pad_rows(e, 0)
            lens_v[:] = 0
            qo[:] = 0
            e.io.copy_(e.host)
        return sum(self.graphs.capture_ahead(t, lambda: self._new_entry(t), stage, self._forward)
                   for t in self.buckets if t <= STARTUP_CAPTURE_TOKENS)

    def _pad_rows(self, e: _PackedEntry, n: int) -> None:
        """Padding tokens n..T-1 write into the scratch page, and every row's draft context (the
        caller then points the prompt rows at their slots); padding requests own only it (their rows
        are rewritten over the real ones' by the next step's staging); no token is shifted."""
        _, _, slot, dslot, shift_index, shifts, _, _, table = e.host_views
        shift_index[:] = e.requests
        shifts[:] = 0
        p = self.kv.tokens_per_block
        scratch = self.scratch_page * p + np.arange(e.tokens, dtype=np.int64) % p
        slot[n:] = scratch[n:]
        dslot[:] = scratch
        table[:] = BAD_PAGE_INDEX
        table[:, 0] = self.scratch_page

    def _new_entry(self, t: int) -> _PackedEntry:
        r, width, dev = min(t, self.max_requests), self.kv.max_blocks_per_seq, self.device
        n32 = r + (r + 1) + r * width                     # int32 values after the 5T + R + 1 int64 words
        words = 5 * t + r + 1 + -(-n32 // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        dv, hv = packed_io_views(io, t, r, width), packed_io_views(host, t, r, width)
        md = AttentionMetadata(seq_lens=[0] * r, num_cached=[0] * r, block_tables=dv[8], slot_mapping=dv[2],
                               tokens_per_block=self.kv.tokens_per_block, causal=True, kv_lens_device=dv[6],
                               kv_len_bound=width * self.kv.tokens_per_block, qo_indptr_device=dv[7],
                               max_q_bound=t, slots_all_valid=True)
        self.backend.prepare(md)
        if self.graphs.capture:
            logger.info("capturing the packed-step CUDA graph for %d tokens (%d request rows)", t, r)
        return _PackedEntry(tokens=t, requests=r, io=io, host=host, md=md, shifts=dv[5],
                            host_views=tuple(v.numpy() for v in hv))

    def _forward(self, e: _PackedEntry) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = e.tokens
        _, pos, slot, _, shift_index, shifts, kv_lens, _, table = packed_io_views(e.io, t, e.requests,
                                                                                  self.kv.max_blocks_per_seq)
        if self.max_shift:
            shift_tokens(pos, slot, kv_lens, shift_index, shifts, table, self.kv.tokens_per_block)
        ids = e.io[:t]
        hidden, captured = self.model(ids, pos, self.kv_caches, e.md, self.backend, self.capture_layer_ids)
        cap = torch.cat(captured, dim=-1) if captured else None
        if self.context is not None and cap is not None:
            self.context.write_forward_context(cap, pos, e.io[3 * t:4 * t])
        return hidden, cap


def packed_io_views(buf: torch.Tensor, t: int, r: int, width: int) -> tuple[torch.Tensor, ...]:
    """(input_ids [T], positions [T], slot_mapping [T], draft_slots [T], shift_index [T], shifts [R + 1]
    int64; kv_lens [R], qo_indptr [R + 1], block_tables [R, W] int32) views of an io buffer (layout: the
    module doc; words after these are the caller's)."""
    i32 = buf[5 * t + r + 1:].view(torch.int32)
    return (buf[:t], buf[t:2 * t], buf[2 * t:3 * t], buf[3 * t:4 * t], buf[4 * t:5 * t], buf[5 * t:5 * t + r + 1],
            i32[:r], i32[r:2 * r + 1], i32[2 * r + 1:2 * r + 1 + r * width].view(r, width))


def shifted_token_rows(shifted: np.ndarray, lens: Sequence[int], none: int) -> np.ndarray:
    """[sum(lens)] int64: each packed token's segment where that segment is continued (shifted [B] bool),
    else `none` (the index of the always-zero shift)."""
    return np.where(np.repeat(shifted, lens), np.repeat(np.arange(len(lens)), lens), none)


def shift_tokens(positions: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, shift_index: torch.Tensor,
                 shifts: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> None:
    """Move the tokens of continued segments to where they really start, in place and on the device.

    positions, slots [T] int64 (host-staged: the segments' host starts); kv_lens [R] int32;
    shift_index [T] int64: token t belongs to continued segment shift_index[t] < R, or to none (R);
    shifts [R + 1] int64 (shifts[R] = 0); block_tables [R, W] int32. A moved token's slot is looked
    up at its new position (-1 past the table or on an unallocated page: the writes skip it)."""
    r, w = block_tables.shape
    sh = shifts[shift_index]
    positions.add_(sh)
    kv_lens.add_(shifts[:r].to(kv_lens.dtype))
    col = positions // page_size
    pages = block_tables.long()[shift_index.clamp(max=r - 1), col.clamp(max=w - 1)]
    moved = torch.where((pages >= 0) & (col < w), pages * page_size + positions % page_size, -1)
    slots.copy_(torch.where(sh != 0, moved, slots))
