"""Where a generation step's time goes on the GPU, DSpark arms next to no-spec, at one batch size.

Per arm (no-spec, then each `--drafter NAME=DIR`), FLASHINFER + CUDA graphs, B MT-Bench prompts
(chat template, `--ignore-eos`-style fixed length), after a warm-up generate:
1. host wall time per executor phase (`_build_segments`, `engine.forward`, the token choice and
   update (`_launch_choice` and `_complete` of a DSpark or plain step, `_launch_overlapped` of an
   overlapped plain step; `drafter.draft` inside `_complete`), the rest of `step`), as they fall (no extra syncs: a phase that waits for
   the device is charged the wait);
2. GPU kernel time per step from `torch.profiler` over a window of steps (sum of device time of
   all kernels and copies), so wall - GPU is the host-bound share;
   and a timeline of about two steps of device ops (name, us, the idle gap before each);
3. cProfile of the executor thread over the same generate, top functions by own time (in the JSON:
   one file per run, so a device call returns it whole).

`--waves W` submits W x B requests at `max_batch_size` B: as requests finish, prompts arrive beside
running ones (the served shape). The phase timers are then also split by step kind
(`phase_ms_by_step_kind`: steps with a prompt chunk against the others, ms per step of that kind),
which locates the cost of an arrival.

    python examples/gpu/spec_profile.py --model DIR --prompts eval_prompts.json \
        --drafter gqa=DIR --drafter mla=DIR --batch 64 --max-tokens 256 --out-dir OUT
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch

PHASES = ("_build_segments", "_launch_choice", "_complete", "_launch_overlapped")


def _wrap_timers(ex, timers: dict) -> None:
    """Instrument the executor's phases in place (wall seconds, no syncs)."""
    def timed(obj, name: str, key: str):
        fn = getattr(obj, name, None)
        if fn is None:           # a phase this executor does not have (its time falls in step_other)
            return

        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
                timers["n_" + key] += 1
        setattr(obj, name, run)
    for name in PHASES:
        timed(ex, name, name.strip("_"))
    timed(ex.engine, "forward", "forward")
    timed(ex.engine, "forward_spec", "forward_spec")   # the one-graph DSpark step (verify + draft)
    if ex.drafter is not None:
        timed(ex.drafter, "draft", "draft")
        # every device draft-step launch: from verify rows and arrivals (in _launch_choice) and from a
        # prompt's last row after a read (in _complete); a part of those phases, not a phase of its own
        timed(ex.drafter, "draft_ahead", "draft_ahead")
    timed(ex, "step", "step")


def _timeline(prof, count: int) -> list[dict]:
    """`count` device ops (about two steps) from the middle of the profiled window, in start order: name,
    microseconds and the idle gap before it (in a graph replay: the launch bubble between kernels)."""
    from torch.autograd import DeviceType
    ops = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    mid = max(len(ops) // 2 - count // 2, 1)
    return [{"name": e.name[:70], "us": round(e.time_range.elapsed_us(), 2),
             "gap_us": round(e.time_range.start - ops[i - 1].time_range.end, 2)}
            for i, e in zip(range(mid, mid + count), ops[mid:mid + count])]


def _gpu_ms_per_step(llm, prompts, params) -> dict:
    """torch.profiler over one generate: device time of kernels + memcpy per executor step."""
    from torch.profiler import ProfilerActivity, profile
    ex = llm._executor
    it0 = ex.iterations
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    n = max(ex.iterations - it0, 1)
    dev_us, launches = 0.0, 0
    rows, api = [], []
    for e in prof.key_averages():
        if e.key.startswith("cuda"):   # CUDA runtime calls: a long one is a wait (sync, pageable copy)
            api.append((e.self_cpu_time_total, e.key, e.count))
        d = getattr(e, "self_device_time_total", None)
        if d is None:
            d = getattr(e, "self_cuda_time_total", 0.0)
        if d > 0:
            dev_us += d
            launches += e.count
            rows.append((d, e.key, e.count))
    rows.sort(reverse=True)
    return {"profiled_steps": n, "gpu_ms_per_step": dev_us / 1000 / n, "gpu_ops_per_step": launches / n,
            "timeline": _timeline(prof, round(2 * launches / n)),
            "top_device": [{"name": k[:90], "ms_per_step": d / 1000 / n, "calls_per_step": c / n}
                           for d, k, c in rows[:40]],
            "top_host_cuda_api": [{"name": k, "host_ms_per_step": t / 1000 / n, "calls_per_step": c / n}
                                  for t, k, c in sorted(api, reverse=True)[:12]]}


def _cprofile_top(st: pstats.Stats, steps: int, n: int = 30) -> list[dict]:
    """The n functions with the most own time, then the n with the most cumulative time (those not
    listed already): calls and own / cumulative ms per executor step."""
    items = st.stats.items()
    own = sorted(items, key=lambda kv: kv[1][2], reverse=True)[:n]
    seen = {k for k, _ in own}
    cum = [kv for kv in sorted(items, key=lambda kv: kv[1][3], reverse=True) if kv[0] not in seen][:n]
    return [{"function": f"{Path(f).name}:{line}({fn})", "calls_per_step": nc / steps,
             "own_ms_per_step": 1000 * tt / steps, "cum_ms_per_step": 1000 * ct / steps}
            for (f, line, fn), (_cc, nc, tt, ct, _callers) in own + cum]


def _split_by_step_kind(ex, timers: dict, by_kind: dict) -> None:
    """Wrap `ex.step` (after `_wrap_timers`): each step's phase deltas go to by_kind["prompt"] when
    the step ran a prompt chunk, else to by_kind["other"] (with "n": the steps of that kind)."""
    step = ex.step

    def run():
        before, p0 = dict(timers), ex.prompt_steps
        try:
            return step()
        finally:
            kind = by_kind["prompt" if ex.prompt_steps != p0 else "other"]
            kind["n"] += 1
            for k, v in timers.items():
                if not k.startswith("n_"):
                    kind[k] += v - before.get(k, 0.0)
    ex.step = run


def _phases(timers: dict, n: int) -> dict:
    """ms per step of each executor phase over n steps (step_other: the rest of `step`)."""
    n = max(n, 1)
    step_ms = 1000 * timers["step"] / n
    phases = {k: 1000 * timers[k] / n for k in ("build_segments", "forward", "forward_spec", "launch_choice",
                                                "complete", "launch_overlapped")}
    phases["step_other"] = step_ms - sum(phases.values())
    phases["draft_launches"] = 1000 * timers["draft_ahead"] / n
    phases["draft_in_complete"] = 1000 * timers["draft"] / n
    return phases


def profile_arm(model: str, drafter: str | None, batch: int, max_tokens: int, prompts: list[str],
                name: str, attn_backend: str = "FLASHINFER", graphs: bool = True,
                kv_max_tokens: int = 262144, compile_regions: bool = False, waves: int = 1,
                arm_extra: dict | None = None) -> dict:
    from tensorrt_llm import LLM, SamplingParams
    kw = dict(attn_backend=attn_backend, use_cuda_graph=graphs, max_batch_size=batch,
              kv_cache_config={"max_tokens": kv_max_tokens})
    if compile_regions:
        kw["torch_compile_config"] = {"enable_inductor": True}
    if drafter:
        kw["speculative_config"] = {"decoding_type": "DSpark", "speculative_model": drafter}
    for key, value in (arm_extra or {}).items():      # speculative_config keys merge into the drafter's
        kw[key] = {**kw[key], **value} if key == "speculative_config" else value
    llm = LLM(model, **kw)
    ex = llm._executor
    chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts[:batch]]
    while len(chat) < batch:
        chat += chat[:batch - len(chat)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(chat, SamplingParams(max_tokens=32, ignore_eos=True))   # warm-up, graph capture
    llm.generate(chat, params)
    # waves > 1: the other prompts of the set, cycled, arrive as requests finish
    if waves > 1:
        chat = [llm.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}])
                for i in range(batch * waves)]

    # 1. phase timers
    timers: dict = defaultdict(float)
    _wrap_timers(ex, timers)
    by_kind = {"prompt": defaultdict(float), "other": defaultdict(float)}
    if waves > 1:       # a closed batch has one prompt step: its steps are not wrapped twice
        _split_by_step_kind(ex, timers, by_kind)
    t0, it0 = time.perf_counter(), ex.iterations
    hist0 = list(ex.drafter.stats()["accept_histogram"]) if ex.drafter is not None else []
    outs = llm.generate(chat, params)
    wall = time.perf_counter() - t0
    steps = ex.iterations - it0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    step_ms = 1000 * timers["step"] / max(timers["n_step"], 1)
    phases = _phases(timers, timers["n_step"])
    res = {"arm": name, "batch": batch, "waves": waves, "max_tokens": max_tokens, "wall_s": wall, "steps": steps,
           "tok_per_s": toks / wall, "ms_per_step": 1000 * wall / max(steps, 1),
           "step_ms_inside_step": step_ms, "phase_ms_per_step": phases,
           "phase_ms_by_step_kind": ({k: {"steps": int(v["n"]), **_phases(v, v["n"])} for k, v in by_kind.items()}
                                     if waves > 1 else None),
           "tokens_per_step": toks / max(steps, 1), "overlap_scheduler": llm.capacity_report["overlap_scheduler"],
           "continued_steps": ex.engine.num_continued_steps,
           "one_graph_steps": ex.engine.spec_step.num_launches if ex.engine.spec_step is not None else 0,
           # since the engine started (warm-up included): how prompt steps ran beside the step in flight
           "prompt_steps": {"total": ex.prompt_steps, "beside_in_flight": ex.prompts_beside_flight,
                            "beside_one_graph": ex.prompts_beside_one_graph,
                            "inside_one_graph": ex.engine.paths.one_graph_with_prompts,
                            "read_late": ex.prompts_read_late,
                            "read_in_flight_first": ex.reads_before_launch},
           "cuda_graphs": llm.capacity_report.get("cuda_graphs"),
           "drafter_regions": llm.capacity_report.get("drafter_regions")}
    if ex.drafter is not None:
        # acceptance over the timed run: AL per verify, and verifies per step (B when every request
        # verifies in every step; prefill steps and requests sitting out lower it)
        hist = [a - b for a, b in zip(ex.drafter.stats()["accept_histogram"], hist0)]
        verifies = sum(hist)
        res["acceptance_length"] = 1 + sum(i * n for i, n in enumerate(hist)) / max(verifies, 1)
        res["verifies_per_step"] = verifies / max(steps, 1)
        g = ex.drafter.graph_runner
        res["draft_graph_replays"] = g.graphs.num_replays if g else 0
        res["draft_graph_launches"] = g.num_launches if g else None
    # 2. GPU time per step (over another generate of the same requests)
    res.update(_gpu_ms_per_step(llm, chat, params))
    # 3. cProfile of the executor thread, by step kind (a step with a prompt chunk, or another)
    step, kinds = ex.step, {}     # kind -> [pstats.Stats, steps]

    def profiled_step():
        prof, p0 = cProfile.Profile(), ex.prompt_steps
        prof.enable()
        try:
            step()
        finally:
            prof.disable()
            kind = kinds.setdefault("prompt" if ex.prompt_steps != p0 else "other", [None, 0])
            if kind[0] is None:
                kind[0] = pstats.Stats(prof)
            else:
                kind[0].add(prof)
            kind[1] += 1
    ex.step = profiled_step
    llm.generate(chat, params)
    ex.step = step
    res["cprofile_top"] = {k: {"steps": n, "top": _cprofile_top(st, n)} for k, (st, n) in kinds.items()}
    llm.shutdown()
    del llm, ex
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="prepare_carry.sh's mtbench_prompts.json, or an "
                    "eval_acceptance --export-prompts JSON (mtbench is used)")
    ap.add_argument("--drafter", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--arm-extra", action="append", default=[], help="NAME=JSON: LLM arguments of that arm "
                    "(speculative_config merges into the drafter's), e.g. gqa=DIR and gqa_wait="
                    "'{\"batch_wait_timeout_iters\": 4}' with --drafter gqa_wait=DIR")
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-nospec", action="store_true", help="skip the no-spec arm")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--attn-backend", default="FLASHINFER", help="TRITON: DSpark steps overlap (KV lengths read "
                    "on the device); AUTO / VANILLA for a CPU smoke run")
    ap.add_argument("--kv-max-tokens", type=int, default=262144)
    ap.add_argument("--no-graphs", action="store_true", help="use_cuda_graph=False (CPU smoke run)")
    ap.add_argument("--compile", action="store_true", help="torch_compile_config: inductor layer regions")
    ap.add_argument("--waves", type=int, default=1, help="W x B requests at max_batch_size B: arrivals beside "
                    "running requests (1: a closed batch)")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = json.loads(Path(a.prompts).read_text())
    # prepare_carry.sh's mtbench_prompts.json ({"prompts": [...]}) or eval_acceptance's export
    prompts = doc["prompts"] if "prompts" in doc else [p["text"] for p in doc["mtbench"]]
    arms = ([] if a.no_nospec else [("nospec", None)]) + [tuple(d.split("=", 1)) for d in a.drafter]
    extra = {name: json.loads(js) for name, js in (e.split("=", 1) for e in a.arm_extra)}
    rows = []
    for b in a.batch:
        for name, path in arms:
            r = profile_arm(a.model, path, b, a.max_tokens, prompts, name, a.attn_backend, not a.no_graphs,
                            a.kv_max_tokens, a.compile, a.waves, extra.get(name))
            rows.append(r)
            ph = r["phase_ms_per_step"]
            print(f"{name:7s} B={b:3d} {r['tok_per_s']:8.0f} tok/s  {r['ms_per_step']:6.2f} ms/step "
                  f"(gpu {r['gpu_ms_per_step']:5.2f}, {r['gpu_ops_per_step']:5.0f} ops)  tok/step {r['tokens_per_step']:5.1f}  "
                  + (f"AL {r['acceptance_length']:.2f} verifies/step {r['verifies_per_step']:.1f}  "
                     if "acceptance_length" in r else "")
                  + "  ".join(f"{k} {v:5.2f}" for k, v in ph.items()), flush=True)
            if a.waves > 1:
                for kind, v in r["phase_ms_by_step_kind"].items():
                    print(f"    {kind} steps ({v['steps']}): " + "  ".join(
                        f"{k} {x:5.2f}" for k, x in v.items() if k != "steps"), flush=True)
            (out / "spec_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
