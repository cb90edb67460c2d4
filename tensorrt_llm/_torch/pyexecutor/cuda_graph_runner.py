"""CUDA graphs for generation-only target steps (decode, verify).

A step is graphable when every segment has the same token count q (1 for decode,
1 + max_draft_len for verify, one of `token_counts`), wants logits for all of them,
writes only slots its request owns, and the batch fits a bucket. The batch is padded
up to the bucket with padding requests that live in one page the runner holds::

    rows: [ seg0: q tokens | seg1 | ... | segB-1 | pad | ... | pad ]     (bucket * q rows)
    pad:  positions 0..q-1, num_cached 0, block table [scratch, BAD, ...], slots in scratch

Per (bucket, q) a `_GraphEntry` owns the persistent inputs: input_ids, positions, and an
`AttentionMetadata` whose slot_mapping and block_tables are persistent device buffers.
A step copies its inputs into them, lets the backend plan outside the graph
(`backend.prepare(md)` with md.extras[CUDA_GRAPH_SHAPE_KEY]) and replays. The first
step of a (bucket, q) runs once eagerly (warm-up: lazy state, and the backend plans its
fixed-address wrappers), is captured, then replayed. Anything else runs eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..attention_backend.flashinfer_backend import CUDA_GRAPH_SHAPE_KEY
from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata
from .resource_manager import KVCacheManager

logger = logging.getLogger("tensorrt_llm")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def batch_buckets(max_batch_size: int, candidates: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[int]:
    """Capture sizes: candidates below max_batch_size, plus max_batch_size (capped at the largest)."""
    top = min(max_batch_size, max(candidates))
    return sorted({c for c in candidates if c < top} | {top})


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

    block_tables: [B, w] int32 CPU (w <= max_pages). Padding requests attend over their own
    q tokens at positions 0..q-1 in `scratch_page`; their outputs are discarded.
    """
    b = len(token_ids)
    if not 0 < b <= bucket or q > page_size:
        raise ValueError(f"cannot pad {b} requests of {q} tokens to bucket {bucket} (page {page_size})")
    pad = bucket - b
    ids = [t for seg in token_ids for t in seg] + [0] * (pad * q)
    pos = [s + i for s in starts for i in range(q)] + list(range(q)) * pad
    slot = [x for seg in slots for x in seg] + [scratch_page * page_size + i for i in range(q)] * pad
    bt = torch.full((bucket, max_pages), BAD_PAGE_INDEX, dtype=torch.int32)
    bt[:b, :block_tables.shape[1]] = block_tables
    bt[b:, 0] = scratch_page
    return GraphInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                       torch.tensor(slot, dtype=torch.long), bt, list(starts) + [0] * pad)


@dataclass
class _GraphEntry:
    """Persistent buffers and the captured graph of one (bucket, q)."""

    bucket: int
    q: int
    input_ids: torch.Tensor                     # [bucket * q] int64, device
    positions: torch.Tensor                     # [bucket * q] int64, device
    md: AttentionMetadata                       # slot_mapping / block_tables persistent
    graph: Optional[torch.cuda.CUDAGraph] = None
    logits: Optional[torch.Tensor] = None       # [bucket * q, V] float32 (graph output)
    captured: Optional[torch.Tensor] = None     # [bucket * q, n*H] (graph output) or None
    replays: int = field(default=0)


class CUDAGraphRunner:
    """Captures and replays the target forward of generation-only steps per batch bucket."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 kv_caches: Sequence[torch.Tensor], device: torch.device, max_batch_size: int,
                 token_counts: Sequence[int] = (1,), capture_layer_ids: Sequence[int] = (),
                 buckets: Optional[Sequence[int]] = None):
        if device.type != "cuda":
            raise ValueError(f"use_cuda_graph needs a CUDA device, got {device}")
        if not backend.capabilities.cuda_graphs:
            raise ValueError(f"use_cuda_graph: attention backend {backend.name} does not support CUDA "
                             "graphs (choose attn_backend='FLASHINFER' or use_cuda_graph=False)")
        p = kv.tokens_per_block
        if max(token_counts) > p:
            raise ValueError(f"use_cuda_graph: {max(token_counts)} tokens per request exceed one "
                             f"page ({p} tokens), which padding requests must fit in")
        self.model, self.kv, self.backend = model, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.token_counts = frozenset(token_counts)
        self.capture_layer_ids = list(capture_layer_ids)
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_batch_size)
        # Padding requests write here; the page is held for the runner's lifetime (never hashed).
        self.scratch_page = kv.pool.allocate()
        self._entries: dict[tuple[int, int], _GraphEntry] = {}
        self._pool = None
        self.num_captures = 0
        self.num_replays = 0
        self.num_eager_fallbacks = 0

    # ---- eligibility ---------------------------------------------------------------------
    def _bucket(self, n: int) -> Optional[int]:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def plan_step(self, segments) -> Optional[tuple[int, int, list[list[int]]]]:
        """(bucket, q, slots per segment) when the step can replay a graph, else None."""
        if not segments:
            return None
        q = len(segments[0].token_ids)
        if q not in self.token_counts or any(len(s.token_ids) != q or s.num_logits != q for s in segments):
            return None
        bucket = self._bucket(len(segments))
        if bucket is None:
            return None
        slots = [self.kv.slots(s.request_id, s.start, q) for s in segments]
        if any(x < 0 for seg in slots for x in seg):
            return None          # a write beyond owned pages: eager handles (skips) it
        return bucket, q, slots

    # ---- run -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, segments) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Replay for a graphable step: (logits [B*q, V] float32, captured [B*q, n*H] or None).

        Returns None when the step must run eagerly.
        """
        plan = self.plan_step(segments)
        if plan is None:
            self.num_eager_fallbacks += 1
            return None
        bucket, q, slots = plan
        entry = self._entries.get((bucket, q))
        if entry is None:
            entry = self._new_entry(bucket, q)
            self._entries[(bucket, q)] = entry
        self._load_inputs(entry, segments, slots)
        if entry.graph is None:
            self._capture(entry)
        entry.graph.replay()
        entry.replays += 1
        self.num_replays += 1
        n = len(segments) * q
        cap = entry.captured[:n].clone() if entry.captured is not None else None
        return entry.logits[:n].clone(), cap

    def _new_entry(self, bucket: int, q: int) -> _GraphEntry:
        n, dev = bucket * q, self.device
        md = AttentionMetadata(
            seq_lens=[q] * bucket, num_cached=[0] * bucket,
            block_tables=torch.full((bucket, self.kv.max_blocks_per_seq), BAD_PAGE_INDEX,
                                    dtype=torch.int32, device=dev),
            slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
            tokens_per_block=self.kv.tokens_per_block, causal=True)
        return _GraphEntry(bucket, q, torch.zeros(n, dtype=torch.long, device=dev),
                           torch.zeros(n, dtype=torch.long, device=dev), md)

    def _load_inputs(self, entry: _GraphEntry, segments, slots: list[list[int]]) -> None:
        rids = [s.request_id for s in segments]
        host = pack_graph_inputs([s.token_ids for s in segments], [s.start for s in segments], slots,
                                 self.kv.block_tables(rids, torch.device("cpu")), entry.bucket, entry.q,
                                 self.kv.max_blocks_per_seq, self.scratch_page, self.kv.tokens_per_block)
        entry.input_ids.copy_(host.input_ids)
        entry.positions.copy_(host.positions)
        md = entry.md
        md.slot_mapping.copy_(host.slot_mapping)
        md.block_tables.copy_(host.block_tables)
        md.num_cached = host.num_cached
        md.extras = {CUDA_GRAPH_SHAPE_KEY: (entry.bucket, entry.q, self.kv.max_blocks_per_seq)}
        self.backend.prepare(md)

    def _forward(self, entry: _GraphEntry) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        hidden, captured = self.model(entry.input_ids, entry.positions, self.kv_caches, entry.md,
                                      self.backend, self.capture_layer_ids)
        logits = self.model.compute_logits(hidden)
        return logits, (torch.cat(captured, dim=-1) if captured else None)

    def _capture(self, entry: _GraphEntry) -> None:
        # Warm-up on a side stream (torch's rule for capture); it also plans the backend's
        # fixed-address wrappers for this shape, so nothing is planned inside the capture.
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            self._forward(entry)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            entry.logits, entry.captured = self._forward(entry)
        entry.graph = graph
        self.num_captures += 1
        logger.info("captured CUDA graph for batch bucket %d x %d tokens", entry.bucket, entry.q)
