"""PyExecutor: the loop `scheduler.schedule()` -> `model_engine.forward()` -> choose / verify ->
update + `kv.commit` -> `drafter.draft()`.

Runs in a background thread (`start()`), or step by step (`step()`) for tests. Speculation is
reached only through `speculative.interface.Drafter`. Fault isolation: an error that belongs to
one request (admission, its verify rows, its draft step, its post-processing) finishes that
request alone with the error; a non-device error in a step's forward fails that step's
requests (where prompt chunks ran beside generation, the prompts alone: the rest runs on); a
device fault (CUDA error, out of memory) fails every in-flight request, and every later call
raises at once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..runtime.device import is_device_fault, isolated
from ..runtime.llm_request import LlmRequest, RequestState
from ..runtime.sampler import Sampler
from ..runtime.step import ForwardOutput, ForwardSegment, StepCommit, VerifiedSegment
from ..runtime.token_rows import PendingTokens, segment_drafts
from ..speculative.interface import Drafter
from .arrival_drafts import launch_arrivals
from .kv_cache.resource_manager import KVCacheManager
from .model_engine import ModelEngine
from .notices import Notices, UpdateCallback
from .inflight_steps import OverlapStep, SpecStep, SpecSteps, last_token_pending
from .scheduler import ScheduledBatch, Scheduler
from .step_watchdog import StepWatchdog
from .step_segments import build_segments
from .stop_criteria import append_tokens

if TYPE_CHECKING:
    from .spec_step_graph import SpecLaunch

logger = logging.getLogger("tensorrt_llm")


class PyExecutor:
    def __init__(self, engine: ModelEngine, scheduler: Scheduler, sampler: Sampler, kv: KVCacheManager,
                 decode: Callable[[Sequence[int]], str], drafter: Optional[Drafter] = None,
                 overlap: bool = False, step_timeout_s: Optional[float] = None):
        """overlap: run the overlap scheduler: non-speculative steps (`OverlapStep`), and DSpark steps
        when the drafter drafts on the device and the backend reads KV lengths there (`SpecStep`);
        step_timeout_s: a step of the loop thread running longer ends the engine (`StepWatchdog`)."""
        self.engine, self.scheduler, self.sampler, self.kv = engine, scheduler, sampler, kv
        self.decode = decode
        self.drafter = drafter
        self.overlap = overlap and drafter is None
        # DSpark steps overlap when the next verify step can be launched from device-side rows: the
        # drafter launches its drafts there and the target backend reads KV lengths on the device
        self.spec_overlap = (overlap and drafter is not None and drafter.drafts_on_device
                             and engine.backend.capabilities.device_lengths)
        self._inflight: Optional[OverlapStep] = None   # the launched step whose tokens are not read yet
        self._spec_inflight: Optional[SpecStep | SpecSteps] = None  # the launched DSpark step(s) not read yet
        self._abort_ids: set[int] = set()
        self._release_ids: set[int] = set()      # context-only requests whose held pages go back
        self._abort_lock = threading.Lock()
        self._submit_lock = threading.Lock()     # a submitted group is refused or reaches the loop
        # each item is one group of requests that reaches the scheduler in one drain
        self._incoming: "queue.Queue[list[tuple[LlmRequest, UpdateCallback]]]" = queue.Queue()
        self.notices = Notices()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.iterations = 0
        self.prompt_steps = 0            # steps with a prompt chunk
        self.reads_before_launch = 0     # DSpark steps in flight read before the next launch
        self.prompts_beside_flight = 0   # steps with prompt chunks launched while a DSpark step ran on
        self.prompts_read_late = 0       # prompt steps read one step late (their drafts launched ahead)
        self.prompts_beside_one_graph = 0  # steps whose prompt chunks ran in their own graph beside a one-graph step
        self.step_seconds = 0.0          # wall seconds inside `step` (launches, reads and waits)
        self.prompt_step_seconds = 0.0   # the share of it in steps with a prompt chunk
        self.read_wait_seconds = 0.0     # the share of it waiting for launched steps' host copies (the GPU)
        self.fatal_error: Optional[str] = None
        self.watchdog = StepWatchdog(step_timeout_s, self._stalled)

    # ---- submission --------------------------------------------------------------------
    def enqueue_request(self, req: LlmRequest, on_update: UpdateCallback) -> None:
        self.enqueue_requests([(req, on_update)])

    def enqueue_requests(self, items: Sequence[tuple[LlmRequest, UpdateCallback]]) -> None:
        """Submit requests as one group: the loop admits all of them before its next step, so the
        batches of one `LLM.generate` call do not depend on how fast the caller submitted them.
        Each callback gets (request, new tokens) at the end of every step that gave its request
        tokens when `req.streaming`, else once, when the request has finished."""
        with self._submit_lock:
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
                self.notices.register(req.request_id, cb)
                self.scheduler.add(req)

    # ---- loop --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="PyExecutor", daemon=True)
            self._thread.start()
            self.watchdog.watch(self._thread)

    def shutdown(self) -> None:
        """Stop the loop thread. Every request still queued or in flight finishes with an error, so
        no caller waits on a stopped loop; `step()` / `run_until_idle()` may still drive it by hand."""
        self._stop.set()
        self._wake.set()
        self.watchdog.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)
            if thread.is_alive():    # a step still runs: the loop fails the rest when it returns
                logger.warning("executor step still running after 30 s; its requests fail when it returns")
                return
        self._fail_all("the LLM was shut down before this request finished")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_incoming()
            if not self.scheduler.has_work:
                self._spec_inflight = None       # every request of it has finished
                if self._release_ids:
                    self._apply_aborts_and_releases()
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a device fault: fail every request, refuse every later one
                with self._submit_lock:
                    self.fatal_error = f"{type(e).__name__}: {e}"
                logger.error("executor step failed:\n%s", traceback.format_exc())
                self._fail_all(self.fatal_error)
                return
        self._fail_all("the LLM was shut down before this request finished")

    def _stalled(self, reason: str) -> None:
        """The watchdog's call (its thread) for a step that does not return: refuse new requests, stop the
        loop, fail every request (the stuck step touches none of them while it waits)."""
        with self._submit_lock:
            self.fatal_error = reason
        self._stop.set()
        self._wake.set()
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """Finish every queued and in-flight request with error `reason` and notify its caller
        (running requests' pages are freed first)."""
        self._inflight = None            # a launched step's tokens are of no use to failed requests
        self._spec_inflight = None
        with self._submit_lock:          # every group accepted so far is in the queue
            self._drain_incoming()
        waiting = list(self.scheduler.waiting)
        for req in waiting:
            self.scheduler.abort_waiting(req)
        for req in waiting + self.scheduler.running:
            if not req.is_finished:
                req.error = reason
                req.finish("error")
        for req in self._retire_finished() + waiting:
            self.notices.deliver(req, [])

    def run_until_idle(self) -> None:
        """Synchronous driver (tests, offline)."""
        self._drain_incoming()
        while self.scheduler.has_work:
            self.step()
            self._drain_incoming()

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> None:
        """schedule -> forward -> choose / verify -> append + kv.commit -> drafter.draft.

        With the overlap scheduler the step's tokens stay on the device: the next step is launched
        with them as inputs, and this step's tokens are read (stop criteria applied) one step later,
        while the GPU runs that next step (`OverlapStep`)."""
        t0, prompts0 = time.perf_counter(), self.prompt_steps
        self.watchdog.begin()
        try:
            self._step()
        finally:
            self.watchdog.end()
            dt = time.perf_counter() - t0
            self.step_seconds += dt
            if self.prompt_steps != prompts0:
                self.prompt_step_seconds += dt

    def _step(self) -> None:
        self._apply_aborts_and_releases()
        batch = self.scheduler.schedule()
        for req in batch.failed:                 # refused at admission: that request alone
            self.notices.deliver(req, [])
        if batch.imported:
            self._import_prefilled(batch.imported)
        if self.overlap:
            batch.generation_requests = [r for r in batch.generation_requests if not last_token_pending(r)]
        # nothing runs and nothing was scheduled: the head of the queue can never fit (decided before
        # reading a step in flight, whose finished requests free pages for the next admission)
        stalled = batch.empty and bool(self.scheduler.waiting) and not self.scheduler.running
        if self._spec_inflight is not None:
            self._continue_or_complete(batch)
        if batch.empty:
            if self._inflight is not None or self._spec_inflight is not None:
                with self.notices.held():
                    if self._inflight is not None:
                        self._read_overlapped()
                    else:
                        self._complete_spec_inflight()
                    self._retire_finished()
            elif stalled:
                req = self.scheduler.waiting.popleft()
                req.error = "request can never fit in the KV cache"
                req.finish("error")
                self.notices.notify(req, [])
            return
        self.iterations += 1
        # notices at the end of the step: after the next GPU work is launched, pages freed first
        with self.notices.held():
            ahead = self._spec_inflight.ahead if self._spec_inflight is not None else None
            reqs = batch.context_requests + batch.generation_requests
            segments = build_segments(batch, self.kv, self.drafter, ahead)
            num_ctx = len(batch.context_requests)
            self.prompt_steps += int(num_ctx > 0)
            try:   # a steady-state DSpark step runs as one graph; any other step the target forward
                launch = beside = None
                if self.spec_overlap and 0 < num_ctx < len(reqs):   # prompt chunks in the one-graph step, or beside
                    try:
                        launch = self.engine.forward_spec(reqs, segments, num_ctx)
                    except Exception as e:   # beside instead: a prompt's own error then fails that prompt alone
                        if is_device_fault(e):
                            raise
                        logger.error("one-graph step with prompts failed (%s: %s); prompts beside it",
                                     type(e).__name__, e)
                    if launch is None:
                        beside = self.engine.forward_spec(reqs[num_ctx:], segments[num_ctx:])
                elif self.drafter is not None and not num_ctx:
                    launch = self.engine.forward_spec(reqs, segments)
                try:
                    out = launch.out if launch is not None else \
                        self.engine.forward(segments[:num_ctx] if beside is not None else segments, num_ctx)
                except Exception as e:   # prompt chunks beside generation: the prompts fail, the rest runs
                    if is_device_fault(e) or not 0 < num_ctx < len(reqs):
                        raise
                    for req in reqs[:num_ctx]:
                        self._fail(req, e)
                    reqs, segments, num_ctx, launch, beside = reqs[num_ctx:], segments[num_ctx:], 0, beside, None
                    out = launch.out if launch is not None else self.engine.forward(segments, 0)
            except Exception as e:   # not a device fault: fail this step's requests, keep serving
                if is_device_fault(e):
                    raise
                for req in reqs:
                    self._fail(req, e)
                self._complete_spec_inflight()
                self._retire_finished()
                return
            for seg in segments[:out.context_segments]:   # the forward wrote their draft context
                self.kv.mark_draft_written(seg.request_id, seg.start + len(seg.token_ids))
            if self.overlap:
                self._launch_overlapped(reqs, segments, num_ctx, out)
            else:
                if beside is not None:   # read together, the prompts first
                    self.prompts_beside_one_graph += 1
                    step = SpecSteps([self._launch_choice(reqs[:num_ctx], segments[:num_ctx], num_ctx, out,
                                                          beside_one_graph=True),
                                      self._launch_choice(reqs[num_ctx:], segments[num_ctx:], 0, beside.out, beside)])
                else:
                    step = self._launch_choice(reqs, segments, num_ctx, out, launch)
                prev, self._spec_inflight = self._spec_inflight, None
                if prev is not None:
                    self._complete(prev)
                if self.spec_overlap and step.deferrable:
                    self._spec_inflight = step     # read at the next step, while the GPU runs it
                    self.prompts_read_late += int(step.num_ctx > 0)
                else:
                    self._complete(step)
            self._retire_finished()

    # ---- overlap scheduler ---------------------------------------------------------------
    def _launch_overlapped(self, reqs: list[LlmRequest], segments: list[ForwardSegment], num_ctx: int,
                           out: ForwardOutput) -> None:
        """Queue this step's token choice on the device and its host copy; advance every request as
        if its token were known (its next input is the device row); then read the previous step."""
        ids = self._choose_on_device(reqs, segments, out)
        tokens = PendingTokens(ids.view(-1, 1)) if ids is not None else None
        launched, index = [], []
        for i, (req, seg) in enumerate(zip(reqs, segments)):
            req.num_computed += len(seg.token_ids)
            if seg.num_logits:
                req.state = RequestState.GENERATION
                req.next_input = tokens.row(out.logits_offsets[i], 1)
                launched.append(req)
                index.append(out.logits_offsets[i])
        prev, self._inflight = self._inflight, OverlapStep(launched, index, tokens)
        if prev is not None:
            self._read_overlapped(prev)

    def _read_overlapped(self, step: Optional["OverlapStep"] = None) -> None:
        """Append the tokens of a launched step (waits for its host copy only), applying stop criteria;
        a request that stopped earlier drops its token (the step ran for nothing, as it may)."""
        if step is None:
            step, self._inflight = self._inflight, None
        self._wait_for(step)
        for req, row in zip(step.reqs, step.rows()):
            if req.is_finished:
                continue
            try:
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
                if req.next_input is not None and req.next_input.pending is step.tokens:
                    req.next_input = None            # its value is in the output from now on
                self._append(req, row)
                self._finish_context_only(req)
                committed = min(req.num_computed, req.num_tokens - 1)   # the last token's KV: in flight
                if self.kv.wants_commit(req.request_id, committed):
                    self.kv.commit(req.request_id, req.all_token_ids, committed)
            except Exception as e:
                if is_device_fault(e):
                    raise
                self._fail(req, e)

    # ---- disaggregated serving -------------------------------------------------------------
    def _finish_context_only(self, req: LlmRequest) -> None:
        """A context-only request ends after its prefill step (first token and first drafts known);
        its pages stay allocated until `release_kv` (finish reason "context")."""
        if req.context_only and req.state is RequestState.GENERATION:
            req.finish("context")
            self.notices.notify(req, [])

    def _import_prefilled(self, reqs: list[LlmRequest]) -> None:
        """Requests whose prefill ran on another worker: pull their prompt KV into the pages admission
        reserved, then continue as after a local prefill step (first token appended, drafts set).
        A failed pull fails that request alone."""
        room = self.drafter.lookahead_tokens if self.drafter is not None else 0
        kv, p = self.kv, self.kv.tokens_per_block
        with self.notices.held():
            for req in reqs:
                pre, rid = req.prefilled, req.request_id
                try:
                    kv.ensure_capacity(rid, req.prompt_len + room)
                    first = req.num_computed // p        # blocks before it: prefix-cache hits here
                    pre.pull(first, kv.request_pages(rid)[first:kv.pages_for(req.prompt_len)])
                    req.num_computed = req.prompt_len
                    req.state = RequestState.GENERATION
                    req.first_token_time = time.perf_counter()
                    req.draft_tokens = list(pre.draft_tokens) if self.drafter is not None else []
                    self._append(req, [pre.first_token])
                    if kv.wants_commit(rid, req.prompt_len):
                        kv.commit(rid, req.all_token_ids, req.prompt_len)
                    if kv.has_draft_pool:
                        kv.mark_draft_written(rid, req.prompt_len)
                except Exception as e:
                    if is_device_fault(e):
                        raise
                    self._fail(req, e)
            self._retire_finished()

    def release_kv(self, request_id: int) -> None:
        """Free the pages a finished context-only request holds (thread-safe; at the next step).
        An unknown id is ignored, so a second release is harmless."""
        with self._abort_lock:
            self._release_ids.add(request_id)
        self._wake.set()

    def _launch_choice(self, reqs: list[LlmRequest], segments: list[ForwardSegment], num_ctx: int,
                       out: ForwardOutput, launch: Optional[SpecLaunch] = None,
                       beside_one_graph: bool = False) -> "SpecStep":
        """Queue every token choice of the step on the device and their ONE device->host copy: the
        chosen id per prompt-end row (argmax, or a draw for sampling requests) and, with a drafter,
        the verify rows; then launch the next drafts from the device-side verify rows (so the GPU
        drafts while the host reads). A one-graph step (`launch`) did both already. Nothing here
        waits for the GPU."""
        if launch is not None:   # its prompts (leading) advance as drafted-ahead arrivals (`launch_arrivals`)
            for req, seg in zip(reqs[:num_ctx], segments[:num_ctx]):
                req.state, req.num_computed = RequestState.GENERATION, seg.start + len(seg.token_ids) - 1
            live = list(range(num_ctx, len(reqs)))
            return SpecStep(reqs, segments, num_ctx, out, launch.ahead.tokens, num_ctx, live, launch.verify_width,
                            launch.ahead, arrivals_ahead=num_ctx > 0, row_per_request=True)
        drafter = self.drafter
        # with a drafter only prompt ends choose here (the verify rows go through the drafter)
        chooses = len(reqs) if drafter is None else num_ctx
        ids = self._choose_on_device(reqs[:chooses], segments[:chooses], out)
        gen = list(range(num_ctx, len(reqs))) if drafter is not None else []
        ver, k1 = None, 0
        if gen:
            # one verify over the step; if it fails, each request alone (only the failing ones fail)
            items = [(reqs[i], segment_drafts(segments[i].token_ids), out.logits_offsets[i], segments[i].num_logits)
                     for i in gen]
            blocks = isolated(lambda its: drafter.verify([it[0] for it in its], [it[1] for it in its], out.logits,
                                                         [it[2] for it in its], [it[3] for it in its]),
                              items, lambda it, e: self._fail(it[0], e))
            if blocks:
                k1 = max(b.shape[1] for b in blocks)
                ver = torch.cat([torch.nn.functional.pad(b, (0, k1 - b.shape[1]), value=-1) for b in blocks])
        live = [i for i in gen if not reqs[i].is_finished] if ver is not None else []   # the rows of `ver`
        n = ids.shape[0] if ids is not None else 0
        parts = [t.reshape(-1) for t in (ids, ver) if t is not None]
        # the host copy is queued before the draft launch, so reading it waits for the verify step only
        copy = PendingTokens(torch.cat(parts).view(1, -1)) if parts else None
        ahead, arrivals = None, False
        try:   # not fatal: the requests draft after the update instead
            if ver is not None and out.captured is not None:
                segs = [VerifiedSegment(reqs[i], out.token_offsets[i], segments[i].start, len(segments[i].token_ids),
                                        j, segments[i].start_shift) for j, i in enumerate(live)]
                ahead = drafter.draft_ahead(segs, ver, out.captured)
            # the arrivals draft ahead too when the rest of the step may be read late
            rest_ahead = not live or (ahead is not None and all(reqs[i].request_id in ahead.rows for i in live))
            if self.spec_overlap and num_ctx and ids is not None and out.captured is not None and rest_ahead:
                first, arrivals = launch_arrivals(drafter, reqs[:num_ctx], segments[:num_ctx], out, ids,
                                                  beside_one_graph)
                if first is not None:
                    ahead = first if ahead is None else ahead.join(first)
        except Exception as e:
            if is_device_fault(e):
                raise
            logger.error("draft_ahead failed (%s: %s); drafting after the update", type(e).__name__, e)
        return SpecStep(reqs, segments, num_ctx, out, copy, n, live, k1, ahead, arrivals)

    def _complete(self, steps: "SpecStep | SpecSteps") -> None:
        """Read a launched step's choices and apply them: append + stop criteria, kv.commit, drafts."""
        for step in steps.parts:
            self._complete_part(step)

    def _wait_for(self, step: "OverlapStep | SpecStep") -> None:
        """Wait for a launched step's host copy, timed (`read_wait_seconds`: on a GPU, waits for it)."""
        t0 = time.perf_counter()
        step.wait()
        self.read_wait_seconds += time.perf_counter() - t0

    def _complete_part(self, step: "SpecStep") -> None:
        self._wait_for(step)
        chosen, verified = step.read()
        commits = self._update_requests(step.reqs, step.segments, step.num_ctx, step.out, chosen, verified)
        if self.drafter is not None and commits:
            isolated(lambda cs: self.drafter.draft(cs, step.out.captured, step.ahead), commits,
                     lambda c, e: self._fail(c.req, e))
        for req in step.reqs:
            if req.context_only:
                self._finish_context_only(req)

    def _complete_spec_inflight(self) -> None:
        step, self._spec_inflight = self._spec_inflight, None
        if step is not None:
            self._complete(step)

    def _continue_or_complete(self, batch: ScheduledBatch) -> None:
        """With a DSpark step in flight: keep its continuable requests in this step (launched from
        its device rows before it is read) and leave out those it may finish by length (they wait
        one step). Prompt chunks join them (a mixed step: the chunks lead, the continued segments
        follow, `ModelEngine.forward`; or, where the continued segments make a one-graph step, the
        chunks run in their own graph beside it, `SpecSteps`), so arrivals hold no generation back.
        When nothing continues, the step in flight is read first."""
        gens = batch.generation_requests
        kept, continuing = self._spec_inflight.continuable(gens)
        if continuing:
            batch.generation_requests = kept
            self.prompts_beside_flight += int(bool(batch.context_requests))
            return
        self.reads_before_launch += 1
        with self.notices.held():
            self._complete_spec_inflight()
            self._retire_finished()
        batch.generation_requests = [r for r in gens if not r.is_finished]

    def _choose_on_device(self, reqs: list[LlmRequest], segments: list[ForwardSegment],
                          out: ForwardOutput) -> Optional[torch.Tensor]:
        """Token ids [N] on the device for the logits rows of `reqs` (a prefix of the step's requests,
        whose rows lead `out.logits`: outputs are packed in segment order): the argmax, overwritten
        by a draw on the rows of sampling requests; None when none of them wants logits (no sync
        either way). A DSpark step passes only its prompt chunks: its verify rows are the drafter's."""
        n = sum(seg.num_logits for seg in segments)
        if not n:
            return None
        rows = [(out.logits_offsets[i], req) for i, (req, seg) in enumerate(zip(reqs, segments))
                if not req.sampling_params.greedy and seg.num_logits]
        return self.sampler.choose(out.logits[:n], [r for r, _ in rows], [q.request_id for _, q in rows],
                                   [q.sampling_params for _, q in rows])

    def _update_requests(self, reqs: list[LlmRequest], segments: list[ForwardSegment], num_ctx: int,
                         out: ForwardOutput, chosen: list[int], verified: list[Optional[list[int]]]
                         ) -> list[StepCommit]:
        """Append the chosen / verified tokens (verified[i]: request i's verify row), apply stop
        criteria, notify, record committed tokens with the KV manager; returns what the drafter needs
        (empty without a drafter)."""
        drafter, kv = self.drafter, self.kv
        caching, finished = kv.prefix_caching, RequestState.FINISHED
        commits: list[StepCommit] = []
        for i, (req, seg) in enumerate(zip(reqs, segments)):
            if req.state is finished:    # failed earlier in this step (its verify)
                continue
            try:
                if i < num_ctx:   # (absolute: a prompt step read late was advanced at its launch)
                    req.num_computed = seg.start + len(seg.token_ids)
                    if drafter is not None:
                        commits.append(StepCommit(req, out.token_offsets[i], seg.start, len(seg.token_ids)))
                    if seg.num_logits:
                        req.state = RequestState.GENERATION
                        if req.first_token_time is None:
                            req.first_token_time = time.perf_counter()
                        self._append(req, [chosen[out.logits_offsets[i]]])
                elif drafter is None:
                    req.num_computed += 1
                    self._append(req, [chosen[out.logits_offsets[i]]])
                else:   # the host count is the segment's real start (a continued one's shift is read)
                    new = drafter.accept(req, verified[i], len(seg.token_ids) - 1)
                    start, k = req.num_computed, len(new)
                    req.num_computed += k
                    commits.append(StepCommit(req, out.token_offsets[i], start, k))
                    self._append(req, new)
                if i >= num_ctx and req.state is finished:
                    # a stop drops the token(s) after it (only a finished request drops any)
                    req.num_computed = min(req.num_computed, req.num_tokens)
                if caching and kv.wants_commit(req.request_id, req.num_computed):
                    kv.commit(req.request_id, req.all_token_ids, req.num_computed)
            except Exception as e:
                if is_device_fault(e):
                    raise
                self._fail(req, e)
        return commits

    def _fail(self, req: LlmRequest, e: Exception) -> None:
        """Finish one request with an error (its pages are freed at the end of the step)."""
        req.error = f"{type(e).__name__}: {e}"
        logger.error("request %d failed: %s", req.request_id, req.error)
        req.finish("error")
        self.notices.notify(req, [])

    # ---- abort ---------------------------------------------------------------------------
    def abort(self, request_id: int) -> None:
        """Abort a request (thread-safe): honoured at the next step; it finishes with
        finish_reason "aborted", keeps the tokens it has, and its KV pages are freed."""
        with self._abort_lock:
            self._abort_ids.add(request_id)
        self._wake.set()

    def _apply_aborts_and_releases(self) -> None:
        if self._release_ids:
            with self._abort_lock:
                released, self._release_ids = self._release_ids, set()
            for rid in released:
                if rid in self.scheduler.held:
                    self.scheduler.held.discard(rid)
                    self.kv.free(rid)
        if not self._abort_ids:
            return
        self._drain_incoming()
        with self._abort_lock:
            ids, self._abort_ids = self._abort_ids, set()
        for req in list(self.scheduler.waiting):
            if req.request_id in ids:
                self.scheduler.abort_waiting(req)
                req.finish("aborted")
                self.notices.deliver(req, [])
        for req in self.scheduler.running:
            if req.request_id in ids and not req.is_finished:
                req.finish("aborted")
        for req in self._retire_finished():
            self.notices.deliver(req, [])

    def _retire_finished(self) -> list[LlmRequest]:
        """Free the KV and per-request state of the finished running requests; returns them."""
        done = self.scheduler.remove_finished()
        for req in done:
            self.sampler.release(req.request_id)
            if self.drafter is not None:
                self.drafter.release(req)
        return done

    def _append(self, req: LlmRequest, tokens: list[int]) -> None:
        """Append newly committed tokens, applying stop criteria in order (`stop_criteria`)."""
        self.notices.notify(req, append_tokens(req, tokens, self.decode))

