"""Launched steps whose results the executor reads later (the overlap scheduler's in-flight steps)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from ..runtime.llm_request import LlmRequest
from ..runtime.step import DraftsAhead, ForwardOutput, ForwardSegment
from ..runtime.token_rows import PendingTokens


@dataclass
class OverlapStep:
    """A launched step whose tokens are not read yet: the requests that chose a token, their rows
    of `tokens` ([N, 1] on the device, host copy under way)."""

    reqs: list[LlmRequest]
    row_index: list[int]
    tokens: Optional[PendingTokens]

    def wait(self) -> None:
        """Wait for this step's host copy (`rows` then reads it without waiting)."""
        if self.tokens is not None:
            self.tokens.rows()

    def rows(self) -> list[list[int]]:
        """[token] per request, in order (waits for this step's host copy only)."""
        host = self.tokens.rows() if self.tokens is not None else []
        return [host[i] for i in self.row_index]


def last_token_pending(req: LlmRequest) -> bool:
    """The request's device-resident token is its max_tokens-th: nothing to launch for it."""
    return req.next_input is not None and len(req.output_token_ids) + 1 >= req.sampling_params.max_tokens


@dataclass
class SpecStep:
    """A launched step with a drafter (its choices queued on the device, their host copy under way):
    what reading and applying it needs."""

    reqs: list[LlmRequest]
    segments: list[ForwardSegment]
    num_ctx: int
    out: ForwardOutput
    # chosen ids and verify rows: [1, num_chosen + len(live) * verify_width], or (a one-graph step,
    # `row_per_request`) [len(reqs), W]: row i is reqs[i]'s, a prompt's chosen id in column 0, a verify
    # row in the first verify_width columns
    copy: Optional[PendingTokens]
    num_chosen: int
    live: list[int]                    # indices into reqs of the verify rows, in order
    verify_width: int
    ahead: Optional[DraftsAhead]       # the next drafts, launched from the device-side verify rows
    # a step whose every prompt chunk ends a prompt that `ahead` drafted from its chosen id on the device
    # (they continue from those rows: generating, each one position short of its prompt on the host)
    arrivals_ahead: bool = False
    row_per_request: bool = False

    @property
    def parts(self) -> list["SpecStep"]:
        return [self]

    def wait(self) -> None:
        """Wait for this step's host copy (`read` then parses it without waiting)."""
        if self.copy is not None:
            self.copy.rows()

    def read(self) -> tuple[list[int], list[Optional[list[int]]]]:
        """(chosen id per logits row of the prompt ends; per request of `reqs` its verify row without
        padding, None when it has none): waits for this step's host copy only."""
        rows = self.copy.rows() if self.copy is not None else [[]]
        n, k1, flat = self.num_chosen, self.verify_width, rows[0]
        verified: list[Optional[list[int]]] = [None] * len(self.reqs)
        per_request = self.row_per_request
        for j, i in enumerate(self.live):
            row = rows[i][:k1] if per_request else flat[n + j * k1:n + (j + 1) * k1]
            verified[i] = row[:row.index(-1)] if -1 in row else row
        return ([rows[i][0] for i in range(n)] if per_request else flat[:n]), verified

    @property
    def deferrable(self) -> bool:
        """Its reading may wait a step: every verified request drafted ahead (its next segment can be
        launched from the device rows), and no prompt chunk unless every arrival was (`arrivals_ahead`)."""
        if self.num_ctx and not self.arrivals_ahead:
            return False
        if not self.live:
            return self.num_ctx > 0
        if self.ahead is None:
            return False
        reqs, rows = self.reqs, self.ahead.rows
        return all(reqs[i].request_id in rows for i in self.live)

    def continuable(self, gens: Sequence[LlmRequest]) -> tuple[list[LlmRequest], bool]:
        """(the generating requests the next step may launch before this step is read: those not in
        it, and those it drafted ahead unless it may finish them by length; whether any of them
        continues a segment of this step)."""
        reqs, segments = self.reqs, self.segments
        in_step = {reqs[i].request_id: len(segments[i].token_ids) for i in self.live}
        if self.arrivals_ahead:    # each arrival's step commits its first token
            in_step.update((reqs[i].request_id, 1) for i in range(self.num_ctx))
        rows = self.ahead.rows if self.ahead is not None else {}
        kept = [r for r in gens if (q := in_step.get(r.request_id)) is None
                or (r.request_id in rows and len(r.output_token_ids) + q < r.sampling_params.max_tokens)]
        return kept, any(r.request_id in in_step for r in kept)


@dataclass
class SpecSteps:
    """DSpark steps launched in one executor iteration and read together, in order: a step's prompt
    chunks in their own (packed) graph beside its continued verify segments' one-graph step."""

    parts: list[SpecStep]

    @functools.cached_property
    def ahead(self) -> Optional[DraftsAhead]:
        """The parts' drafts ahead as one (joined when the next step continues from them)."""
        aheads = [p.ahead for p in self.parts if p.ahead is not None]
        return functools.reduce(DraftsAhead.join, aheads) if aheads else None

    @property
    def num_ctx(self) -> int:
        return sum(p.num_ctx for p in self.parts)

    @property
    def deferrable(self) -> bool:
        return all(p.deferrable for p in self.parts)

    def continuable(self, gens: Sequence[LlmRequest]) -> tuple[list[LlmRequest], bool]:
        """`SpecStep.continuable` over every part (each request is in one part at most)."""
        kept, continuing = list(gens), False
        for p in self.parts:
            kept, c = p.continuable(kept)
            continuing = continuing or c
        return kept, continuing
