"""Capacity + micro-batch scheduler. Never touches tensors.

Capacity policy: *no eviction*. A request is admitted only when the KV pages for its
whole life (prompt + max_tokens + speculative slack) can be reserved, so a running
request never waits for pages or gets preempted. Requests are admitted in arrival order
(FCFS, no overtaking).

Micro-batch: generation requests first (one token each, or 1 + drafts with speculation),
then prompt chunks fill the remaining `max_num_tokens` budget (chunked prefill).

Batch waiting (TensorRT-LLM's `batch_wait_timeout_iters` / `batch_wait_max_tokens_ratio`): while
requests are generating, newly arrived requests stay in the queue for up to N schedule calls so
that several arrivals share one prefill step; a step with a prefill segment is a mixed step
(piecewise graphs instead of the whole-step graph, and an eager draft for the new request), so
fewer of them is faster overall. The wait ends
for all held requests at once when N calls have passed since the oldest arrived, when their
prompt tokens reach ratio x max_num_tokens, when nothing is generating (an idle engine starts at
once), or when a prompt is already in flight (the step has a prefill segment anyway). Only
requests not yet admitted are held, so a started (chunked) prefill is never delayed. Released
requests are then admitted by the same reserve-or-wait rule, in arrival order.

Slot grouping (`batch_admit_min_slots` = k): when the batch is full of generating requests and
more are queued (a large offline `generate`), each finishing request would let one queued request
in, so nearly every step would be a mixed step with a one-request prefill. With k > 1, while
requests are generating, the queue head waits until min(k, queued, max_batch_size) batch slots
are free and that many start together. Nothing waits when no request is generating; finishing
requests always free slots, so the wait ends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..runtime.llm_request import LlmRequest, RequestState
from .kv_cache.resource_manager import KVCacheManager


@dataclass
class ScheduledBatch:
    """One step's work: prompt chunks and generation requests."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    context_chunks: list[int] = field(default_factory=list)     # tokens of each prompt this step
    generation_requests: list[LlmRequest] = field(default_factory=list)
    failed: list[LlmRequest] = field(default_factory=list)       # refused at admission (finished, error set)
    imported: list[LlmRequest] = field(default_factory=list)     # admitted with `prefilled` KV to pull

    @property
    def empty(self) -> bool:
        return not self.context_requests and not self.generation_requests


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool, tokens_per_gen_step: int, spec_slack: int, *,
                 batch_wait_timeout_iters: int = 0, batch_wait_max_tokens_ratio: float = 0.0,
                 batch_admit_min_slots: int = 1):
        if batch_wait_timeout_iters < 0:
            raise ValueError(f"batch_wait_timeout_iters must be >= 0, got {batch_wait_timeout_iters}")
        if not 0.0 <= batch_wait_max_tokens_ratio <= 1.0:
            raise ValueError(f"batch_wait_max_tokens_ratio must be in [0, 1], got {batch_wait_max_tokens_ratio}")
        if batch_wait_max_tokens_ratio > 0 and batch_wait_timeout_iters == 0:
            raise ValueError("batch_wait_max_tokens_ratio > 0 needs batch_wait_timeout_iters > 0")
        if batch_admit_min_slots < 1:
            raise ValueError(f"batch_admit_min_slots must be >= 1, got {batch_admit_min_slots}")
        self.kv = kv_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked = enable_chunked_prefill
        self.tokens_per_gen_step = tokens_per_gen_step
        self.spec_slack = spec_slack
        self.batch_wait_timeout_iters = batch_wait_timeout_iters
        self.batch_wait_max_tokens_ratio = batch_wait_max_tokens_ratio
        self.batch_admit_min_slots = batch_admit_min_slots
        self.waiting: deque[LlmRequest] = deque()
        self.running: list[LlmRequest] = []
        # batch-waiting state: ids of queued requests whose wait is over (always a prefix of
        # `waiting`: a release covers the whole queue, arrivals join at the tail), and the number
        # of consecutive schedule() calls that held an arrival
        self._released: set[int] = set()
        self.held: set[int] = set()        # finished context-only requests whose pages are kept
        self._held_iters = 0

    def add(self, req: LlmRequest) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def held_iters(self) -> int:
        """Consecutive schedule() calls that have held the queued arrivals (0: none held)."""
        return self._held_iters

    def _held_prompt_tokens_reach(self, threshold: float) -> bool:
        """Whether the unreleased (tail) arrivals' prompt tokens reach `threshold`; stops early."""
        total = 0
        for req in reversed(self.waiting):
            if req.request_id in self._released:
                break
            total += req.prompt_len
            if total >= threshold:
                return True
        return False

    def _update_batch_wait(self, generating: bool, prompt_in_flight: bool) -> bool:
        """Decide this call's batch wait; True when the unreleased arrivals are held this step."""
        if not self.waiting:
            self._released.clear()
            self._held_iters = 0
            return False
        if self.waiting[-1].request_id in self._released:
            return False                   # every queued request is already released
        ratio = self.batch_wait_max_tokens_ratio
        release = (not generating or prompt_in_flight
                   or self._held_iters >= self.batch_wait_timeout_iters
                   or (ratio > 0 and self._held_prompt_tokens_reach(ratio * self.max_num_tokens)))
        if not release:
            self._held_iters += 1
            return True
        for req in reversed(self.waiting):
            if req.request_id in self._released:
                break
            self._released.add(req.request_id)
        self._held_iters = 0
        return False

    def _admit(self, hold: bool, generating: bool, failed: list[LlmRequest], imported: list[LlmRequest]) -> None:
        released = self._released
        if generating and self.batch_admit_min_slots > 1 and self.waiting:
            need = min(self.batch_admit_min_slots, len(self.waiting), self.max_batch_size)
            if self.max_batch_size - len(self.running) < need:
                return                     # slot grouping: wait for more finished requests
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if hold and req.request_id not in released:
                break
            reserve = req.reserve_tokens(self.spec_slack)
            if not self.kv.can_admit(req.prompt_token_ids, reserve):
                break
            self.waiting.popleft()
            released.discard(req.request_id)
            try:
                cached = self.kv.add_sequence(req.request_id, req.prompt_token_ids, reserve)
            except ValueError as e:        # this request can never be served: refuse it alone
                req.error = f"ValueError: {e}"
                req.finish("error")
                failed.append(req)
                continue
            req.num_computed = req.num_cached_prompt = cached
            self.running.append(req)
            if req.prefilled is not None:   # stays WAITING until the executor has pulled its KV
                imported.append(req)
            else:
                req.state = RequestState.CONTEXT

    def schedule(self) -> ScheduledBatch:
        gen = RequestState.GENERATION
        gens = [r for r in self.running if r.state is gen]     # admission adds no generation request
        hold = False
        if self.batch_wait_timeout_iters:
            hold = self._update_batch_wait(bool(gens), len(gens) < len(self.running))
        batch = ScheduledBatch()
        self._admit(hold, bool(gens), batch.failed, batch.imported)
        budget = self.max_num_tokens
        # each generation request costs tokens_per_gen_step; the first that fit, in order
        take = min(len(gens), budget // self.tokens_per_gen_step)
        batch.generation_requests = gens if take == len(gens) else gens[:take]
        budget -= take * self.tokens_per_gen_step
        if len(gens) == len(self.running):
            return batch                       # no prompt in flight (steady decoding)
        for req in self.running:
            if req.state != RequestState.CONTEXT or budget <= 0:
                continue
            n = req.remaining_prompt()
            if n > budget:
                if not self.chunked and batch.context_requests:
                    continue
                n = budget if self.chunked else n
            batch.context_requests.append(req)
            batch.context_chunks.append(n)
            budget -= n
        return batch

    def remove_finished(self) -> list[LlmRequest]:
        fin = RequestState.FINISHED
        done = [r for r in self.running if r.state is fin]
        if done:
            self.running = [r for r in self.running if r.state is not fin]
            for r in done:
                if r.finish_reason == "context":    # kept for the GEN worker: PyExecutor.release_kv
                    self.held.add(r.request_id)
                else:
                    self.kv.free(r.request_id)
        return done

    def abort_waiting(self, req: LlmRequest) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            self._released.discard(req.request_id)
