"""Capacity + micro-batch scheduler. Never touches tensors.

Capacity policy: *no eviction*. A request is admitted only when the KV pages for its
whole life (prompt + max_tokens + speculative slack) can be reserved, so a running
request never waits for pages or gets preempted. Requests are admitted in arrival order
(FCFS, no overtaking).

Micro-batch: generation requests first (one token each, or 1 + drafts with speculation),
then prompt chunks fill the remaining `max_num_tokens` budget (chunked prefill).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .llm_request import LlmRequest, RequestState
from .resource_manager import KVCacheManager


@dataclass
class ScheduledBatch:
    """One step's work: prompt chunks and generation requests."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    context_chunks: list[int] = field(default_factory=list)     # tokens of each prompt this step
    generation_requests: list[LlmRequest] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.context_requests and not self.generation_requests


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool, tokens_per_gen_step: int, spec_slack: int):
        self.kv = kv_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked = enable_chunked_prefill
        self.tokens_per_gen_step = tokens_per_gen_step
        self.spec_slack = spec_slack
        self.waiting: deque[LlmRequest] = deque()
        self.running: list[LlmRequest] = []

    def add(self, req: LlmRequest) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            reserve = req.reserve_tokens(self.spec_slack)
            if not self.kv.can_admit(req.prompt_token_ids, reserve):
                break
            self.waiting.popleft()
            cached = self.kv.add_sequence(req.request_id, req.prompt_token_ids, reserve)
            req.num_computed = req.num_cached_prompt = cached
            req.state = RequestState.CONTEXT
            self.running.append(req)

    def schedule(self) -> ScheduledBatch:
        self._admit()
        batch = ScheduledBatch()
        budget = self.max_num_tokens
        gen = RequestState.GENERATION
        gens = [r for r in self.running if r.state is gen]
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
                self.kv.free(r.request_id)
        return done

    def abort_waiting(self, req: LlmRequest) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
