"""Per-step host (Python) time of a steady-state DSpark step, measured on the CPU.

    python -m tensorrt_llm.bench.spec_host_overhead --model DIR --drafter DIR [--batch-sizes 1 16 64] [--json out.json]
    python -m tensorrt_llm.bench.spec_host_overhead ... --waves 4     # steps with arriving prompts vs without

On the H200 a one-graph DSpark step at batch 64 runs ~2 ms of GPU work, and the host's share of the
same step (launch, reading the step in flight, per-request bookkeeping) is about as long, so the host
decides the step time (`docs/performance.md`, known bottlenecks). This runs the real engine on the
CPU (`LLM`, overlap scheduler, the one-graph step without CUDA graphs: `SpecStepGraph.run` replays
its forward directly) and times the steps of a batch that is all generating: every request
submitted at once, `ignore_eos`, timing from `--warmup` steps after the last prompt chunk for
`--steps` steps (a request finishing inside them restarts the count), then aborting the requests.
The one-graph forward (the GPU's work on a GPU: target verify, acceptance, the drafter block) is
timed apart and subtracted. Components per step, in milliseconds:

    schedule       Scheduler.schedule
    segments       from the end of scheduling to the launch: which requests continue from the step
                   in flight, and build_segments (each one's next segment, its drafts on the device)
    graph_inputs   the target runner's plan + load_inputs, the draft block's prepare_block
    launch_other   the rest of the one-graph launch (SpecStepGraph.run without the forward)
    complete       reading the step in flight and applying it (acceptance, append + stop criteria,
                   KV commit, drafts attached): PyExecutor._complete_part
    other          the rest of PyExecutor.step
    host           the step without the forward (the sum of the above)
    forward        the one-graph forward (not host time; CPU compute here)

With `--waves W` it measures the steps of a batch with arrivals instead (`run_arrivals`): host ms
per step with a prompt chunk (the one-graph step with prompts inside, `MixedSpecGraph`, or beside it)
and without, and how many of each were timed.

Each value is the mean per timed step of one run, the minimum over `--rounds` runs (other load on
the machine only ever adds time). The model's size changes only `forward`; a tiny random target
and drafter measure the same host path.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from .host_overhead import StepTimer

if TYPE_CHECKING:
    from ..llmapi import LLM

COMPONENTS = ("schedule", "segments", "graph_inputs", "launch_other", "complete", "other", "host", "forward")
ARRIVAL_COLUMNS = ("host_plain", "host_prompt", "steps_plain", "steps_prompt")


def _build_llm(args: argparse.Namespace, batch: int) -> "LLM":
    """The engine under test on the CPU: overlap scheduler on, the DSpark drafter, room for the batch."""
    from ..llmapi import LLM
    return LLM(args.model, device="cpu", max_batch_size=batch, disable_overlap_scheduler=False,
               kv_cache_config={"max_tokens": batch * (args.prompt_len + args.max_tokens + 64) + 1024,
                                "tokens_per_block": args.tokens_per_block},
               speculative_config={"decoding_type": "DSpark", "speculative_model": args.drafter})


def run_once(args: argparse.Namespace, batch: int, seed: int) -> dict[str, float]:
    """Mean ms per timed step of each component, for one fresh engine."""
    from ..sampling_params import SamplingParams

    llm = _build_llm(args, batch)
    try:
        ex, timer = llm._executor, StepTimer()
        spec = ex.engine.spec_step
        if spec is None:
            raise ValueError(f"drafter {args.drafter} runs no one-graph step here (docs/dspark.md)")
        ex.scheduler.schedule = timer.wrap(ex.scheduler.schedule, "schedule", mark=True)
        ex._complete_part = timer.wrap(ex._complete_part, "complete")
        spec.target.plan = timer.wrap(spec.target.plan, "graph_inputs")
        spec.target.load_inputs = timer.wrap(spec.target.load_inputs, "graph_inputs")
        spec.draft.prepare_block = timer.wrap(spec.draft.prepare_block, "graph_inputs")
        spec.graphs.replay = timer.wrap(spec.graphs.replay, "forward")
        ex.engine.forward_spec = timer.wrap(ex.engine.forward_spec, "launch", mark=True)
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, 400) for _ in range(args.prompt_len)] for _ in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        step, state = ex.step, {"steady": 0, "timed": 0}

        def timed_step() -> None:
            sched = ex.scheduler
            steady = len(sched.running) == batch and not sched.waiting and \
                all(r.remaining_prompt() == 0 for r in sched.running)
            state["steady"] = state["steady"] + 1 if steady else 0
            timer.on = args.warmup <= state["steady"] < args.warmup + args.steps
            timer.marks.clear()
            kept = dict(timer.acc)
            t0 = time.perf_counter()
            step()
            m = timer.marks
            if timer.on and "launch_enter" not in m:    # launched nothing (requests ending): not counted
                timer.acc = kept
            elif timer.on:
                timer.add("step", time.perf_counter() - t0)
                timer.add("segments", m["launch_enter"] - m["schedule_exit"])
                state["timed"] += 1
                if state["timed"] == args.steps:    # the window is complete: the rest is not measured
                    for r in sched.running:
                        ex.abort(r.request_id)
            timer.on = False
        ex.step = timed_step
        llm.generate(prompts, params)
    finally:
        llm.shutdown()
    n = state["timed"]
    if n < args.steps:
        raise ValueError(f"only {n} of {args.steps} steps were timed: raise --max-tokens or lower --warmup / --steps")
    g = {k: v * 1e3 / n for k, v in timer.acc.items()}
    get = lambda k: g.get(k, 0.0)  # noqa: E731
    out = {"schedule": get("schedule"), "segments": get("segments"), "graph_inputs": get("graph_inputs"),
           "launch_other": get("launch") - get("graph_inputs") - get("forward"), "complete": get("complete"),
           "forward": get("forward"), "host": get("step") - get("forward")}
    out["other"] = out["host"] - sum(out[k] for k in ("schedule", "segments", "graph_inputs", "launch_other",
                                                       "complete"))
    return out


def run_arrivals(args: argparse.Namespace, batch: int, seed: int) -> dict[str, float]:
    """Host ms per step with and without an arriving prompt chunk, for one fresh engine: `--waves` x
    batch requests queued at once with lengths drawn from [--min-tokens, --max-tokens], so requests end
    at different steps and each end admits a waiting prompt, as at a fixed concurrency. Timed from the
    first step without a prompt chunk until the queue is empty. Not counted as host time: the
    forwards (both graph forms' and any prompt forward beside them); with prompts, making the step's
    graph inputs anew (a GPU replays a captured entry instead: `MixedSpecGraph._new_entry`); for
    prompts beside the one-graph step, their draft launch and the drafter's draft-context write."""
    from ..sampling_params import SamplingParams

    llm = _build_llm(args, batch)
    try:
        ex, timer = llm._executor, StepTimer()
        engine = ex.engine
        if engine.spec_step is None or engine.mixed_step is None:
            raise ValueError(f"drafter {args.drafter} runs no one-graph step with prompts here (docs/dspark.md)")
        engine.spec_step.graphs.replay = timer.wrap(engine.spec_step.graphs.replay, "forward")
        engine.mixed_step.graphs.replay = timer.wrap(engine.mixed_step.graphs.replay, "forward")
        engine.mixed_step._new_entry = timer.wrap(engine.mixed_step._new_entry, "forward")
        engine.forward = timer.wrap(engine.forward, "forward")
        # prompts beside the one-graph step: their draft launch and eager draft-context write (device work)
        drafter = ex.drafter
        drafter.graph_runner.graphs.replay = timer.wrap(drafter.graph_runner.graphs.replay, "forward")
        drafter._write_context = timer.wrap(drafter._write_context, "forward")
        rng = random.Random(seed)
        n = args.waves * batch
        prompts = [[rng.randrange(3, 400) for _ in range(args.prompt_len)] for _ in range(n)]
        params = [SamplingParams(max_tokens=rng.randint(args.min_tokens, args.max_tokens), temperature=0.0,
                                 ignore_eos=True) for _ in range(n)]
        step, acc, started = ex.step, {"plain": [0, 0.0], "prompt": [0, 0.0]}, [False]

        def timed_step() -> None:
            timer.on = started[0] and bool(ex.scheduler.waiting)
            forward0, prompts0 = timer.acc.get("forward", 0.0), ex.prompt_steps
            t0 = time.perf_counter()
            step()
            with_prompt = ex.prompt_steps != prompts0
            if timer.on:
                kind = acc["prompt" if with_prompt else "plain"]
                kind[0] += 1
                kind[1] += time.perf_counter() - t0 - (timer.acc.get("forward", 0.0) - forward0)
            started[0] = started[0] or (prompts0 > 0 and not with_prompt)   # the first batch's prompts are in
            timer.on = False
        ex.step = timed_step
        llm.generate(prompts, params)
    finally:
        llm.shutdown()
    (n_plain, t_plain), (n_prompt, t_prompt) = acc["plain"], acc["prompt"]
    if not n_plain or not n_prompt:
        raise ValueError(f"{n_plain} steps without and {n_prompt} with a prompt chunk were timed: "
                         "raise --waves or widen --min-tokens .. --max-tokens")
    return {"host_plain": 1e3 * t_plain / n_plain, "host_prompt": 1e3 * t_prompt / n_prompt,
            "steps_plain": n_plain, "steps_prompt": n_prompt}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    results = {}
    run, columns = (run_arrivals, ARRIVAL_COLUMNS) if args.waves else (run_once, COMPONENTS)
    for b in args.batch_sizes:
        runs = [run(args, b, seed=r) for r in range(args.rounds)]
        results[str(b)] = {k: min(r[k] for r in runs) for k in columns}
    return {"ms_per_step": results, "config": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine()}}


def format_table(results: dict[str, dict[str, float]]) -> str:
    bs = list(results)
    lines = ["| ms per step | " + " | ".join(f"B={b}" for b in bs) + " |", "|---|" + "---|" * len(bs)]
    for c in results[bs[0]]:
        lines.append(f"| {c} | " + " | ".join(f"{results[b][c]:.3f}" for b in bs) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target checkpoint folder")
    ap.add_argument("--drafter", required=True, help="DSpark drafter checkpoint folder")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256, help="per request (a bound: the requests are aborted "
                    "after the timed steps)")
    ap.add_argument("--warmup", type=int, default=4, help="steady steps before timing starts")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="fresh runs per batch size (minimum reported)")
    ap.add_argument("--waves", type=int, default=0, help="arrivals mode: waves x B requests of lengths drawn from "
                    "[--min-tokens, --max-tokens], host ms of steps with and without a prompt chunk")
    ap.add_argument("--min-tokens", type=int, default=16, help="arrivals mode: the shortest request")
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4, help="torch intra-op threads")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.rounds < 1:
        raise ValueError("--batch-sizes, --steps and --rounds must be >= 1")
    if args.waves < 0 or (args.waves and not 1 <= args.min_tokens <= args.max_tokens):
        raise ValueError(f"--waves must be >= 0 and 1 <= --min-tokens <= --max-tokens, got {args.waves}, "
                         f"{args.min_tokens}, {args.max_tokens}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = measure(args)
    print(format_table(out["ms_per_step"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
