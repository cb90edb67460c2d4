"""Hand-offs from the executor thread to an asyncio loop, coalesced: one wake-up per burst.

A step ends by notifying every request it advanced; with N streaming requests served by one event
loop that was N `loop.call_soon_threadsafe` calls per step (each one a self-pipe write and a loop
wake-up, under the GIL both threads share). `LoopHandoff.post` queues (asyncio.Queue, item) pairs
and schedules one drain for all that arrive before the loop runs it; items reach each queue in the
order they were posted.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

_registry: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


class LoopHandoff:
    """The pending hand-offs to one event loop (one per loop: `for_loop`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False

    @staticmethod
    def for_loop(loop: asyncio.AbstractEventLoop) -> "LoopHandoff":
        with _registry_lock:
            h = _registry.get(loop)
            if h is None:
                h = _registry[loop] = LoopHandoff(loop)
            return h

    def post(self, q: asyncio.Queue, item: Any) -> None:
        """Thread-safe: `q.put_nowait(item)` on the loop. Dropped when the loop is closed (nobody is
        left to read it)."""
        with self._lock:
            self._items.append((q, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:        # the loop is closed
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for q, item in items:
            q.put_nowait(item)
