"""CUDA-graph helpers shared by the target and the draft graph runners (no policy).

    GraphCache        : one capture / replay cache per runner (entries by key, one memory pool,
                        warm-up on a side stream, then capture; replay and capture counters)
    fill_padded       : pad B real segments to a batch bucket with padding requests that live in the
                        KV manager's scratch page (`KVCacheManager.scratch_page`)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Optional, Sequence, TypeVar

import numpy as np
import torch

from ..attention_backend.interface import AttentionBackend

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


def flat_rows(rows: Sequence[Sequence[int]] | np.ndarray, count: int, what: str) -> np.ndarray:
    """[B][q] -> [B*q] int64, ValueError unless there are exactly `count` values."""
    if isinstance(rows, np.ndarray):
        out = rows.reshape(-1)
    else:
        out = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
    if out.shape[0] != count:
        raise ValueError(f"{what}: {out.shape[0]} values for {count} rows (every segment needs q tokens)")
    return out


def fill_padded(pos: np.ndarray, slot: np.ndarray, starts: np.ndarray, b: int, bucket: int, q: int,
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


@dataclass
class GraphEntry:
    """The captured part of one graph entry: the graph and its outputs (persistent tensors that
    each replay refills). Runners subclass it with their persistent inputs."""

    graph: Optional[torch.cuda.CUDAGraph] = field(default=None, init=False)
    outputs: Any = field(default=None, init=False)
    replays: int = field(default=0, init=False)


E = TypeVar("E", bound=GraphEntry)


class GraphCache(Generic[E]):
    """Entries by key; the first replay of an entry warms up and captures it (one memory pool).
    With capture=False a replay runs the forward directly (the same step without a graph)."""

    def __init__(self, device: torch.device, capture: bool = True):
        self.device = device
        self.capture = capture
        self.entries: dict[Hashable, E] = {}
        self._pool = None
        self.num_captures = 0
        self.num_replays = 0

    def entry(self, key: Hashable, make: Callable[[], E]) -> E:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = make()
        return e

    def capture_ahead(self, key: Hashable, make: Callable[[], E], stage: Callable[[E], None],
                      forward: Callable[[E], Any]) -> int:
        """Capture entry `key` before any step needs it (a runner's `capture_all`, at startup): `stage`
        loads padding-only inputs, then the first replay captures. Returns 1 when captured now, 0 when
        it already was or without CUDA graphs."""
        if not self.capture:
            return 0
        entry = self.entry(key, make)
        if entry.graph is not None:
            return 0
        stage(entry)
        self.replay(entry, forward)
        return 1

    def replay(self, entry: E, forward: Callable[[E], Any]) -> Any:
        """Replay `entry` (its inputs already loaded), capturing `forward(entry)` the first time;
        returns the entry's outputs."""
        if not self.capture:
            entry.replays += 1
            self.num_replays += 1
            return forward(entry)
        if entry.graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            entry.graph, entry.outputs = capture_graph(lambda: forward(entry), self.device, self._pool)
            self.num_captures += 1
        entry.graph.replay()
        entry.replays += 1
        self.num_replays += 1
        return entry.outputs
