"""Per-request state held by the executor."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Sequence

import torch

from ...sampling_params import SamplingParams
from .token_rows import TokenRow


@dataclass(frozen=True)
class PrefilledKV:
    """A request whose prefill ran on another worker (disaggregated GEN): its first token, the
    drafts of its first block (empty without a drafter), and `pull(first_block, pages)`, which fills
    this worker's `pages` (ids of both pools) with the prompt's blocks first_block.. from that worker."""

    first_token: int
    draft_tokens: tuple[int, ...]
    pull: Callable[[int, list[int]], None]


class RequestState(enum.Enum):
    WAITING = "waiting"
    CONTEXT = "context"          # prompt (possibly chunked) being prefilled
    GENERATION = "generation"
    FINISHED = "finished"


# read per request several times a step: a module constant (an enum member read through its class is slower)
_FINISHED = RequestState.FINISHED


@dataclass
class LlmRequest:
    """A request's tokens and progress.

    tokens = prompt + output. `num_computed` = tokens whose KV is in the target pool;
    in GENERATION the next input is tokens[num_computed:] (the last sampled token).
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    end_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_cached_prompt: int = 0      # prompt tokens reused from the prefix cache
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    # proposed, awaiting verification: a list, or a `TokenRow` still on the device (graph drafts)
    draft_tokens: Sequence[int] = field(default_factory=list)
    draft_probs: Optional[torch.Tensor] = None               # [K, V] drafter probs (T>0)
    # overlap scheduler: the next input token while it is still on the device (a 1-token `TokenRow`
    # of the step that chose it), None once it is in output_token_ids
    next_input: Optional[TokenRow] = None
    num_verify_steps: int = 0       # speculative verify steps of this request
    num_accepted_drafts: int = 0    # drafts accepted over those steps
    # disaggregated serving: a CTX request stops after its prefill step (first token + first drafts)
    # and keeps its pages until `PyExecutor.release_kv`; a GEN request arrives with `prefilled`
    context_only: bool = False
    prefilled: Optional[PrefilledKV] = None
    # the caller's update callback wants every step's tokens; otherwise only the final notice
    streaming: bool = False

    @property
    def acceptance_length(self) -> Optional[float]:
        """Tokens committed per verify step (1 + accepted drafts / steps); None before any step."""
        if not self.num_verify_steps:
            return None
        return 1.0 + self.num_accepted_drafts / self.num_verify_steps

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """Ids that end the request when sampled: end_ids (unless ignore_eos) + stop_token_ids.
        Cached: sampling_params is frozen and end_ids is set at construction."""
        p = self.sampling_params
        return (frozenset() if p.ignore_eos else self.end_ids) | frozenset(p.stop_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """tokens[i] without building prompt + output (hot path)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is _FINISHED

    def remaining_prompt(self) -> int:
        return max(0, self.prompt_len - self.num_computed)

    def reserve_tokens(self, spec_slack: int) -> int:
        """Tokens of KV this request may ever need (prompt + outputs + draft slack)."""
        return self.prompt_len + (1 if self.context_only else self.sampling_params.max_tokens) + spec_slack

    def finish(self, reason: str) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
