"""Host time of `CUDAGraph.replay()` (one cudaGraphLaunch) on the H200, by graph size and by what
the GPU is doing: does re-launching a graph whose previous launch still runs block the host?

For graphs of N tiny kernels (N = 100, 300, 500: the engine's decode and DSpark steps are ~310-520),
each preceded by a spin kernel of about `--busy-us` of GPU time (`torch.cuda._sleep`):
  idle      the GPU is idle at each launch (synchronize before it): the launch's own cost
  same      one graph launched back to back without waiting, as an overlapped step loop does
  alternate two captures of the same work launched in turn (each launch's previous instance is
            two launches back)
Prints host ms per launch (mean and p90) and GPU ms per launch, and writes --out JSON.

    python examples/gpu/graph_launch_bench.py --out $OUT/graph_launch.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _spin_cycles(busy_us: float) -> int:
    """Cycles of `torch.cuda._sleep` for about busy_us microseconds (measured here)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return max(int(probe * busy_us / (1000 * start.elapsed_time(end))), 1)


def _capture(n: int, cycles: int, x: torch.Tensor, pool) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        for _ in range(n):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, pool=pool):
        torch.cuda._sleep(cycles)
        for _ in range(n):
            x.add_(1)
    torch.cuda.synchronize()
    return g


def _launches(graphs: list[torch.cuda.CUDAGraph], iters: int, sync_each: bool) -> tuple[list[float], float]:
    """(host seconds of each replay call, GPU ms per launch)."""
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(iters):
        if sync_each:
            torch.cuda.synchronize()
        t = time.perf_counter()
        graphs[i % len(graphs)].replay()
        host.append(time.perf_counter() - t)
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 300, 500])
    ap.add_argument("--busy-us", type=float, default=1000.0, help="GPU spin per launch (an engine step's GPU time)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cycles = _spin_cycles(a.busy_us)
    x = torch.zeros(64, device="cuda")
    rows = []
    for n in a.nodes:
        pool = torch.cuda.graph_pool_handle()
        one, two = _capture(n, cycles, x, pool), _capture(n, cycles, x, pool)
        for mode, graphs, sync in (("idle", [one], True), ("same", [one], False), ("alternate", [one, two], False)):
            _launches(graphs, 20, sync)                                   # warm-up
            host, gpu_ms = _launches(graphs, a.iters, sync)
            host_ms = sorted(1000 * h for h in host)
            row = {"nodes": n + 1, "mode": mode, "host_ms_mean": sum(host_ms) / len(host_ms),
                   "host_ms_p90": host_ms[int(0.9 * len(host_ms))], "gpu_ms_per_launch": gpu_ms}
            rows.append(row)
            print(f"{n + 1:4d} nodes  {mode:9s}  host {row['host_ms_mean']:.3f} ms (p90 {row['host_ms_p90']:.3f})"
                  f"  GPU {gpu_ms:.3f} ms per launch", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"busy_us": a.busy_us, "spin_cycles": cycles, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
