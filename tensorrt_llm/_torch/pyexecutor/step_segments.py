"""The forward segments of a step: one per scheduled request, prompt chunks first.

    prompt chunk  : prompt tokens start..start+n-1 (a logit only for the prompt's last token)
    generation    : [anchor, d1..dn] (verify), or the one next token; a request the DSpark step in
                    flight drafted ahead continues from that step's device rows (`start_shift`)

Building them also gives every request the pages its segment (and, at a prompt's end or in a
verify step, the draft block after it) writes.
"""
from __future__ import annotations

from typing import Optional

from ..runtime.step import DraftsAhead, ForwardSegment
from ..speculative.interface import Drafter
from .kv_cache.resource_manager import KVCacheManager
from .scheduler import ScheduledBatch


def build_segments(batch: ScheduledBatch, kv: KVCacheManager, drafter: Optional[Drafter],
                   ahead: Optional[DraftsAhead]) -> list[ForwardSegment]:
    """Segments of batch.context_requests + batch.generation_requests, in that order; ahead: the
    drafts the DSpark step in flight launched (its requests continue from them), or None."""
    segments: list[ForwardSegment] = []
    ensure = kv.ensure_capacity      # returns at once when the pages suffice (most requests, most steps)
    room = drafter.lookahead_tokens if drafter is not None else 0
    for req, n in zip(batch.context_requests, batch.context_chunks):
        start = req.num_computed
        finishes = start + n >= req.prompt_len
        ensure(req.request_id, start + n + (room if finishes else 0))
        segments.append(ForwardSegment(req.request_id, req.prompt_token_ids[start:start + n],
                                       start, 1 if finishes else 0))
    continued = ahead.rows if ahead is not None else {}
    gens = batch.generation_requests
    n = drafter.draft_len(len(gens)) if drafter is not None else 0
    late = 1 + drafter.max_draft_len if drafter is not None else 0   # most a continued start lags
    for req in gens:
        rid, start = req.request_id, req.num_computed
        if rid in continued:   # [anchor, drafts] and the count the step in flight commits, on the device
            seg, lag = ahead.continued_segment(rid, start, n), late
        else:
            if drafter is not None:
                toks = drafter.verify_tokens(req, n)
            else:   # overlap: the previous step's token is still on the device
                toks = req.next_input if req.next_input is not None else [req.token_at(start)]
            seg, lag = ForwardSegment(rid, toks, start, len(toks)), 0
        ensure(rid, start + seg.num_logits + lag + room)    # a generation segment: a logit per token
        segments.append(seg)
    return segments
