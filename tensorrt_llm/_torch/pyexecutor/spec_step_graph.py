"""One CUDA graph per DSpark step: target verify -> greedy acceptance -> draft step.

A steady-state DSpark step (every request generating, greedy, one verify width q) runs as one
captured graph per (batch bucket, q, continued), composed of the target runner's whole-step
entry (`CUDAGraphRunner`) and the drafter's device step (`DraftGraphRunner.draft_rows`)::

    target forward over [anchor, d1..d(q-1)] x bucket       -> logits [bucket*q, V] (lm_head dtype), captured rows
    best = argmax(logits)  [bucket, q]                       (greedy verify on the device; CUDA: `argmax_rows`)
    accepted = running match of the drafts with best         [bucket] 0..q-1 (0 on padding rows)
    verified = best where col <= accepted, else -1           [bucket, q]: the committed tokens
    draft step from (captured, verified, start + shift)      -> [bucket, 2 + K] [committed | anchor, drafts]
    output [bucket, q + 2 + K] = [verified | committed, anchor, drafts]: one private copy and
    one host copy per step serve both the host's read of the verify rows and the next step

The host stages only the target's inputs (`CUDAGraphRunner.load_inputs`: one pinned copy; a
continued step's shift and drafts are gathered on the device); the draft block reads the same
block tables (one page table addresses both pools) and its positions, slots and lengths are
computed in the graph. One replay per step, no rejection-sampler launches, no second staging.
The greedy rule equals `RejectionSampler`'s greedy rows: the accepted drafts equal `best` on
their columns, so `best` up to and including column `accepted` is the committed row.

Steps it does not take (a prompt chunk, a sampling request, mixed widths, a width the drafter has
no graph for, a page not owned) run the target graph and the draft graph separately. Without CUDA
graphs (`capture=False`: the CPU) the same step runs directly on the batch as it is.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..attention_backend.interface import AttentionMetadata
from ..runtime.cuda_graph import GraphCache, GraphEntry
from ..runtime.llm_request import LlmRequest
from ..runtime.step import DraftsAhead, ForwardOutput, ForwardSegment
from ..runtime.token_rows import PendingTokens
from ..speculative.draft_graph_runner import DraftGraphRunner
from .cuda_graph_runner import CUDAGraphRunner, StepPlan, TargetGraphEntry


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64 (`SpecStepGraph`'s argmax off CUDA)."""
    return x.argmax(-1)


def accept_rows(ids: torch.Tensor, best: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """ids [B, q] int64 verify segments [anchor, d1..d(q-1)], best [B, q] int64 the target's argmax
    per row, live [B] bool (False: a padding row, which commits one token) -> [B, q] int64: best up
    to and including the first mismatch, then -1. Pure, so inductor fuses it into one kernel."""
    accepted = (ids[:, 1:] == best[:, :-1]).long().cumprod(1).sum(1) * live    # [B] 0..q-1
    cols = torch.arange(ids.shape[1], device=ids.device)
    return torch.where(cols[None, :] <= accepted[:, None], best, -1)


@functools.cache
def compiled_accept_rows() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`accept_rows` compiled by inductor, once per process (a step with compiled regions)."""
    from ..modules.inductor_passes import compile_region
    return compile_region(accept_rows)


def greedy_verify(ids: torch.Tensor, logits: torch.Tensor, live: torch.Tensor,
                  argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
                  accept: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = accept_rows
                  ) -> torch.Tensor:
    """Greedy acceptance on the device (capturable): ids [B, q] int64 verify segments, logits
    [B, q, V] their target logits (any float dtype), live [B] bool -> [B, q] int64 (`accept_rows`).
    argmax: [N, V] -> [N] int64, torch's or `argmax_rows` (Triton, CUDA); accept: `accept_rows`
    or its compiled form."""
    best = argmax(logits.reshape(-1, logits.shape[-1])).view(ids.shape)       # [B, q]
    return accept(ids, best, live)


@dataclass
class SpecLaunch:
    """A launched one-graph DSpark step, before the host read it."""

    out: ForwardOutput           # row offsets only: no logits (verified here), no captured rows (drafted here)
    verify_width: int            # q: ahead.tokens[:, :q] int64 committed tokens per request, -1 padded
    ahead: DraftsAhead           # every request's next drafts and committed count, on the device (first=q)


@dataclass
class _SpecEntry(GraphEntry):
    """One (bucket, q, continued): the target entry (inputs) and the draft block's metadata over
    the target entry's block tables; output [bucket, q + 2 + K] (verified | draft rows)."""

    target: Optional[TargetGraphEntry] = None
    block_md: Optional[AttentionMetadata] = None


class SpecStepGraph:
    """Runs a steady-state DSpark step as one graph (module doc)."""

    def __init__(self, target: CUDAGraphRunner, draft: DraftGraphRunner):
        if target.kv is not draft.kv:
            raise ValueError("the target and draft runners must share one KV manager (one page table)")
        self.target, self.draft = target, draft
        self.graphs: GraphCache[_SpecEntry] = GraphCache(target.device, target.graphs.capture)
        self.num_launches = 0
        self.no_logits = torch.zeros(0, 1, device=target.device)   # every launch's (empty) logits
        # the verify argmax over the lm_head's own logits (bf16: no float32 copy of [bucket * q, V]);
        # on CUDA split over vocabulary tiles (torch reduces a row on one block: 13 us at batch 1)
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax
        if target.device.type == "cuda":
            from ..models.dspark_markov_kernel import argmax_rows
            self.argmax = argmax_rows
        # with compiled regions (torch_compile_config: the drafter's say so) the acceptance after the
        # argmax is one fused kernel instead of ~8 small ones
        regions = draft.drafter.regions
        self.accept = compiled_accept_rows() if regions is not None and regions.compiled else accept_rows

    def eligible(self, reqs: Sequence[LlmRequest], segments: Sequence[ForwardSegment]) -> bool:
        """Host-known per-request conditions (the target's plan adds the shape, bucket and page checks)."""
        if not segments:
            return False
        return len(segments[0].token_ids) in self.draft.widths and all(map(self.draft.takes, reqs))

    @torch.inference_mode()
    def run(self, reqs: Sequence[LlmRequest], segments: Sequence[ForwardSegment]) -> Optional[SpecLaunch]:
        """Launch the step (no wait on the GPU), or None when it is not one this graph takes."""
        if not self.eligible(reqs, segments):
            return None
        # the draft block after the furthest committed token must lie in owned pages too
        plan = self.target.plan(segments, extra=self.draft.block_size)
        if plan is None:
            return None
        bucket, q = plan.bucket, plan.q
        entry = self.graphs.entry((bucket, q, plan.shifted), lambda: self._new_entry(bucket, q, plan.shifted))
        self.target.load_inputs(entry.target, segments, plan)
        self.draft.prepare_block(entry.block_md, bucket, q, int(plan.starts.max()))
        rows = self.graphs.replay(entry, self._forward)
        self.num_launches += 1
        b = len(segments)
        self.draft.num_drafted += b
        n = b * q
        offsets = list(range(0, n, q))
        # no logits (the verify ran in the graph) and no captured rows (the graph drafted every request)
        out = ForwardOutput(self.no_logits, offsets, None, offsets)
        ahead = DraftsAhead({s.request_id: j for j, s in enumerate(segments)}, PendingTokens(rows[:b].clone()), q)
        return SpecLaunch(out, q, ahead)

    @torch.inference_mode()
    def capture_all(self, continued: bool) -> int:
        """Capture every (bucket, q[, continued]) entry now, on padding rows (the engine calls it once
        at startup). Returns how many were captured (0 without CUDA graphs)."""
        def stage(e: _SpecEntry) -> None:
            self.target.load_inputs(e.target, [], StepPlan.padding_only(e.target.bucket, e.target.q,
                                                                        e.target.shift is not None))
            self.draft.prepare_block(e.block_md, e.target.bucket, e.target.q, 0)
        keys = [(b, q, s) for b in self.target.buckets for q in sorted(self.draft.widths & self.target.token_counts)
                for s in ((False, True) if continued else (False,))]
        return sum(self.graphs.capture_ahead((b, q, s), lambda: self._new_entry(b, q, s), stage, self._forward)
                   for b, q, s in keys)

    def _new_entry(self, bucket: int, q: int, shifted: bool) -> _SpecEntry:
        t = self.target.new_entry(bucket, q, shifted)
        return _SpecEntry(target=t, block_md=self.draft.block_metadata(bucket, t.md.block_tables))

    def _forward(self, entry: _SpecEntry) -> torch.Tensor:
        t = entry.target
        logits, captured = self.target.forward(t, float_logits=False)
        if captured is None:
            raise ValueError("the one-graph DSpark step needs the target's captured hidden rows")
        start = t.positions.view(t.bucket, t.q)[:, 0]      # host starts: 0 only on padding rows (a
        live = start > 0                                   # generating request has its prompt before)
        verified = greedy_verify(t.input_ids.view(t.bucket, t.q), logits.view(t.bucket, t.q, -1), live,
                                 self.argmax, self.accept)
        if t.shift is not None:
            start = start + t.shift
        return torch.cat([verified, self.draft.draft_rows(captured, verified, start, entry.block_md)], 1)
