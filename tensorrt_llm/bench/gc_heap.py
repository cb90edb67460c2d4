"""What a full garbage-collector pass costs with a started engine's heap tracked, and with it frozen.

    python -m tensorrt_llm.bench.gc_heap --model DIR [--drafter DIR] [--inductor] [--json out.json]

Builds an `LLM` on the CPU (the heap of a GPU engine is larger: CUDA graphs, Triton kernels), serves one
short request, then times full passes (`gc.collect()`, the best of `--passes`) twice: with every object
tracked (`gc.unfreeze()`), and with the heap frozen as a started `LLM` leaves it (`gc.freeze()`). A full
pass stops every thread, the executor's too (`docs/performance.md`, known bottlenecks).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence


def _best_pass_ms(passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ..llmapi import LLM
    from ..sampling_params import SamplingParams
    kwargs: dict[str, Any] = {"device": "cpu", "kv_cache_config": {"max_tokens": 4096, "tokens_per_block": 32}}
    if args.drafter:
        kwargs["speculative_config"] = {"decoding_type": "DSpark", "speculative_model": args.drafter}
    if args.inductor:
        kwargs["torch_compile_config"] = {"enable_inductor": True}
    llm = LLM(args.model, **kwargs)
    try:
        llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, temperature=0.0))
        gc.unfreeze()
        tracked = len(gc.get_objects())
        tracked_ms = _best_pass_ms(args.passes)
        gc.freeze()
        return {"tracked_objects": tracked, "full_pass_ms_tracked": tracked_ms,
                "frozen_objects": gc.get_freeze_count(), "full_pass_ms_frozen": _best_pass_ms(args.passes),
                "config": {k: v for k, v in vars(args).items() if k != "json"}}
    finally:
        llm.shutdown()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target checkpoint folder")
    ap.add_argument("--drafter", default=None, help="DSpark drafter checkpoint folder (optional)")
    ap.add_argument("--inductor", action="store_true", help="torch_compile_config: {enable_inductor: true}")
    ap.add_argument("--passes", type=int, default=3, help="full passes timed per state (the best is reported)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.passes < 1:
        raise ValueError(f"--passes must be >= 1, got {args.passes}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = measure(args)
    print(f"tracked objects {out['tracked_objects']:,}: a full pass {out['full_pass_ms_tracked']:.1f} ms; "
          f"frozen {out['frozen_objects']:,}: {out['full_pass_ms_frozen']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
