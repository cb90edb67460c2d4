"""Request outputs and the handle returned by `generate_async` (sync, async and streaming)."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .detokenizer import IncrementalDetokenizer
from .loop_handoff import LoopHandoff


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None   # "stop" | "length" | "aborted" | "error" | None while running
    error: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # ttft_s, e2e_s, num_cached_prompt_tokens; with speculation also num_verify_steps,
    # num_accepted_drafts and acceptance_length (None when no verify step ran)
    metrics: dict = field(default_factory=dict)
    # a finished context-only request (disaggregated CTX): {"first_token", "draft_tokens"}
    disaggregated_params: Optional[dict] = None


class GenerationResult:
    """Handle of one request. `.result()` blocks; `async for` streams; `await .aresult()`."""

    def __init__(self, request_id: int, prompt: Optional[str], prompt_token_ids: list[int],
                 decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str],
                 include_stop_str: bool, streaming: bool,
                 abort: Optional[Callable[[int], None]] = None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._abort = abort              # the engine's abort-by-request-id
        self._stream_interval = stream_interval
        self._updates = 0                # steps that gave this request tokens (streaming)
        self._out = RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(0)])
        self._decode = decode
        self._stops = list(stop_strings)
        self._include_stop = include_stop_str
        self._done = threading.Event()
        self._stream: Optional[queue.Queue] = queue.Queue() if streaming else None
        # streamed snapshots are detokenized incrementally; the final text is one full decode
        self._detok: Optional[IncrementalDetokenizer] = IncrementalDetokenizer(decode) if streaming else None
        # an asyncio consumer (`async for`, `aresult`, the server): the executor thread hands it
        # snapshots through its loop's `LoopHandoff` (one wake-up per step, not per request), so
        # no thread waits per request
        self._lock = threading.Lock()
        self._handoff: Optional[LoopHandoff] = None
        self._aqueue: Optional[asyncio.Queue] = None

    @property
    def request_id(self) -> int:
        return self._out.request_id

    # called from the executor thread
    def _update(self, req, new_tokens: list[int]) -> None:
        finished = req.is_finished
        if self._stream is None and not finished:
            return      # detokenize only when someone can see it (hot path of every step)
        streaming = self._stream is not None and (new_tokens or finished)
        if not (streaming or finished):
            return
        if not finished:   # the first step's snapshot, then one every stream_interval steps, and the last
            self._updates += 1
            if (self._updates - 1) % self._stream_interval:
                return
        c = self._out.outputs[0]
        c.token_ids = list(req.output_token_ids)    # a new list each time: snapshots may share it
        if not finished:
            c.text = self._detok.update(c.token_ids)
        else:
            c.text = self._text(c.token_ids, req.finish_reason == "stop")
            c.finish_reason = "error" if req.error else req.finish_reason
            c.error = req.error
            self._out.finished = True
            m = self._out.metrics
            if req.first_token_time is not None:
                m["ttft_s"] = req.first_token_time - req.arrival_time
            if req.finish_time is not None:
                m["e2e_s"] = req.finish_time - req.arrival_time
            m["num_cached_prompt_tokens"] = req.num_cached_prompt
            m["num_verify_steps"] = req.num_verify_steps
            m["num_accepted_drafts"] = req.num_accepted_drafts
            m["acceptance_length"] = req.acceptance_length
            if req.context_only and req.finish_reason == "context":
                self._out.disaggregated_params = {"first_token": req.output_token_ids[0],
                                                  "draft_tokens": [int(t) for t in req.draft_tokens]}
        snap = self._snapshot() if streaming else None
        with self._lock:
            if self._aqueue is not None:
                self._to_loop(snap if streaming else self._out)
            elif streaming:
                self._stream.put(snap)
            if finished:
                self._done.set()

    def _to_loop(self, item: RequestOutput) -> None:
        self._handoff.post(self._aqueue, item)

    def _bind_loop(self) -> asyncio.Queue:
        """The asyncio.Queue of the running loop that receives this handle's snapshots (streaming)
        or its final output; what arrived before binding is moved into it. One async consumer."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._aqueue is not None:
                raise RuntimeError(f"request {self.request_id} already has an asyncio consumer")
            if self._stream is not None:
                while not self._stream.empty():
                    q.put_nowait(self._stream.get_nowait())
            elif self._done.is_set():
                q.put_nowait(self._out)
            self._handoff, self._aqueue = LoopHandoff.for_loop(asyncio.get_running_loop()), q
        return q

    def _text(self, ids: list[int], stopped: bool) -> str:
        text = self._decode(ids)
        hits = [(text.find(s), s) for s in self._stops if s in text] if stopped else []
        if hits:
            i, s = min(hits)
            text = text[:i + (len(s) if self._include_stop else 0)]
        return text

    def _snapshot(self) -> RequestOutput:
        c = self._out.outputs[0]
        return RequestOutput(self._out.request_id, self._out.prompt, self._out.prompt_token_ids,
                             [CompletionOutput(0, c.text, c.token_ids, c.finish_reason, c.error)],
                             self._out.finished, dict(self._out.metrics))

    def abort(self) -> None:
        """Cancel this request (TensorRT-LLM's `RequestOutput.abort()`), honoured at the engine's
        next step: `result()` then returns the tokens so far with finish_reason "aborted" (no
        exception) and the request's KV pages are freed. No effect once it has finished."""
        if self._abort is None:
            raise RuntimeError(f"request {self.request_id} was not made by an LLM; nothing can abort it")
        self._abort(self.request_id)

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes (at most `timeout` s: TimeoutError after that)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self._out

    async def aresult(self) -> RequestOutput:
        q = self._bind_loop()
        while not (await q.get()).finished:
            pass
        return self._out

    def __iter__(self):
        if self._stream is None:
            yield self.result()
            return
        while True:
            snap = self._stream.get()
            yield snap
            if snap.finished:
                return

    def __aiter__(self):
        return self._agen()

    async def _agen(self):
        if self._stream is None:
            yield await self.aresult()
            return
        q = self._bind_loop()
        while True:
            snap = await q.get()
            yield snap
            if snap.finished:
                return
