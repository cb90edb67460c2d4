"""A step's arrivals drafted before the host reads their first tokens.

With the overlap scheduler, a step whose chunks all end greedy prompts (alone, or leading verify
segments that all drafted ahead) launches each prompt's first drafts from its chosen id on the
device (`Drafter.draft_arrivals`). Beside a one-graph step (the running requests' verify, acceptance
and drafting in one CUDA graph) the prompts launch no draft step of their own: their rows carry the
chosen id and placeholder drafts (`Drafter.anchor_arrivals`), the next one-graph step verifies them
(committing the target's token after the chosen one) and drafts for them in its graph. That costs
an arrival the drafts of one step and saves the step with arrivals a draft launch. When the drafter takes every
request, each is advanced on the host as if its first token were read (generating, its count one
short of its prompt: the launch's `committed` is 1), so the next step continues it from the device
rows and the prompt step is read one step late (`SpecStep.arrivals_ahead`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..runtime.llm_request import LlmRequest, RequestState
from ..runtime.step import DraftsAhead, ForwardOutput, ForwardSegment, StepCommit
from ..speculative.interface import Drafter


def launch_arrivals(drafter: Drafter, reqs: list[LlmRequest], segments: list[ForwardSegment], out: ForwardOutput,
                    ids: torch.Tensor, beside_one_graph: bool = False) -> tuple[Optional[DraftsAhead], bool]:
    """reqs, segments: the step's prompt chunks; ids [len(reqs)]: the chosen token per request, on the
    device; beside_one_graph: the chunks run beside a one-graph step (their rows then carry placeholder
    drafts, `Drafter.anchor_arrivals`, where the drafter can: the next one-graph step drafts for them).
    Returns (the launch or None, whether it took every request: then the requests are advanced as
    above; otherwise they stay prompts until the step is read, as any prompt step's)."""
    if any(not s.num_logits for s in segments) or any(r.context_only or not r.sampling_params.greedy for r in reqs):
        return None, False
    for req in reqs:
        req.state = RequestState.GENERATION       # the draft step takes generating requests only
    ahead = None
    try:
        commits = [StepCommit(r, out.token_offsets[i], s.start, len(s.token_ids))
                   for i, (r, s) in enumerate(zip(reqs, segments))]
        if beside_one_graph:
            ahead = drafter.anchor_arrivals(commits, ids, out.captured)
        if ahead is None:
            ahead = drafter.draft_arrivals(commits, ids, out.captured)
    finally:
        whole = ahead is not None and len(ahead.rows) == len(reqs)
        for req, seg in zip(reqs, segments):
            if whole:
                req.num_computed = seg.start + len(seg.token_ids) - 1
            else:
                req.state = RequestState.CONTEXT
    return ahead, whole
