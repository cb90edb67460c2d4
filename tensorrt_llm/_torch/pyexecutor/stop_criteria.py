"""Stop criteria of a request as its committed tokens are appended (stop ids, max_tokens, stop strings)."""
from __future__ import annotations

from typing import Callable, Sequence

from ..runtime.llm_request import LlmRequest


def append_tokens(req: LlmRequest, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> list[int]:
    """Append newly committed tokens to the request's output in order, finishing it at the first stop
    id (not appended), at max_tokens, or when the decoded tail holds a stop string; returns the
    tokens appended."""
    p = req.sampling_params
    stop_ids, out = req.stop_token_set, req.output_token_ids
    if not p.stop and len(out) + len(tokens) < p.max_tokens and stop_ids.isdisjoint(tokens):
        out.extend(tokens)     # the common case: nothing here can finish the request
        return list(tokens)
    emitted: list[int] = []
    for tok in tokens:
        if tok in stop_ids:
            req.finish("stop")
            break
        out.append(tok)
        emitted.append(tok)
        if len(out) >= p.max_tokens:
            req.finish("length")
            break
        if p.stop and _hit_stop_string(req, decode):     # p.stop set <=> stop_strings non-empty
            req.finish("stop")
            break
    return emitted


def _hit_stop_string(req: LlmRequest, decode: Callable[[list[int]], str]) -> bool:
    stops = req.sampling_params.stop_strings
    window = max(len(s) for s in stops) + 8
    tail = decode(req.output_token_ids[-window:])
    return any(s in tail for s in stops)
