"""A watchdog over the executor loop: a step that makes no progress for `step_timeout_s` ends the engine.

A step normally takes milliseconds; one that does not return (a GPU that never completes the work
a step waits on, a host wait that is never released) would leave every caller waiting forever.
`StepWatchdog` runs beside the loop thread: the loop marks each step's start and end, and when a
step has run longer than the timeout the watchdog logs the loop thread's Python stack (what it
waits on) and calls `on_stall` once, which fails every request and refuses later ones, as a
device fault does. The step itself cannot be interrupted; if it ever returns, the loop finds
itself stopped. Zero cost on the step path: two attribute writes per step.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Callable, Optional

logger = logging.getLogger("tensorrt_llm")


class StepWatchdog:
    """Calls `on_stall(reason)` once when a step marked by `begin` / `end` runs over `timeout_s`
    (None: never; the monitor thread is not started)."""

    def __init__(self, timeout_s: Optional[float], on_stall: Callable[[str], None]):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 (or None for no limit), got {timeout_s}")
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self._started: Optional[float] = None      # monotonic start of the step running now
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stalled: Optional[str] = None

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def watch(self, loop: threading.Thread) -> None:
        """Start monitoring the steps of `loop` (the executor's loop thread)."""
        if self.timeout_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(loop,), name="PyExecutorWatchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop monitoring; returns once the monitor thread has ended (it holds `on_stall`, hence the
        executor: a stopped engine must not stay reachable from a live thread)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self, loop: threading.Thread) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period) and loop.is_alive():
            started = self._started
            if started is None:
                continue
            ran = time.monotonic() - started
            if ran <= self.timeout_s:
                continue
            frame = sys._current_frames().get(loop.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not available)"
            self.stalled = (f"executor step stalled: no progress for {ran:.0f} s (step_timeout_s={self.timeout_s}); "
                            "the engine stopped")
            logger.error("%s; the executor thread is at:\n%s", self.stalled, stack)
            self.on_stall(self.stalled)
            return
