"""LoopHandoff: the executor thread's hand-offs to an event loop, one wake-up per burst, in order."""
from __future__ import annotations

import asyncio
import threading

from tensorrt_llm.llmapi.loop_handoff import LoopHandoff


def _count_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count the loop's call_soon_threadsafe calls (the wake-ups) in a one-item list."""
    n, inner = [0], loop.call_soon_threadsafe

    def counted(*a, **k):
        n[0] += 1
        return inner(*a, **k)
    loop.call_soon_threadsafe = counted
    return n


def test_a_burst_is_one_wakeup_and_keeps_each_queues_order():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = _count_wakeups(loop)
        h = LoopHandoff.for_loop(loop)
        assert LoopHandoff.for_loop(loop) is h      # one per loop
        qs = [asyncio.Queue() for _ in range(4)]
        for i in range(100):                  # the loop cannot drain in between: one burst
            h.post(qs[i % 4], i)
        assert wakeups[0] == 1 and all(q.empty() for q in qs)
        await asyncio.sleep(0)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in qs]
        assert got == [list(range(k, 100, 4)) for k in range(4)]
        # control: posts the loop drains one by one are one wake-up each
        for i in range(3):
            h.post(qs[0], i)
            await asyncio.sleep(0)
        assert wakeups[0] == 4 and [qs[0].get_nowait() for _ in range(3)] == [0, 1, 2]

    asyncio.run(main())


def test_posts_from_another_thread_arrive_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = _count_wakeups(loop)
        h = LoopHandoff.for_loop(loop)
        qs = [asyncio.Queue() for _ in range(8)]

        def producer():
            for i in range(4000):
                h.post(qs[i % 8], i)

        t = threading.Thread(target=producer)
        t.start()
        got = [[await asyncio.wait_for(q.get(), 10) for _ in range(500)] for q in qs]
        t.join()
        assert got == [list(range(k, 4000, 8)) for k in range(8)]
        assert 1 <= wakeups[0] <= 4000

    asyncio.run(main())


def test_post_after_the_loop_closed_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    h = LoopHandoff.for_loop(loop)
    q = asyncio.Queue()
    loop.close()
    h.post(q, 1)            # no exception: nobody is left to read it
    h.post(q, 2)
    assert q.empty()
