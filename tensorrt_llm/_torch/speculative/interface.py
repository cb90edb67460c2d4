"""The executor's whole view of speculation: one `Drafter` ABC.

A step with a drafter, as `PyExecutor.step` runs it::

    segments  : prompt chunks | [anchor, d1..dn] per generating request   (verify_tokens;
                n = draft_len(generating requests in the step) <= K)
    forward   : target logits of the wanted rows + captured hidden rows
    verify    : [G, K+1] output ids on the device (accepted drafts, one target token, -1 pad)
    draft_ahead: the next drafts launched from the device-side verify output (no wait)
    host copy : one per step (the executor's token choice and the verify rows together)
    accept    : per request, the tokens to append (capped at max_tokens) + acceptance stats
    kv.commit : verified tokens recorded; a block is published once its draft KV is written too
    draft     : the launched drafts attached; draft-context writes and drafts for the rest
                (a prompt chunk's context may be written by the forward: `write_forward_context`)

The executor imports only this module of `speculative/`; `create_drafter` builds the concrete
drafter from its config.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from ..pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from ..pyexecutor.kv_cache.resource_manager import KVCacheManager
from ..runtime.llm_request import LlmRequest
from ..runtime.sampler import Sampler
from ..runtime.step import DraftsAhead, StepCommit, VerifiedSegment


class Drafter(ABC):
    """A speculative drafter bound to a KV manager (its pool shares the target's page ids)."""

    @property
    @abstractmethod
    def max_draft_len(self) -> int:
        """K: drafts per verify segment (the segment holds K + 1 tokens)."""

    @property
    @abstractmethod
    def lookahead_tokens(self) -> int:
        """KV slots past the committed tokens that a generating request's draft step may write."""

    @property
    @abstractmethod
    def capture_layer_ids(self) -> Sequence[int]:
        """Target layers whose hidden states the drafter reads (captured by the target forward)."""

    @property
    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """The draft pool's layout and dtype."""

    @abstractmethod
    def bind(self, kv: KVCacheManager, sampler: Sampler) -> None:
        """Attach the KV manager (the draft pool lives in it) and the sampler (draw streams)."""

    def enable_device_drafts(self, max_batch_size: int, cuda_graphs: bool) -> None:
        """Let `draft_ahead` launch the draft step from the device-side verify output (after `bind`),
        captured per batch bucket with cuda_graphs; a drafter that cannot ignores it."""

    @property
    def drafts_on_device(self) -> bool:
        """`draft_ahead` may launch (so the overlap scheduler may continue a verify step on the device)."""
        return False

    @abstractmethod
    def draft_len(self, batch_size: int) -> int:
        """Drafts to verify per request in a step of `batch_size` generating requests (0..K)."""

    @property
    @abstractmethod
    def verify_widths(self) -> Sequence[int]:
        """Every verify segment length a step may use (1 + `draft_len`): graphs are captured for these."""

    @abstractmethod
    def verify_tokens(self, req: LlmRequest, num_drafts: int) -> Sequence[int]:
        """The verify segment [anchor, d1..dn] of a generating request, n = min(num_drafts, its drafts)
        (drafts may stay on the device)."""

    @abstractmethod
    def verify(self, reqs: Sequence[LlmRequest], drafts: Sequence[Sequence[int]], logits: torch.Tensor,
               offsets: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Verify the step's generation requests without a sync.

        drafts[i]: the drafts request i's segment verified (a host list or a device `TokenRow`);
        logits [N, V]: request i's verify rows are offsets[i]..offsets[i]+counts[i]-1.
        Returns [G, K+1] int64 on the device: accepted drafts, one target token, -1 padding.
        """

    def draft_ahead(self, segments: Sequence[VerifiedSegment], verified: torch.Tensor,
                    captured: torch.Tensor) -> Optional[DraftsAhead]:
        """Launch the next drafts of verified requests from the verify output `verified` [G, K+1]
        (on the device, not yet read by the host) and the step's captured rows [T, n*H], without
        waiting for the GPU. Returns what was launched, or None; `draft` handles the rest after
        the host update. A drafter that cannot launch early returns None."""
        return None

    def draft_arrivals(self, commits: Sequence[StepCommit], anchors: torch.Tensor,
                       captured: torch.Tensor) -> Optional[DraftsAhead]:
        """Launch the first drafts of prompts that end in this step before the host reads their first
        tokens: write the draft context of the committed prompt rows, then draft from each prompt's
        last row with its chosen token anchors[i] ([len(commits)] int64 on the device). The requests
        are generating already. Returns what was launched, or None; `draft` handles the rest after the
        host update. A drafter that cannot launch early returns None."""
        return None

    def anchor_arrivals(self, commits: Sequence[StepCommit], anchors: torch.Tensor,
                        captured: torch.Tensor) -> Optional[DraftsAhead]:
        """The first verify segments of prompts that end in this step, without a draft launch: each
        request's row holds its chosen token anchors[i] ([len(commits)] int64 on the device) and
        placeholder drafts, which the next verify step checks like any drafts (lossless: it commits
        the target's token after the anchor and whatever placeholders match) and then drafts for it.
        For prompt chunks beside a one-graph step, whose graph drafts the arrivals one step later
        instead of a draft launch of their own now. Writes the draft context of the committed prompt
        rows where the target forward did not (captured [T, n*H]: the step's captured rows). None
        from a drafter that cannot (`draft_arrivals` then)."""
        return None

    @property
    def writes_forward_context(self) -> bool:
        """`write_forward_context` runs here (after `bind`): the packed-step graph of the target
        forward then writes its prompt rows' draft context itself."""
        return False

    def write_forward_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The draft context of a target forward's rows, inside that forward (its CUDA graph):
        captured [T, n*H] hidden rows at positions [T] int64 into draft slots [T] int64. Every slot is
        a real one (rows whose context is not wanted write into the scratch page); device ops only."""
        raise ValueError(f"{type(self).__name__} does not write draft context inside the target forward")

    @abstractmethod
    def accept(self, req: LlmRequest, verified: Sequence[int], num_drafts: int) -> list[int]:
        """A request's host row of `verify` (without its -1 padding) for a segment of `num_drafts`
        drafts -> the tokens to commit (at most max_tokens - emitted, at least 1); records acceptance
        (steps with drafts) and clears the request's drafts."""

    @abstractmethod
    def draft(self, commits: Sequence[StepCommit], captured: Optional[torch.Tensor],
              ahead: Optional[DraftsAhead] = None) -> None:
        """Write draft context for the committed tokens, then propose drafts for generating requests;
        requests in `ahead` (this step's `draft_ahead`) only take their launched drafts.
        captured: [T, n*H] the step's captured target hidden rows, or None (a one-graph step, whose
        requests are all in `ahead`): then only `ahead`'s requests take drafts."""

    @abstractmethod
    def release(self, req: LlmRequest) -> None:
        """Forget a finished request's drafter state."""

    @abstractmethod
    def stats(self) -> dict:
        """Acceptance statistics (JSON-able)."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Start a new acceptance window (get_stats() reports since the last reset)."""

    @abstractmethod
    def describe(self) -> dict:
        """Static facts for the capacity report (architecture, K, backends)."""
