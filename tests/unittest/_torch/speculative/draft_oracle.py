"""Oracle drafts on every draft path (test fixture): the eager draft step, the device draft step
and the one-graph DSpark step.

`drafts_for(req, anchor_pos, k)` returns the k drafts that should follow the anchor at absolute
position `anchor_pos` (or None to keep the drafter's own). On the device path the anchor position
is read from the launched rows (CPU only: start + shift + committed), since the host has not
read the verify rows yet when the drafts are launched.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tensorrt_llm._torch.runtime.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_step_graph import SpecStepGraph
from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker

DraftsFor = Callable[[LlmRequest, int, int], Optional[list[int]]]


def patch_draft_oracles(monkeypatch, drafts_for: DraftsFor) -> None:
    orig_group, orig_launch, orig_step = DSparkWorker._draft_group, DraftGraphRunner.launch, SpecStepGraph.run

    def eager(self, reqs, s):
        orig_group(self, reqs, s)
        for req in reqs:
            k = len(req.draft_tokens)
            d = drafts_for(req, req.num_computed, k) if k else None
            if d is not None:
                req.draft_tokens = list(d)

    def overwrite(ahead, reqs, starts, shifts):
        t, f = ahead.tokens.device, ahead.first     # on the CPU: the host copy is this tensor
        for req, start, shift in zip(reqs, starts, shifts):
            row = ahead.rows.get(req.request_id)
            if row is None:
                continue
            shift = shift.tolist()[0] if shift is not None else 0
            d = drafts_for(req, start + shift + int(t[row, f]), t.shape[1] - f - 2)
            if d is not None:
                with torch.inference_mode():
                    t[row, f + 2:] = torch.tensor(d, dtype=t.dtype)

    def device(self, items, counts, verified, captured):
        ahead = orig_launch(self, items, counts, verified, captured)
        if ahead is not None:
            overwrite(ahead, [it.req for it in items], [it.start for it in items], [it.start_shift for it in items])
        return ahead

    def one_graph(self, reqs, segments):
        launch = orig_step(self, reqs, segments)
        if launch is not None:
            overwrite(launch.ahead, reqs, [s.start for s in segments], [s.start_shift for s in segments])
        return launch

    monkeypatch.setattr(DSparkWorker, "_draft_group", eager)
    monkeypatch.setattr(DraftGraphRunner, "launch", device)
    monkeypatch.setattr(SpecStepGraph, "run", one_graph)


def future_drafts(truth: dict[tuple, list[int]], salt: int = 0,
                  select: Callable[[LlmRequest], bool] = lambda r: True) -> DraftsFor:
    """Drafts = the no-spec future (truth: prompt -> greedy output), wrong after a prefix whose
    length is a hash of (request prompt, position, salt): the same drafts whatever path or step
    order asks, so acceptance is reproducible across schedules."""
    def drafts_for(req: LlmRequest, pos: int, k: int) -> Optional[list[int]]:
        fut = truth.get(tuple(req.prompt_token_ids))
        if fut is None or not select(req):
            return None
        full = list(req.prompt_token_ids) + list(fut)
        want = full[pos + 1:pos + 1 + k]
        keep = hash((tuple(req.prompt_token_ids), pos, salt)) % (k + 1)
        d = want[:keep] + [(t + 1) % 512 for t in want[keep:]]
        return (d + [7] * k)[:k]
    return drafts_for
