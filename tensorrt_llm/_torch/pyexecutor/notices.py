"""Update notices: how the executor tells callers about their requests (one callback per request).

A streaming request's callback gets every notice (the step's new tokens); any other request's only
the final one, once it has finished. Inside `held()` (a step) notices wait for the end of the block:
after the next GPU work is launched, and a final notice after the request's pages are back in the
pool (a caller that sees it finished also sees its KV freed). Outside it they are delivered at once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from ..runtime.llm_request import LlmRequest

UpdateCallback = Callable[[LlmRequest, list[int]], None]


class Notices:
    def __init__(self):
        self._callbacks: dict[int, UpdateCallback] = {}
        self._held: Optional[list[tuple[LlmRequest, list[int]]]] = None

    def register(self, request_id: int, callback: UpdateCallback) -> None:
        self._callbacks[request_id] = callback

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the notices of the block and deliver them in order at its end (also on an error);
        a block inside a held one adds to it."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            notices, self._held = self._held, None
            for req, tokens in notices:
                self.deliver(req, tokens)

    def notify(self, req: LlmRequest, new_tokens: list[int]) -> None:
        if not (req.streaming or req.is_finished):
            return          # every way a request finishes notifies it again
        if self._held is not None:
            self._held.append((req, new_tokens))
        else:
            self.deliver(req, new_tokens)

    def deliver(self, req: LlmRequest, new_tokens: list[int]) -> None:
        """The request's callback now: every notice of a streaming request, else only the final one."""
        finished = req.is_finished
        if not (finished or req.streaming):
            return
        cb = self._callbacks.pop(req.request_id, None) if finished else self._callbacks.get(req.request_id)
        if cb is not None:
            cb(req, new_tokens)
