"""Step types that cross package lines: what the executor runs and what a step commits.

    ForwardSegment : one request's tokens for a forward (prompt chunk or [anchor, d1..dK])
    ForwardOutput  : logits rows of the wanted positions + captured hidden rows, per segment
    StepCommit     : a request's newly committed tokens and where their captured rows are
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .llm_request import LlmRequest


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


@dataclass(frozen=True)
class StepCommit:
    """Tokens a step committed for one request (their target KV is written).

    Positions start..start+count-1 are committed; their captured target hidden states are the
    rows row0..row0+count-1 of the step's `ForwardOutput.captured` (a verify segment has more
    captured rows than it commits: the rejected drafts' rows follow).
    """

    req: LlmRequest
    row0: int       # first captured row of the request's segment
    start: int      # first committed position
    count: int      # committed tokens (>= 0; 0 when a request failed or stopped before its first)
