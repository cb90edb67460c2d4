"""PyExecutor: the loop `scheduler.schedule()` -> `model_engine.forward()` -> sample/verify -> update.

Runs in a background thread (`start()`), or step by step (`step()`) for tests. A
request that fails (bad input found late, an exception in its own post-processing) is
finished with an error; the loop keeps serving the others.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Callable, Optional, Sequence

from ..speculative.pending_drafts import DraftRow, VerifyTokens
from .llm_request import LlmRequest, RequestState
from .model_engine import ForwardOutput, ForwardSegment, ModelEngine
from .resource_manager import KVCacheManager
from .sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger("tensorrt_llm")

UpdateCallback = Callable[[LlmRequest, list[int]], None]


class PyExecutor:
    def __init__(self, engine: ModelEngine, scheduler: Scheduler, sampler: Sampler, kv: KVCacheManager,
                 decode: Callable[[Sequence[int]], str], spec_worker=None):
        self.engine, self.scheduler, self.sampler, self.kv = engine, scheduler, sampler, kv
        self.decode = decode
        self.spec = spec_worker
        # each item is one group of requests that reaches the scheduler in one drain
        self._incoming: "queue.Queue[list[tuple[LlmRequest, UpdateCallback]]]" = queue.Queue()
        self._callbacks: dict[int, UpdateCallback] = {}
        self._final_notices: Optional[list[tuple[LlmRequest, list[int]]]] = None   # inside a step
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.iterations = 0
        self.fatal_error: Optional[str] = None

    # ---- submission --------------------------------------------------------------------
    def enqueue_request(self, req: LlmRequest, on_update: UpdateCallback) -> None:
        self.enqueue_requests([(req, on_update)])

    def enqueue_requests(self, items: Sequence[tuple[LlmRequest, UpdateCallback]]) -> None:
        """Submit requests as one group: the loop admits all of them before its next step, so the
        batches of one `LLM.generate` call do not depend on how fast the caller submitted them."""
        if self.fatal_error is not None:
            raise RuntimeError(f"executor stopped after a fatal error: {self.fatal_error}")
        if items:
            self._incoming.put(list(items))
            self._wake.set()

    def _drain_incoming(self) -> None:
        while True:
            try:
                group = self._incoming.get_nowait()
            except queue.Empty:
                return
            for req, cb in group:
                self._callbacks[req.request_id] = cb
                self.scheduler.add(req)

    # ---- loop --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="PyExecutor", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_incoming()
            if not self.scheduler.has_work:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a bug in the step itself: fail all in-flight requests
                self.fatal_error = f"{type(e).__name__}: {e}"
                logger.error("executor step failed:\n%s", traceback.format_exc())
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    req.error = self.fatal_error
                    req.finish("error")
                    self._notify(req, [])
                self.scheduler.running.clear()
                self.scheduler.waiting.clear()
                return

    def run_until_idle(self) -> None:
        """Synchronous driver (tests, offline)."""
        self._drain_incoming()
        while self.scheduler.has_work:
            self.step()
            self._drain_incoming()

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.scheduler.waiting and not self.scheduler.running:
                req = self.scheduler.waiting.popleft()
                req.error = "request can never fit in the KV cache"
                req.finish("error")
                self._notify(req, [])
            return
        self.iterations += 1
        # A request's final notice waits until its pages are back in the pool, so a caller that
        # sees it finished also sees its KV freed (no race with the next request's admission).
        self._final_notices = []
        try:
            reqs, segments = self._build_segments(batch)
            out = self.engine.forward(segments)
            committed = self._update_requests(reqs, segments, len(batch.context_requests), out)
            if self.spec is not None:
                self.spec.draft_step(committed, out.captured, self.kv)
            for req in self.scheduler.remove_finished():
                self.sampler.release(req.request_id)
                if self.spec is not None:
                    self.spec.release(req)
        finally:
            notices, self._final_notices = self._final_notices, None
            for req, tokens in notices:
                self._deliver(req, tokens)

    def _build_segments(self, batch: ScheduledBatch) -> tuple[list[LlmRequest], list[ForwardSegment]]:
        """Requests of the step (prompt chunks first) and their forward segments; owns their pages."""
        segments: list[ForwardSegment] = []
        ensure = self.kv.ensure_capacity
        for req, n in zip(batch.context_requests, batch.context_chunks):
            start = req.num_computed
            finishes = start + n >= req.prompt_len
            ensure(req.request_id, start + n + self._draft_room(finishes))
            segments.append(ForwardSegment(req.request_id, req.prompt_token_ids[start:start + n],
                                           start, 1 if finishes else 0))
        room = self._draft_room(True)
        for req in batch.generation_requests:
            start = req.num_computed
            drafts = req.draft_tokens
            if isinstance(drafts, DraftRow):   # still on the device: the graph gathers them there
                toks = VerifyTokens(req.token_at(start), drafts)
            else:
                toks = [req.token_at(start)]
                toks.extend(drafts)
            ensure(req.request_id, start + len(toks) + room)
            segments.append(ForwardSegment(req.request_id, toks, start, len(toks)))
        return batch.context_requests + batch.generation_requests, segments

    def _update_requests(self, reqs: list[LlmRequest], segments: list[ForwardSegment], num_ctx: int,
                         out: ForwardOutput) -> list[tuple[LlmRequest, int, int, int]]:
        """Sample / verify, append, stop, notify and publish blocks; returns what the drafter
        needs, (req, row0, start, n) per request (empty without a drafter)."""
        spec, kv = self.spec, self.kv
        # One device->host sync for every token choice of the step: the argmax of every row, with
        # the rows of sampling requests (prompt ends, and plain decode steps) overwritten by draws.
        rows = [(out.logits_offsets[i], req) for i, (req, seg) in enumerate(zip(reqs, segments))
                if not req.sampling_params.greedy and (i < num_ctx and seg.num_logits or i >= num_ctx and spec is None)]
        row_ids = self.sampler.choose(out.logits, [r for r, _ in rows], [q.request_id for _, q in rows],
                                         [q.sampling_params for _, q in rows]).tolist() if out.logits.shape[0] else []
        verified: dict[int, list[int]] = {}
        if spec is not None and spec.verifies_in_batch and len(reqs) > num_ctx:
            # the "batched" rejection sampler verifies every sampling request of the step at once;
            # if that fails, each request is verified alone below (so only a bad one fails)
            try:
                verified = spec.verify_batch([
                    (req, out.logits[out.logits_offsets[i]:out.logits_offsets[i] + seg.num_logits])
                    for i, (req, seg) in enumerate(zip(reqs, segments)) if i >= num_ctx])
            except Exception as e:
                logger.warning("batched verification failed (%s: %s); verifying one request at a time",
                               type(e).__name__, e)
        committed: list[tuple[LlmRequest, int, int, int]] = []
        publish = spec is None and kv.pool.enable_reuse   # with a drafter, draft_step commits
        for i, (req, seg) in enumerate(zip(reqs, segments)):
            lo = out.logits_offsets[i]
            try:
                if i < num_ctx:
                    req.num_computed += len(seg.token_ids)
                    if spec is not None:
                        committed.append((req, out.token_offsets[i], seg.start, len(seg.token_ids)))
                    if seg.num_logits:
                        tok = row_ids[lo]
                        req.state = RequestState.GENERATION
                        if req.first_token_time is None:
                            req.first_token_time = time.perf_counter()
                        self._append(req, [tok])
                elif spec is None:
                    req.num_computed += 1
                    self._append(req, [row_ids[lo]])
                else:
                    n = seg.num_logits
                    new = spec.accept(req, out.logits[lo:lo + n], row_ids[lo:lo + n],
                                      verified.get(req.request_id))
                    req.num_computed += len(new)
                    committed.append((req, out.token_offsets[i], seg.start, len(new)))
                    self._append(req, new)
                if i >= num_ctx and req.state is RequestState.FINISHED:
                    # a stop drops the token(s) after it (only a finished request drops any)
                    req.num_computed = min(req.num_computed, req.num_tokens)
                if publish and kv.wants_commit(req.request_id, req.num_computed):
                    kv.commit(req.request_id, req.all_token_ids, req.num_computed)
            except Exception as e:
                req.error = f"{type(e).__name__}: {e}"
                logger.error("request %d failed: %s", req.request_id, req.error)
                req.finish("error")
                self._notify(req, [])
        return committed

    def _draft_room(self, generating: bool) -> int:
        return self.spec.lookahead_tokens if (self.spec is not None and generating) else 0

    def _append(self, req: LlmRequest, tokens: list[int]) -> None:
        """Append newly committed tokens, applying stop criteria in order."""
        p = req.sampling_params
        stop_ids, out = req.stop_token_set, req.output_token_ids
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
            if p.stop and self._hit_stop_string(req):     # p.stop set <=> stop_strings non-empty
                req.finish("stop")
                break
            if req.context_only:
                req.finish("context_done")
                break
        self._notify(req, emitted)

    def _hit_stop_string(self, req: LlmRequest) -> bool:
        stops = req.sampling_params.stop_strings
        window = max(len(s) for s in stops) + 8
        tail = self.decode(req.output_token_ids[-window:])
        return any(s in tail for s in stops)

    def _notify(self, req: LlmRequest, new_tokens: list[int]) -> None:
        if req.is_finished and self._final_notices is not None:
            self._final_notices.append((req, new_tokens))   # delivered at the end of the step
        else:
            self._deliver(req, new_tokens)

    def _deliver(self, req: LlmRequest, new_tokens: list[int]) -> None:
        cb = self._callbacks.get(req.request_id)
        if cb is not None:
            cb(req, new_tokens)
        if req.is_finished:
            self._callbacks.pop(req.request_id, None)
