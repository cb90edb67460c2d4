"""CUDA graphs for the generation segments of target steps (decode, verify).

A segment is graphable when its token count is q (1 for decode, 1 + max_draft_len for
verify, one of `token_counts`), it wants logits for all of them and writes only slots its
request owns. When every segment of a step is graphable and the batch fits a bucket the
whole step replays; otherwise the graphable segments of the most common q (at most the
largest bucket) replay and `ModelEngine` runs the rest eagerly and stitches the outputs
(`step_split`). The graph group is padded up to the bucket with padding requests that
live in one page the runner holds::

    rows: [ seg0: q tokens | seg1 | ... | segB-1 | pad | ... | pad ]     (bucket * q rows)
    pad:  positions 0..q-1, num_cached 0, block table [scratch, BAD, ...], slots in scratch

Per (bucket, q) a `_GraphEntry` owns the persistent inputs: input_ids, positions, and an
`AttentionMetadata` whose slot_mapping and block_tables are persistent device buffers.
A step copies its inputs into them, lets the backend plan outside the graph
(`backend.prepare(md)` with md.graph_shape) and replays. The first
step of a (bucket, q) runs once eagerly (warm-up: lazy state, and the backend plans its
fixed-address wrappers), is captured, then replayed. Anything else runs eagerly.

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

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata
from ..runtime.token_rows import VerifyTokens
from .kv_cache.resource_manager import KVCacheManager
from ..runtime.sampler import host_ints
from .step_split import graph_candidates

logger = logging.getLogger("tensorrt_llm")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_buckets(max_batch_size: int, candidates: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[int]:
    """Capture sizes: candidates below max_batch_size, plus max_batch_size (capped at the largest)."""
    top = min(max_batch_size, max(candidates))
    return sorted({c for c in candidates if c < top} | {top})


def check_graph_support(device: torch.device, backend: AttentionBackend, tokens_per_request: int,
                        page_size: int, role: str) -> None:
    """ValueError unless graphs can run: CUDA, a backend declaring cuda_graphs, and padding
    requests (`tokens_per_request` tokens each) fitting in one scratch page."""
    if device.type != "cuda":
        raise ValueError(f"use_cuda_graph needs a CUDA device, got {device}")
    if not backend.capabilities.cuda_graphs:
        raise ValueError(f"use_cuda_graph: {role} {backend.name} does not support CUDA graphs "
                         "(choose attn_backend='FLASHINFER' or use_cuda_graph=False)")
    if tokens_per_request > page_size:
        raise ValueError(f"use_cuda_graph: {tokens_per_request} tokens per request exceed one page "
                         f"({page_size} tokens), which padding requests must fit in")


def capture_graph(fn: Callable[[], Any], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `fn` up once on a side stream (torch's rule; it also lets backends plan their
    fixed-address wrappers, so nothing is planned inside the capture), then capture it.

    Returns (graph, the captured call's outputs: persistent tensors that each replay refills).
    """
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        fn()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


@dataclass
class GraphInputs:
    """Host-side inputs of one padded graph step (all CPU tensors)."""

    input_ids: torch.Tensor     # [bucket * q] int64
    positions: torch.Tensor     # [bucket * q] int64
    slot_mapping: torch.Tensor  # [bucket * q] int64, every slot >= 0
    block_tables: torch.Tensor  # [bucket, max_pages] int32, BAD_PAGE_INDEX when unallocated
    num_cached: list[int]       # [bucket]


def pack_graph_inputs(token_ids: Sequence[Sequence[int]], starts: Sequence[int],
                      slots: Sequence[Sequence[int]], block_tables: torch.Tensor, bucket: int,
                      q: int, max_pages: int, scratch_page: int, page_size: int) -> GraphInputs:
    """Pad B real segments (q tokens each) to `bucket` requests.

    token_ids, slots: [B][q] (lists or an array); block_tables: [B, w] int32 CPU (w <= max_pages).
    Padding requests attend over their own q tokens at positions 0..q-1 in `scratch_page`;
    their outputs are discarded.
    """
    b = len(token_ids)
    if not 0 < b <= bucket or q > page_size:
        raise ValueError(f"cannot pad {b} requests of {q} tokens to bucket {bucket} (page {page_size})")
    n, used = bucket * q, b * q
    ids = np.zeros(n, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    slot = np.empty(n, dtype=np.int64)
    ids[:used] = _flat(token_ids, used, "token_ids")
    slot[:used] = _flat(slots, used, "slots")
    _fill_padded(pos, slot, np.asarray(starts, dtype=np.int64), b, bucket, q, scratch_page, page_size)
    bt = torch.full((bucket, max_pages), BAD_PAGE_INDEX, dtype=torch.int32)
    bt[:b, :block_tables.shape[1]] = block_tables
    bt[b:, 0] = scratch_page
    return GraphInputs(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(slot), bt,
                       list(starts) + [0] * (bucket - b))


def _flat(rows: Sequence[Sequence[int]] | np.ndarray, count: int, what: str) -> np.ndarray:
    """[B][q] -> [B*q] int64, ValueError unless there are exactly `count` values."""
    if isinstance(rows, np.ndarray):
        out = rows.reshape(-1)
    else:
        out = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
    if out.shape[0] != count:
        raise ValueError(f"{what}: {out.shape[0]} values for {count} rows (every segment needs q tokens)")
    return out


def _fill_padded(pos: np.ndarray, slot: np.ndarray, starts: np.ndarray, b: int, bucket: int, q: int,
                 scratch_page: int, page_size: int) -> None:
    """positions of B real segments (starts[b] + 0..q-1) and the padding rows' positions / slots."""
    used = b * q
    if q == 1:
        pos[:used] = starts
    else:
        pos[:used].reshape(b, q)[:] = starts.reshape(-1, 1) + np.arange(q, dtype=np.int64)
    if b < bucket:
        ar = np.arange(q, dtype=np.int64)
        pos[used:].reshape(bucket - b, q)[:] = ar
        slot[used:].reshape(bucket - b, q)[:] = scratch_page * page_size + ar


def gather_drafts(dst: torch.Tensor, tokens: Sequence[VerifyTokens], rows: Sequence[int]) -> None:
    """dst [bucket, q] input ids on the device: row rows[n] columns 1.. <- tokens[n]'s drafts, read
    from their `PendingDrafts` device tensors (one copy per source when the rows are
    consecutive, else one gather), queued behind the draft step that produced them."""
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    for j, t in zip(rows, tokens):
        if len(t) != dst.shape[1]:
            raise ValueError(f"verify segment of {len(t)} tokens in a graph of {dst.shape[1]}")
        pend = t.drafts.pending
        g = groups.setdefault(id(pend), (pend, [], []))
        g[1].append(j)
        g[2].append(t.drafts.index)
    k = dst.shape[1] - 1
    for pend, js, src in groups.values():
        n = len(js)
        if js == list(range(js[0], js[0] + n)) and src == list(range(src[0], src[0] + n)):
            dst[js[0]:js[0] + n, 1:].copy_(pend.device[src[0]:src[0] + n, :k])
        else:
            dev = dst.device
            dst[:, 1:].index_copy_(0, host_ints(js, dev), pend.device.index_select(0, host_ints(src, dev))[:, :k])


class StepPlan(NamedTuple):
    """A graphable step: its bucket, tokens per request, and host-side addressing."""

    bucket: int
    q: int
    slots: np.ndarray       # [B, q] int64, every slot >= 0
    rows: np.ndarray        # [B] int64 rows of kv.page_table
    starts: np.ndarray      # [B] int64 first position of each segment


class GraphRun(NamedTuple):
    """The replayed part of a step: which segments, and their outputs (q rows each, in order)."""

    indices: list[int]                  # [G] segment indices in step order
    q: int
    logits: torch.Tensor                # [G*q, V] float32
    captured: Optional[torch.Tensor]    # [G*q, n*H] or None


@dataclass
class _GraphEntry:
    """Persistent buffers and the captured graph of one (bucket, q)."""

    bucket: int
    q: int
    input_ids: torch.Tensor                     # [bucket * q] int64, device (view of io)
    positions: torch.Tensor                     # [bucket * q] int64, device (view of io)
    md: AttentionMetadata                       # slot_mapping / block_tables: views of io
    io: torch.Tensor                            # [words] int64 device buffer (layout: module doc)
    host: torch.Tensor                          # [words] int64 CPU staging, pinned on CUDA
    host_views: tuple[np.ndarray, ...]          # numpy views of host: ids, positions, slots, table
    copied: Optional[torch.cuda.Event] = None   # the last host -> io copy (staging buffer reuse)
    graph: Optional[torch.cuda.CUDAGraph] = None
    logits: Optional[torch.Tensor] = None       # [bucket * q, V] float32 (graph output)
    captured: Optional[torch.Tensor] = None     # [bucket * q, n*H] (graph output) or None
    replays: int = field(default=0)


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
                 buckets: Optional[Sequence[int]] = None):
        check_graph_support(device, backend, max(token_counts), kv.tokens_per_block, "attention backend")
        self.model, self.kv, self.backend = model, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.token_counts = frozenset(token_counts)
        self.capture_layer_ids = list(capture_layer_ids)
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_batch_size)
        # Padding requests write here; the page is held for the runner's lifetime (never hashed).
        self.scratch_page = kv.scratch_page()
        self._entries: dict[tuple[int, int], _GraphEntry] = {}
        self._pool = None
        self.num_captures = 0
        self.num_replays = 0
        self.num_eager_fallbacks = 0     # steps run wholly eagerly
        self.num_split_steps = 0         # steps whose graph group replayed next to an eager rest

    # ---- eligibility ---------------------------------------------------------------------
    def _bucket(self, n: int) -> Optional[int]:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def plan_group(self, segments) -> Optional[tuple[list[int], StepPlan]]:
        """(indices of the segments that can replay, in step order; their `StepPlan`), or None
        when none can. Segments of another shape, with a slot beyond their owned pages, or
        beyond the largest bucket are left out (they run eagerly)."""
        if not segments:
            return None
        q = len(segments[0].token_ids)
        if q in self.token_counts and all(len(s.token_ids) == q == s.num_logits for s in segments):
            idx = list(range(len(segments)))     # the common case: one shape (host cost per step)
        else:
            q, idx = graph_candidates([(len(s.token_ids), s.num_logits) for s in segments], self.token_counts)
            if not idx:
                return None
        group = segments if len(idx) == len(segments) else [segments[i] for i in idx]
        rids = [s.request_id for s in group]
        rows = self.kv.rows(rids)
        starts = np.fromiter((s.start for s in group), dtype=np.int64, count=len(idx))
        slots = self.kv.slots_batch(rids, starts, q, rows=rows)
        owned = (slots >= 0).all(axis=1)
        if len(idx) > self.buckets[-1] or not owned.all():
            # a write beyond owned pages: eager skips it; beyond the largest bucket: eager
            keep = np.flatnonzero(owned)[:self.buckets[-1]]
            if keep.shape[0] == 0:
                return None
            idx = [idx[k] for k in keep.tolist()]
            slots, rows, starts = slots[keep], rows[keep], starts[keep]
        return idx, StepPlan(self._bucket(len(idx)), q, slots, rows, starts)

    def plan_step(self, segments) -> Optional[StepPlan]:
        """A `StepPlan` (bucket, q, slots [B, q], ...) when the whole step can replay a graph, else None."""
        group = self.plan_group(segments)
        return group[1] if group is not None and len(group[0]) == len(segments) else None

    # ---- run -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, segments) -> Optional[GraphRun]:
        """Replay the graphable segments of a step (all of them, or a split step's graph group).

        Returns a `GraphRun` (indices, q, logits [G*q, V] float32, captured [G*q, n*H] or None),
        or None when no segment can replay (the whole step runs eagerly).
        """
        group = self.plan_group(segments)
        if group is None:
            self.num_eager_fallbacks += 1
            return None
        idx, plan = group
        if len(idx) < len(segments):
            self.num_split_steps += 1
            segments = [segments[i] for i in idx]
        bucket, q = plan.bucket, plan.q
        entry = self._entries.get((bucket, q))
        if entry is None:
            entry = self._new_entry(bucket, q)
            self._entries[(bucket, q)] = entry
        self._load_inputs(entry, segments, plan)
        if entry.graph is None:
            self._capture(entry)
        entry.graph.replay()
        entry.replays += 1
        self.num_replays += 1
        n = len(segments) * q
        cap = entry.captured[:n].clone() if entry.captured is not None else None
        return GraphRun(idx, q, entry.logits[:n].clone(), cap)

    def _new_entry(self, bucket: int, q: int) -> _GraphEntry:
        dev, max_pages = self.device, self.kv.max_blocks_per_seq
        words = 3 * bucket * q + -(-bucket * max_pages // 2)
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        ids, pos, slots, table = _io_views(io, bucket, q, max_pages)
        table.fill_(BAD_PAGE_INDEX)
        md = AttentionMetadata(seq_lens=[q] * bucket, num_cached=[0] * bucket, block_tables=table,
                               slot_mapping=slots, tokens_per_block=self.kv.tokens_per_block, causal=True)
        views = tuple(t.numpy() for t in _io_views(host, bucket, q, max_pages))
        return _GraphEntry(bucket, q, ids, pos, md, io, host, views)

    def _load_inputs(self, entry: _GraphEntry, segments, plan: StepPlan) -> None:
        """Stage the step's padded inputs in entry.host, copy them to entry.io in one copy, prepare.
        Drafts still on the device (`VerifyTokens`) are gathered into the input ids there."""
        b, q, bucket = len(segments), entry.q, entry.bucket
        p, max_pages = self.kv.tokens_per_block, self.kv.max_blocks_per_seq
        if entry.copied is not None:
            entry.copied.synchronize()     # the previous step's copy has left the staging buffer
        ids, pos, slot, table = entry.host_views
        lazy = [j for j, s in enumerate(segments) if isinstance(s.token_ids, VerifyTokens)]
        if lazy:
            # anchors from the host, draft columns zero (gathered on the device below); segments
            # whose drafts are host lists are written whole
            tok = ids[:b * q].reshape(b, q)
            tok[:, 1:] = 0
            tok[:, 0] = [s.token_ids[0] if not isinstance(s.token_ids, VerifyTokens) else s.token_ids.anchor
                         for s in segments]
            if len(lazy) < b:
                for j in sorted(set(range(b)) - set(lazy)):
                    tok[j] = segments[j].token_ids
        else:
            ids[:b * q] = _flat([s.token_ids for s in segments], b * q, "token_ids")
        slot[:b * q] = plan.slots.reshape(-1)
        _fill_padded(pos, slot, plan.starts, b, bucket, q, self.scratch_page, p)
        np.take(self.kv.page_table, plan.rows, axis=0, out=table[:b])
        if b < bucket:
            ids[b * q:] = 0
            table[b:] = BAD_PAGE_INDEX
            table[b:, 0] = self.scratch_page
        entry.io.copy_(entry.host, non_blocking=True)
        if entry.io.is_cuda:
            entry.copied = torch.cuda.Event()
            entry.copied.record()
        if lazy:
            gather_drafts(entry.input_ids.view(bucket, q), [segments[j].token_ids for j in lazy], lazy)
        md = entry.md
        md.num_cached = plan.starts.tolist() + [0] * (bucket - b)
        md.graph_shape = (bucket, q, max_pages)
        self.backend.prepare(md)

    def _forward(self, entry: _GraphEntry) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        hidden, captured = self.model(entry.input_ids, entry.positions, self.kv_caches, entry.md,
                                      self.backend, self.capture_layer_ids)
        logits = self.model.compute_logits(hidden)
        return logits, (torch.cat(captured, dim=-1) if captured else None)

    def _capture(self, entry: _GraphEntry) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        entry.graph, (entry.logits, entry.captured) = capture_graph(lambda: self._forward(entry),
                                                                    self.device, self._pool)
        self.num_captures += 1
        logger.info("captured CUDA graph for batch bucket %d x %d tokens", entry.bucket, entry.q)
