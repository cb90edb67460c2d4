"""Model runner: turns scheduled segments into packed tensors + metadata and runs the target.

It never decides admission; it only executes what the scheduler chose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..attention_backend.interface import AttentionBackend, AttentionMetadata
from .cuda_graph_runner import CUDAGraphRunner
from .resource_manager import KVCacheManager
from .step_split import cat_rows, stitched_offsets

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class ForwardSegment:
    """Tokens of one request for this step, at absolute positions start..start+len-1."""

    request_id: int
    token_ids: Sequence[int]   # a list, or `VerifyTokens` whose drafts are still on the device
    start: int          # == tokens already in the target pages
    num_logits: int     # logits wanted for the last `num_logits` tokens


@dataclass
class ForwardOutput:
    """Outputs of one step. Offsets are per segment and need not be monotonic in segment order
    (a split step puts its eager segments' rows first, then the graph group's; `step_split`)."""

    logits: torch.Tensor                  # [sum(num_logits), V] float32
    logits_offsets: list[int]             # row offset of each segment's logits
    captured: Optional[torch.Tensor]      # [T, n*H] captured target hidden (concat), or None
    token_offsets: list[int]              # first row of each segment's tokens in `captured`


def build_metadata(kv: KVCacheManager, request_ids: Sequence[int], starts: Sequence[int],
                   lengths: Sequence[int], causal: bool, device: torch.device,
                   slot_lists: Optional[Sequence[list[int]]] = None) -> AttentionMetadata:
    """Metadata for packed segments; slots beyond a request's owned pages are -1 (skipped)."""
    slots: list[int] = []
    for i, (rid, s, n) in enumerate(zip(request_ids, starts, lengths)):
        slots.extend(slot_lists[i] if slot_lists is not None else kv.slots(rid, s, n))
    return AttentionMetadata(
        seq_lens=list(lengths), num_cached=list(starts),
        block_tables=kv.block_tables(request_ids, device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        tokens_per_block=kv.tokens_per_block, causal=causal)


class ModelEngine:
    """Runs the target model over the KV manager's target pool.

    With `use_cuda_graph`, generation segments of one shape replay a captured graph
    (`CUDAGraphRunner`): the whole step when every segment fits, else the graph group next to
    one eager forward of the rest, stitched into one output (`step_split`). A step with no
    graphable segment runs eagerly.
    """

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 device: torch.device, capture_layer_ids: Sequence[int] = (),
                 use_cuda_graph: bool = False, max_batch_size: int = 1, tokens_per_gen: int = 1):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.capture_layer_ids = list(capture_layer_ids)
        self.kv_caches = kv.layer_caches("target")
        kv_dtype = self.kv_caches[0].dtype if self.kv_caches else None
        if kv_dtype in _FP8_DTYPES and not backend.capabilities.fp8_kv:
            raise ValueError(f"attention backend {backend.name} does not support fp8 KV "
                             f"(pool dtype {kv_dtype}); use kv_cache_config.dtype='auto'")
        self.graph_runner: Optional[CUDAGraphRunner] = None
        if use_cuda_graph:
            self.graph_runner = CUDAGraphRunner(model, kv, backend, self.kv_caches, device, max_batch_size,
                                                token_counts=sorted({1, tokens_per_gen}),
                                                capture_layer_ids=self.capture_layer_ids)

    @torch.inference_mode()
    def forward(self, segments: Sequence[ForwardSegment]) -> ForwardOutput:
        run = self.graph_runner.run(segments) if self.graph_runner is not None else None
        if run is None:
            return self._eager(segments)
        if len(run.indices) == len(segments):
            offsets = list(range(0, len(segments) * run.q, run.q))
            return ForwardOutput(run.logits, offsets, run.captured, offsets)
        shapes = [(len(s.token_ids), s.num_logits) for s in segments]
        logits_offsets, token_offsets = stitched_offsets(shapes, run.indices, run.q)
        in_graph = set(run.indices)
        eager = self._eager([s for i, s in enumerate(segments) if i not in in_graph])
        return ForwardOutput(cat_rows(eager.logits, run.logits), logits_offsets,
                             cat_rows(eager.captured, run.captured), token_offsets)

    def _eager(self, segments: Sequence[ForwardSegment]) -> ForwardOutput:
        """One packed forward of `segments` (any mix of prompt chunks and generation)."""
        ids, pos, rows = [], [], []
        logits_offsets, token_offsets = [], []
        t = 0
        for seg in segments:
            n = len(seg.token_ids)
            if n == 0:
                raise ValueError(f"request {seg.request_id}: empty forward segment")
            token_offsets.append(t)
            logits_offsets.append(len(rows))
            ids.extend(seg.token_ids)
            pos.extend(range(seg.start, seg.start + n))
            rows.extend(range(t + n - seg.num_logits, t + n))
            t += n
        md = build_metadata(self.kv, [s.request_id for s in segments], [s.start for s in segments],
                            [len(s.token_ids) for s in segments], True, self.device)
        self.backend.prepare(md)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden, captured = self.model(input_ids, positions, self.kv_caches, md, self.backend,
                                      self.capture_layer_ids)
        sel = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[sel]) if rows else hidden.new_zeros(0, 1).float()
        cap = torch.cat(captured, dim=-1) if captured else None
        return ForwardOutput(logits, logits_offsets, cap, token_offsets)
