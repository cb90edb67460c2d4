"""Piecewise CUDA graphs: any step (prompt chunks mixed with decode / verify segments) replays
the target's token-wise work from graphs and runs only attention eagerly.

A step that the full-step graphs cannot take (a prompt chunk, segments of mixed lengths, a
slot beyond a request's owned pages, more requests than the largest batch bucket) used to run
the whole 30-layer forward eagerly: ~40 launches per layer on the host while every running
request waited. Everything in a decoder layer except attention is position-wise, so the
packed tokens are padded to a token bucket T and the forward is cut at each attention::

    piece 0    : embed, rope tables, layer 0 norm + qkv + rope          -> q0 k0 v0
    attention 0: eager, the step's real n tokens only (K/V write + paged attention) -> o[:n]
    piece i    : layer i-1 o_proj + residual + MLP (+ capture), layer i norm + qkv + rope (one region:
                 `output_then_inputs`)
    ...
    piece L    : layer L-1 o_proj + residual + MLP (+ capture), final norm   -> hidden, captured

Per token bucket, L + 1 graphs share one memory pool; each piece reads the persistent outputs
of the piece before it and the eager attention's output buffer `o` [T, Hq*D]. Padding rows
(n..T-1) compute garbage that no real row reads (no op mixes rows outside attention, which
sees only the real rows). The attention plan is made once per step from host lengths, as for
an eager step. Logits are computed after the last piece for the wanted rows only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import AttentionBackend, host_ints
from ..runtime.cuda_graph import GraphCache, GraphEntry
from ..runtime.step import ForwardOutput, ForwardSegment
from ..runtime.token_rows import TokenRow, VerifyTokens, group_by_pending
from .kv_cache.resource_manager import KVCacheManager

logger = logging.getLogger("tensorrt_llm")

SMALL_TOKEN_BUCKETS = (16, 32, 64, 128, 256)
LARGE_TOKEN_STEP = 256
# Buckets captured at startup (`capture_all`); larger ones at their first step. Every piece keeps its
# outputs, (L + 1) x (hidden + q + k + v) values per token of a bucket, so capturing all buckets of a
# large max_num_tokens up front would hold memory that no step may use (SmolLM2 at 8192 tokens: ~13 GB).
STARTUP_CAPTURE_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts captured: 16..256 by powers of two, then multiples of 256, up to the
    first one >= max_tokens (a step pads to the smallest bucket that holds it)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[int] = []
    for b in SMALL_TOKEN_BUCKETS:
        out.append(b)
        if b >= max_tokens:
            return out
    while out[-1] < max_tokens:
        out.append(out[-1] + LARGE_TOKEN_STEP)
    return out


@dataclass
class PackedSegments:
    """Where a step's segments landed in a packed token axis (staged by `pack_segments`)."""

    token_offsets: list[int]          # first row of each segment
    logits_offsets: list[int]         # first logits row of each segment
    logit_rows: list[int]             # the packed rows whose logits are wanted, in order
    device_rows: list[TokenRow]       # tokens still on the device ...
    device_at: list[int]              # ... and the packed row of the first of each

    def gather_device_tokens(self, input_ids: torch.Tensor) -> None:
        """Write the device-resident tokens into input_ids [T] (on the device, queued behind the steps
        that made them; after the host ids were copied in)."""
        for pend, at, toks in group_by_pending(self.device_rows, self.device_at):
            width = pend.width
            dst = [a + i for a, t in zip(at, toks) for i in range(len(t))]
            src = [t.index * width + t.offset + i for t in toks for i in range(len(t))]
            input_ids.index_copy_(0, host_ints(dst, input_ids.device),
                                  pend.device.reshape(-1).index_select(0, host_ints(src, input_ids.device)))

    def output(self, model: torch.nn.Module, hidden: torch.Tensor, captured: Optional[torch.Tensor]
               ) -> ForwardOutput:
        """The step's output from hidden [n, H] (final-normed) and captured [n, c*H] of the real rows."""
        rows = self.logit_rows
        logits = (model.compute_logits(hidden[host_ints(rows, hidden.device)]) if rows
                  else hidden.new_zeros(0, 1).float())
        return ForwardOutput(logits, self.logits_offsets, captured, self.token_offsets)


def segment_lengths(segments: Sequence[ForwardSegment]) -> list[int]:
    """Tokens of each segment; ValueError naming the request of an empty one."""
    lens = [len(s.token_ids) for s in segments]
    if 0 in lens:
        raise ValueError(f"request {segments[lens.index(0)].request_id}: empty forward segment")
    return lens


def pack_segments(segments: Sequence[ForwardSegment], lens: Sequence[int], ids: np.ndarray, pos: np.ndarray
                  ) -> PackedSegments:
    """Stage segments packed in step order into host ids / positions [T] int64 (rows past the real
    tokens zeroed); tokens still on the device are left to `PackedSegments.gather_device_tokens`."""
    token_offsets, logits_offsets, rows = [], [], []
    dev_rows: list[TokenRow] = []
    dev_at: list[int] = []
    o = 0
    for seg, k in zip(segments, lens):
        token_offsets.append(o)
        logits_offsets.append(len(rows))
        toks = seg.token_ids
        if isinstance(toks, VerifyTokens):       # anchor here, drafts gathered on the device
            ids[o] = toks.anchor
            dev_rows.append(toks.drafts)
            dev_at.append(o + 1)
        elif isinstance(toks, TokenRow):         # the overlap scheduler's token, still on the device
            dev_rows.append(toks)
            dev_at.append(o)
        else:
            ids[o:o + k] = toks
        pos[o:o + k] = np.arange(seg.start, seg.start + k)
        rows.extend(range(o + k - seg.num_logits, o + k))
        o += k
    ids[o:] = 0
    pos[o:] = 0
    return PackedSegments(token_offsets, logits_offsets, rows, dev_rows, dev_at)


@dataclass
class PieceOutputs:
    """What one piece leaves for the next (persistent tensors of its graph)."""

    h: torch.Tensor                                     # [T, H] residual stream (piece L: final-normed)
    rope: tuple[torch.Tensor, torch.Tensor]             # the step's (cos, sin), made by piece 0
    qkv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # next layer's attention inputs
    captured: tuple[torch.Tensor, ...] = ()             # capture layers passed so far, in order


@dataclass
class _PieceEntry(GraphEntry):
    index: int = 0


@dataclass
class _Bucket:
    """Persistent inputs of one token bucket: ids, positions [T] int64; attention output o [T, Hq*D]."""

    tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    o: torch.Tensor
    host: torch.Tensor                      # [2, T] int64 staging (pinned on CUDA)
    pieces: list[_PieceEntry] = field(default_factory=list)
    copied: Optional[torch.cuda.Event] = None   # the last host -> device copy of `host`


class PiecewiseGraphRunner:
    """Replays a target forward over any packed segments as L + 1 graph pieces around eager attention."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 kv_caches: Sequence[torch.Tensor], device: torch.device, max_tokens: int,
                 capture_layer_ids: Sequence[int] = ()):
        self.model, self.kv, self.backend = model, kv, backend
        self.kv_caches = list(kv_caches)
        self.device = device
        self.capture_layer_ids = list(capture_layer_ids)
        self.buckets = token_buckets(max_tokens)
        self.graphs: GraphCache[_PieceEntry] = GraphCache(device)
        self._buckets: dict[int, _Bucket] = {}
        self.num_steps = 0

    def bucket_for(self, n: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def run(self, segments: Sequence[ForwardSegment]) -> Optional[ForwardOutput]:
        """The forward of `segments` packed in step order (as an eager step packs them), or None when
        the step holds more tokens than the largest bucket (it then runs eagerly)."""
        lens = segment_lengths(segments)
        n = sum(lens)
        t = self.bucket_for(n)
        if t is None:
            return None
        b = self._bucket(t)
        if b.copied is not None:
            b.copied.synchronize()    # the previous step of this bucket has left the staging buffer
        host = b.host
        packed = pack_segments(segments, lens, host[0].numpy(), host[1].numpy())
        b.input_ids.copy_(host[0], non_blocking=True)
        b.positions.copy_(host[1], non_blocking=True)
        packed.gather_device_tokens(b.input_ids)       # queued behind the steps that made them
        if self.device.type == "cuda":
            if b.copied is None:          # one event per bucket, re-recorded by every copy
                b.copied = torch.cuda.Event()
            b.copied.record()
        md = self.kv.attention_metadata([s.request_id for s in segments], [s.start for s in segments], lens, True)
        self.backend.prepare(md)
        layers = self.model.decoder_layers
        out = self._replay(b, 0)
        for i, layer in enumerate(layers):
            q, k, v = (x[:n] for x in out.qkv)
            b.o[:n].copy_(layer.self_attn.core(q, k, v, self.kv_caches[i], md, self.backend))
            out = self._replay(b, i + 1)
        self.num_steps += 1
        cap = torch.cat(out.captured, dim=-1)[:n] if out.captured else None
        return packed.output(self.model, out.h[:n], cap)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture the pieces of every token bucket up to `STARTUP_CAPTURE_TOKENS` now (the engine calls
        it once at startup, so no such step waits for a capture): the pieces replay in order on zero
        inputs with attention skipped (pieces write only their own outputs; the KV pool is
        untouched). Returns how many graphs were captured."""
        n0 = self.graphs.num_captures
        for t in (b for b in self.buckets if b <= STARTUP_CAPTURE_TOKENS):
            b = self._bucket(t)
            for j in range(len(b.pieces)):
                if b.pieces[j].graph is None:
                    self._replay(b, j)
        return self.graphs.num_captures - n0

    def _bucket(self, t: int) -> _Bucket:
        b = self._buckets.get(t)
        if b is None:
            width = self.model.decoder_layers[0].self_attn.o_proj.in_features
            dtype = self.model.lm_head.weight.dtype
            i64 = dict(dtype=torch.long, device=self.device)
            b = _Bucket(t, torch.zeros(t, **i64), torch.zeros(t, **i64),
                        torch.zeros(t, width, dtype=dtype, device=self.device),
                        torch.zeros(2, t, dtype=torch.long, pin_memory=self.device.type == "cuda"))
            b.pieces = [_PieceEntry(index=j) for j in range(len(self.model.decoder_layers) + 1)]
            self._buckets[t] = b
            logger.info("capturing piecewise CUDA graphs for %d tokens (%d pieces)", t, len(b.pieces))
        return b

    def _replay(self, b: _Bucket, j: int) -> PieceOutputs:
        return self.graphs.replay(b.pieces[j], lambda e: self._piece(b, e.index))

    def _piece(self, b: _Bucket, j: int) -> PieceOutputs:
        """Piece j of bucket b (captured once; reads the persistent outputs of piece j - 1)."""
        model, layers = self.model, self.model.decoder_layers
        if j == 0:
            h, rope = model.embed(b.input_ids, b.positions)
            return PieceOutputs(h, rope, layers[0].attention_inputs(h, b.positions, rope))
        prev: PieceOutputs = b.pieces[j - 1].outputs
        if j == len(layers):
            h = layers[j - 1].output(prev.h, b.o)
            captured = prev.captured + ((h,) if j - 1 in self.capture_layer_ids else ())
            order = sorted(set(self.capture_layer_ids))
            by_id = dict(zip(order, captured))
            return PieceOutputs(model.final_norm(h), prev.rope, None,
                                tuple(by_id[i] for i in self.capture_layer_ids))
        h, qkv = layers[j - 1].output_then_inputs(prev.h, b.o, layers[j], b.positions, prev.rope)
        captured = prev.captured + ((h,) if j - 1 in self.capture_layer_ids else ())
        return PieceOutputs(h, prev.rope, qkv, captured)
