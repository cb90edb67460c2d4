"""Device time per call for the GPU microbenchmarks (attention_bench.py, ops_bench.py)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int = 20, reps: int = 5) -> float:
    """Microseconds per call of `fn` inside a CUDA graph of `calls` calls (launch cost excluded): CUDA-event
    time of a replay / calls, median of `reps` replays (one warm-up call on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)
