"""The CUDA stream that a step's prompt chunks run on beside a one-graph DSpark step.

With the overlap scheduler, the generating requests of a step with prompt chunks may replay the
one-graph DSpark step (verify, acceptance, draft step; `SpecStepGraph`) while the chunks run in
their own packed-step graph (`SpecSteps`). At serving batch sizes both graphs are chains of small,
latency-bound kernels that leave most of the GPU idle; on one stream they run one after the other.
`PromptStream` queues the prompt part (its forward, token choice and host copy, the arrivals'
first drafts) on a second stream, so the two graphs share the GPU.

Ordering, and why no memory is reused while in use:
* `mark()` records an event on the main stream before the one-graph launch; the prompt part waits
  for it, so it runs after every earlier step (a page an earlier step last used and the KV manager
  gave to an arrival is written after that use) and beside the one-graph step only.
* The two parts touch disjoint memory: the arrivals' pages and the running requests' pages; each
  graph runner's intermediates live in its own graph memory pool and its own staging buffers;
  padding rows of either write only the scratch page, which no real row reads.
* After queueing the prompt part the main stream waits for it, so everything queued later (the
  next step, the host reads of its tokens' copy, the joined drafts) sees it. A block the caching
  allocator frees on the side stream is handed out there again only within a later prompt part,
  which starts after the next `mark()`: after every main-stream use queued until then.
Without CUDA (the CPU) or when turned off, the prompt part runs on the main stream after the
one-graph step, as any other work.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class PromptStream:
    """The side stream of prompt chunks beside a one-graph DSpark step (module doc)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.stream: Optional[torch.cuda.Stream] = (torch.cuda.Stream(device)
                                                    if enabled and device.type == "cuda" else None)
        self._before: Optional[torch.cuda.Event] = None

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def mark(self) -> None:
        """Call before the one-graph launch: the prompt part of this step starts after the work
        queued until now."""
        if self.stream is not None:
            self._before = torch.cuda.Event()
            self._before.record()

    @contextlib.contextmanager
    def beside(self, active: bool) -> Iterator[None]:
        """Work queued inside runs on the side stream when `active` (the step's prompt part beside a
        one-graph step, after `mark`); the main stream waits for it on exit, error or not."""
        if not active or self.stream is None or self._before is None:
            yield
            return
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_event(self._before)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            main.wait_stream(self.stream)
