"""Step types that cross package lines: what the executor runs and what a step commits.

    ForwardSegment : one request's tokens for a forward (prompt chunk or [anchor, d1..dK])
    ForwardOutput  : logits rows of the wanted positions + captured hidden rows, per segment
    StepCommit     : a request's newly committed tokens and where their captured rows are
    VerifiedSegment: a verify segment whose acceptance is still on the device
    DraftsAhead    : drafts launched from device-side acceptance before the host read it
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .llm_request import LlmRequest
from .token_rows import PendingTokens, TokenRow


@dataclass
class ForwardSegment:
    """Tokens of one request for this step, at absolute positions start..start+len-1."""

    request_id: int
    token_ids: Sequence[int]   # a list, or `VerifyTokens` / a `TokenRow` still on the device
    start: int          # == tokens already in the target pages (plus start_shift when set)
    num_logits: int     # logits wanted for the last `num_logits` tokens
    # a continued verify segment (the overlap scheduler): the tokens committed by the step still
    # in flight, one id on the device; the segment starts at start + that count (1..len(token_ids))
    start_shift: Optional[TokenRow] = None


@dataclass
class ForwardOutput:
    """Outputs of one step, packed in segment order (offsets are per segment)."""

    logits: torch.Tensor                  # [sum(num_logits), V] float32
    logits_offsets: list[int]             # row offset of each segment's logits
    captured: Optional[torch.Tensor]      # [T, n*H] captured target hidden (concat), or None
    token_offsets: list[int]              # first row of each segment's tokens in `captured`
    # the leading prompt segments whose draft context this forward wrote (the packed-step graph with
    # the drafter's `write_forward_context`); the drafter writes the others' after the step
    context_segments: int = 0


class StepCommit(NamedTuple):
    """Tokens a step committed for one request (their target KV is written).

    Positions start..start+count-1 are committed; their captured target hidden states are the
    rows row0..row0+count-1 of the step's `ForwardOutput.captured` (a verify segment has more
    captured rows than it commits: the rejected drafts' rows follow). Immutable and made per
    request per step: a NamedTuple (a frozen dataclass costs three times as much to build).
    """

    req: LlmRequest
    row0: int       # first captured row of the request's segment
    start: int      # first committed position
    count: int      # committed tokens (>= 0; 0 when a request failed or stopped before its first)


@dataclass(frozen=True)
class VerifiedSegment:
    """A generation request's verify segment after the verify step, before the host reads it:
    its committed count is row `verify_row` of the step's verify output [G, K+1] (on the device)."""

    req: LlmRequest
    row0: int        # first captured row of its segment
    start: int       # position of its anchor (its first committed position), plus start_shift
    num_tokens: int  # tokens (= captured rows) of its segment: 1 + its drafts
    verify_row: int  # its row in the verify output
    start_shift: Optional[TokenRow] = None   # its segment's `ForwardSegment.start_shift`


@dataclass(frozen=True)
class DraftsAhead:
    """What the draft step launched from the verify output (before the host read it) left on the
    device: request id -> its row of `tokens` [G, first + 2 + K] int64::

        [ (first columns) | committed | anchor d1 .. dK ]
            committed: tokens its verify step committed (1..K+1); anchor: the last of them;
            d1..dK: its next drafts; the first columns hold the producer's other outputs (the
            one-graph step's verify rows: one host copy for both)

    The draft context of its committed tokens is written too. The next verify segment
    [anchor, d1..dK] starts `committed` positions after the verified one: the overlap scheduler
    launches it from these rows before the host has read them."""

    rows: dict[int, int]
    tokens: PendingTokens
    first: int = 0       # column of `committed`

    def join(self, other: "DraftsAhead") -> "DraftsAhead":
        """Both launches' rows as one, from their `committed` columns on (first = 0; one device copy,
        the host rows read from both launches' own copies): the launches of one executor step (verify
        segments and arrivals). ValueError when their rows differ after that column or a request is
        in both."""
        a, b = self.tokens.width - self.first, other.tokens.width - other.first
        if a != b:
            raise ValueError(f"drafts ahead of different layouts: {a} / {b} columns from the committed count on")
        both = self.rows.keys() & other.rows.keys()
        if both:
            raise ValueError(f"requests {sorted(both)[:8]} were drafted ahead twice in one step")
        n = self.tokens.num_rows
        rows = {**self.rows, **{rid: n + j for rid, j in other.rows.items()}}
        return DraftsAhead(rows, PendingTokens.stacked([(self.tokens, self.first), (other.tokens, other.first)]))

    def drafts(self, request_id: int) -> TokenRow:
        """[d1..dK] of a request."""
        return TokenRow(self.tokens, self.rows[request_id], self.tokens.width - self.first - 2, self.first + 2)

    def continued_segment(self, request_id: int, start: int, num_drafts: int) -> ForwardSegment:
        """The request's next verify segment [anchor, d1..dn] (its first n drafts) at host start
        `start`, continued from these rows: its start shift is [committed] (both on the device)."""
        j, k, f = self.rows[request_id], 1 + num_drafts, self.first
        return ForwardSegment(request_id, TokenRow(self.tokens, j, k, f + 1), start, k, TokenRow(self.tokens, j, 1, f))
