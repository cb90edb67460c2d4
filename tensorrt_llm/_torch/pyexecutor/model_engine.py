"""Model runner: turns scheduled segments into packed tensors + metadata and runs the target.

It never decides admission; it only executes what the scheduler chose.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import FP8_KV_DTYPES, AttentionBackend, AttentionMetadata, host_ints
from ..runtime.device import is_device_fault
from ..runtime.llm_request import LlmRequest
from ..runtime.step import ForwardOutput, ForwardSegment
from ..runtime.token_rows import gather_shifts
from .cuda_graph_runner import CUDAGraphRunner
from .kv_cache.resource_manager import KVCacheManager
from .packed_graph_runner import PackedGraphRunner, shift_tokens, shifted_token_rows
from .piecewise_graph_runner import PiecewiseGraphRunner, pack_segments, segment_lengths

if TYPE_CHECKING:
    from .mixed_step_graph import MixedSpecGraph
    from .spec_step_graph import SpecLaunch, SpecStepGraph

logger = logging.getLogger("tensorrt_llm")


@dataclass
class StepPaths:
    """How the engine ran its steps, counted since construction (one per step)."""

    one_graph: int = 0      # verify, acceptance and draft step as one graph (`SpecStepGraph`)
    one_graph_with_prompts: int = 0   # ... with arriving prompt chunks in its forward (`MixedSpecGraph`)
    target_graph: int = 0   # the target's whole-step CUDA graph
    packed_graph: int = 0   # one packed-step graph (prompt chunks and the steps they join; `ragged_graphs` backends)
    piecewise: int = 0      # piecewise CUDA graphs (the same steps on other backends)
    eager: int = 0          # no graph


class ModelEngine:
    """Runs the target model over the KV manager's target pool.

    With `use_cuda_graph`, a step whose segments all have one decode / verify shape replays one
    captured graph (`CUDAGraphRunner`); any other step (prompt chunks, mixed lengths, clamped
    pages) replays one packed-step graph when the backend reads query offsets and lengths on the
    device (`PackedGraphRunner`, TRITON), else the piecewise graphs around eager attention
    (`PiecewiseGraphRunner`); a step beyond the largest token bucket runs eagerly. With a device draft
    step, a steady-state DSpark step runs verify, acceptance and drafting as one graph (`forward_spec`,
    `SpecStepGraph`), also with arriving prompt chunks in its forward (`MixedSpecGraph`).
    """

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: AttentionBackend,
                 device: torch.device, capture_layer_ids: Sequence[int] = (),
                 use_cuda_graph: bool = False, max_batch_size: int = 1, tokens_per_gen: int = 1,
                 max_num_tokens: int = 2048, verify_widths: Sequence[int] = ()):
        """tokens_per_gen: the widest generation segment (1 + K); verify_widths: every verify
        segment length a step may use (graphs are captured for each, and for decode)."""
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.capture_layer_ids = list(capture_layer_ids)
        self.kv_caches = kv.layer_caches("target")
        kv_dtype = self.kv_caches[0].dtype if self.kv_caches else None
        if kv_dtype in FP8_KV_DTYPES and not backend.capabilities.fp8_kv:
            raise ValueError(f"attention backend {backend.name} does not support fp8 KV "
                             f"(pool dtype {kv_dtype}); use kv_cache_config.dtype='auto'")
        self.graph_runner: Optional[CUDAGraphRunner] = None
        self.piecewise: Optional[PiecewiseGraphRunner] = None
        self.packed: Optional[PackedGraphRunner] = None
        if use_cuda_graph:
            self.graph_runner = CUDAGraphRunner(model, kv, backend, self.kv_caches, device, max_batch_size,
                                                token_counts=sorted({1, tokens_per_gen, *verify_widths}),
                                                capture_layer_ids=self.capture_layer_ids)
            max_tokens = max(max_num_tokens, tokens_per_gen)
            if backend.capabilities.ragged_graphs:
                self.packed = PackedGraphRunner(model, kv, backend, self.kv_caches, device, max_tokens,
                                                max_batch_size, self.capture_layer_ids,
                                                max_shift=tokens_per_gen if tokens_per_gen > 1 else 0)
            else:
                self.piecewise = PiecewiseGraphRunner(model, kv, backend, self.kv_caches, device, max_tokens,
                                                      self.capture_layer_ids)
        self.max_shift = tokens_per_gen  # a continued segment starts at most this many positions late
        self.paths = StepPaths()
        self.num_continued_steps = 0     # steps launched from the device rows of the step in flight
        self.spec_step: Optional["SpecStepGraph"] = None   # set by the creator with a device draft step
        self.mixed_step: Optional["MixedSpecGraph"] = None  # the same with arriving prompts (set with it)

    def capture_graphs(self, continued: bool) -> int:
        """Capture every CUDA graph a step may replay (whole-step entries, packed or piecewise token buckets, the
        one-graph DSpark step) now, so no serving step waits for a capture; continued: the entries of
        continued segments too (overlapped DSpark steps). A one-graph step the runtime refuses to
        capture is turned off (logged), as in `forward_spec`. Returns how many were captured."""
        n = 0
        if self.graph_runner is not None:
            n += self.graph_runner.capture_all(continued)
        if self.packed is not None:
            n += self.packed.capture_all()
        if self.piecewise is not None:
            n += self.piecewise.capture_all()
        if self.spec_step is not None:
            try:
                n += self.spec_step.capture_all(continued)
            except RuntimeError as e:
                self._spec_step_refused(e, "capture ")
        if self.mixed_step is not None:
            try:
                n += self.mixed_step.capture_all()
            except RuntimeError as e:
                self._spec_step_refused(e, "capture ", prompts=True)
        return n

    def _spec_step_refused(self, e: RuntimeError, what: str, prompts: bool = False) -> None:
        """The runtime refused the one-graph step (`what`: "" a step, "capture " the startup capture;
        prompts: its form with arriving prompts): it is off from now on (the form with prompts goes
        with it), logged; a device fault is raised."""
        if is_device_fault(e):
            raise e
        logger.error("one-graph DSpark step%s %sfailed (%s: %s); %s from now on", " with prompts" if prompts else "",
                     what, type(e).__name__, e,
                     "prompts run beside it" if prompts else "verify and draft run apart")
        self.mixed_step = None
        if not prompts:
            self.spec_step = None

    @torch.inference_mode()
    def forward_spec(self, reqs: Sequence[LlmRequest], segments: Sequence[ForwardSegment], num_ctx: int = 0
                     ) -> Optional["SpecLaunch"]:
        """The step as one verify -> accept -> draft graph (`SpecStepGraph`; with num_ctx leading prompt
        chunks, `MixedSpecGraph`), or None when it is not one it takes (the caller runs `forward` and
        the drafter, or the prompts beside the rest). A graph the runtime refuses turns that form of
        the one-graph step off (logged); the step then runs the other way."""
        runner = self.mixed_step if num_ctx else self.spec_step
        if runner is None or self.spec_step is None:     # the form with prompts goes with the one-graph step
            return None
        shifted = any(s.start_shift is not None for s in segments[num_ctx:])
        if shifted:
            check_continued(segments[num_ctx:], self.backend)
        try:
            launch = runner.run(reqs, segments, num_ctx) if num_ctx else runner.run(reqs, segments)
        except RuntimeError as e:
            self._spec_step_refused(e, "", prompts=bool(num_ctx))
            return None
        self.num_continued_steps += int(launch is not None and shifted)
        if launch is not None:
            self.paths.one_graph += 1
            self.paths.one_graph_with_prompts += int(num_ctx > 0)
        return launch

    @torch.inference_mode()
    def forward(self, segments: Sequence[ForwardSegment], prompt_segments: int = 0) -> ForwardOutput:
        """The target forward of the step's segments: logits of the wanted rows, captured rows.
        A step with continued segments (`start_shift`; prompt chunks may lead it) runs the whole-step
        graph, the packed-step graph or `_continued`.
        The first `prompt_segments` are prompt chunks: the packed-step graph writes their draft
        context when it carries the drafter's writer (`ForwardOutput.context_segments`)."""
        shifted = any(s.start_shift is not None for s in segments)
        if shifted:
            check_continued(segments, self.backend)
            self.num_continued_steps += 1
        if self.graph_runner is not None:
            out = self.graph_runner.run(segments)
            if out is not None:
                self.paths.target_graph += 1
                return out
            out = self.packed.run(segments, prompt_segments) if self.packed is not None else None
            if out is not None:
                self.paths.packed_graph += 1
                return out
            out = self.piecewise.run(segments) if self.piecewise is not None and not shifted else None
            if out is not None:
                self.paths.piecewise += 1
                return out
        self.paths.eager += 1
        return self._continued(segments) if shifted else self._eager(segments)

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
        md = self.kv.attention_metadata([s.request_id for s in segments], [s.start for s in segments],
                                        [len(s.token_ids) for s in segments], True)
        self.backend.prepare(md)
        input_ids, positions = host_ints(ids, self.device), host_ints(pos, self.device)
        hidden, captured = self.model(input_ids, positions, self.kv_caches, md, self.backend,
                                      self.capture_layer_ids)
        sel = host_ints(rows, self.device)
        logits = self.model.compute_logits(hidden[sel]) if rows else hidden.new_zeros(0, 1).float()
        cap = torch.cat(captured, dim=-1) if captured else None
        return ForwardOutput(logits, logits_offsets, cap, token_offsets)

    def _continued(self, segments: Sequence[ForwardSegment]) -> ForwardOutput:
        """The eager forward of a step some of whose generation segments start on the device (start +
        start_shift), packed in step order beside prompt chunks and other segments: positions, slots
        and KV lengths are moved there (`shift_tokens`), so no host value of the step in flight is
        needed (the backend reads lengths on the device)."""
        lens, dev, b = segment_lengths(segments), self.device, len(segments)
        n = sum(lens)
        rows = self.kv.rows([s.request_id for s in segments])
        starts = np.fromiter((s.start for s in segments), dtype=np.int64, count=b)
        host = np.empty((4, n), dtype=np.int64)       # ids | positions | slots | shift index
        packed = pack_segments(segments, lens, host[0], host[1])
        _, host[2] = self.kv.packed_slots(rows, starts, lens)
        shifted = np.fromiter((s.start_shift is not None for s in segments), dtype=bool, count=b)
        host[3] = shifted_token_rows(shifted, lens, b)
        io = host_ints(host, dev)
        ids, pos, slots, index = io[0], io[1], io[2], io[3]
        packed.gather_device_tokens(ids)
        shifts = torch.empty(b + 1, dtype=torch.long, device=dev)
        gather_shifts(shifts, [s.start_shift for s in segments])
        table = host_ints(self.kv.page_table[rows], dev, torch.int32)
        kv_lens = host_ints(starts + np.asarray(lens, dtype=np.int64), dev, torch.int32)
        shift_tokens(pos, slots, kv_lens, index, shifts, table, self.kv.tokens_per_block)
        bound = int((starts + lens).max()) + self.max_shift
        md = AttentionMetadata(seq_lens=lens, num_cached=starts.tolist(), block_tables=table, slot_mapping=slots,
                               tokens_per_block=self.kv.tokens_per_block, causal=True, kv_lens_device=kv_lens,
                               kv_len_bound=bound)
        self.backend.prepare(md)
        hidden, captured = self.model(ids, pos, self.kv_caches, md, self.backend, self.capture_layer_ids)
        return packed.output(self.model, hidden, torch.cat(captured, dim=-1) if captured else None)


def check_continued(segments: Sequence[ForwardSegment], backend: AttentionBackend) -> None:
    """ValueError unless a step with continued segments can run: a backend that reads KV lengths on
    the device, and every continued segment a generation segment (logits for every token)."""
    if not backend.capabilities.device_lengths:
        raise ValueError(f"continued segments need an attention backend that reads KV lengths on the device; "
                         f"{backend.name} plans on the host")
    bad = [s.request_id for s in segments if s.start_shift is not None and s.num_logits != len(s.token_ids)]
    if bad:
        raise ValueError(f"a continued segment is a generation segment (a logit per token); requests "
                         f"{bad[:8]} are not")
