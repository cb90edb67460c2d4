"""trtllm-serve against the same engine offline, in one lease: the server's overhead per level.

For each arm (no-spec, DSpark-GQA, DSpark-MLA; one YAML each, as `trtllm-serve --config` takes it):
1. offline: `trtllm-bench` (the LLM API in-process) in a subprocess, MT-Bench first turns with the
   chat template, every request exactly --max-tokens tokens, T = 0, at each concurrency level;
2. served: `trtllm-serve MODEL --config ARM.yaml` in a subprocess, then `trtllm-bench --backend
   openai` (streaming chat completions, the same prompts, the same levels; AL from /metrics).
Arms run in the order given, offline before served for each; the report has both rows per level and
the server's overhead (1 - served / offline output tok/s). Writes OUT/serve_bench.json and .md only
(a device call returns few files); the YAMLs, per-run JSON and logs stay in --work-dir, and a failed
run's log tail goes into the report.

Device call (after the carry parts; examples/gpu/prepare_carry.sh carries the server's wheels):
  run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/serve_bench.py --out $OUT/serve",
      carry=[], timeout_s=600)
Both DSpark and no-spec arms use --backend (default TRITON: no flashinfer JIT on a fresh machine).
On a CPU (a dry run of the script itself): --model a small checkpoint --device cpu --arms nospec.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from sidebyside import DEVICE_CARRY, DEVICE_MODEL, drafter_dir  # noqa: E402

sys.path.insert(0, str(REPO))
from tensorrt_llm.bench.lm_eval_gsm8k import start_server, stop_server  # noqa: E402
from tensorrt_llm.bench.yaml_option import yaml_mapping  # noqa: E402


def arm_yaml(arm: str, backend: str, device: str, kv_tokens: int, extra: dict, drafters: dict) -> dict:
    args = {"device": device, "attn_backend": backend, "use_cuda_graph": device == "cuda",
            "kv_cache_config": {"max_tokens": kv_tokens}, **extra}
    if arm != "nospec":
        args["speculative_config"] = {"decoding_type": "DSpark", "speculative_model": drafters[arm]}
    return args


def bench_argv(a: argparse.Namespace) -> list[str]:
    """The options both trtllm-bench runs share (the same prompts and levels)."""
    argv = ["--dataset", "mtbench", "--num-requests", "80", "--concurrency", *map(str, a.concurrency),
            "--waves", str(a.waves), "--min-requests", str(a.min_requests), "--max-tokens", str(a.max_tokens),
            "--ignore-eos", "--log-level", "error"]
    if a.dataset_cache_dir:
        argv += ["--dataset-cache-dir", a.dataset_cache_dir]
    return argv


def run_bench(argv: list[str], json_out: Path, log: Path, timeout: float) -> dict:
    """`python -m tensorrt_llm.bench.benchmark ARGV --json json_out` -> its report; its output in `log`."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "tensorrt_llm.bench.benchmark", *argv, "--json", str(json_out)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout).returncode
    if rc != 0 or not json_out.is_file():
        raise RuntimeError(f"trtllm-bench exited with {rc}:\n{log.read_text()[-2000:]}")
    return json.loads(json_out.read_text())


def overhead_rows(arm: str, offline: dict, served: dict) -> list[dict]:
    by_c = {r["concurrency"]: r for r in offline["results"]}
    rows = []
    for s in served["results"]:
        o = by_c.get(s["concurrency"])
        if o is None:
            continue
        rows.append({"arm": arm, "concurrency": s["concurrency"], "offline_tok_s": o["output_tok_s"],
                     "served_tok_s": s["output_tok_s"], "overhead": 1.0 - s["output_tok_s"] / o["output_tok_s"],
                     "served_failures": s["failures"], "offline_ttft_p50_s": o["ttft_p50_s"],
                     "served_ttft_p50_s": s["ttft_p50_s"], "offline_al": (o.get("speculative") or {}).get("acceptance_length"),
                     "served_al": s["acceptance_length"]})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| arm | C | offline tok/s | served tok/s | server overhead | failures | TTFT p50 ms offline / served | AL offline / served |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        al = " / ".join("-" if x is None else f"{x:.2f}" for x in (r["offline_al"], r["served_al"]))
        out.append(f"| {r['arm']} | {r['concurrency']} | {r['offline_tok_s']:,.0f} | {r['served_tok_s']:,.0f} | "
                   f"{100 * r['overhead']:.1f}% | {r['served_failures']} | {1e3 * r['offline_ttft_p50_s']:.1f} / "
                   f"{1e3 * r['served_ttft_p50_s']:.1f} | {al} |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEVICE_MODEL)
    ap.add_argument("--arms", default="nospec,mla", help="comma-separated subset of nospec,gqa,mla")
    ap.add_argument("--gqa", default=None)
    ap.add_argument("--mla", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="TRITON")
    ap.add_argument("--kv-tokens", type=int, default=262144)
    ap.add_argument("--extra-yaml", default="{torch_compile_config: {enable_inductor: true}}",
                    help="YAML mapping merged into every arm's args ('{}' for none)")
    ap.add_argument("--dataset-cache-dir", default=str(DEVICE_CARRY / "ds") if (DEVICE_CARRY / "ds").is_dir() else None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout-s", type=float, default=240, help="per trtllm-bench run and per server start")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", default=None, help="YAMLs, per-run JSON and logs (default: a new temp folder)")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - {"nospec", "gqa", "mla"}:
        ap.error(f"--arms {a.arms!r}: choose from nospec,gqa,mla")
    try:
        extra = yaml_mapping(a.extra_yaml, "--extra-yaml")
    except ValueError as e:
        ap.error(str(e))
    drafters = {"gqa": a.gqa or drafter_dir("gqa"), "mla": a.mla or drafter_dir("mla")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="serve_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": {**vars(a), "work_dir": str(work)}, "arms": {}, "rows": []}
    t0 = time.perf_counter()
    for arm in arms:
        cfg = work / f"{arm}.yaml"
        cfg.write_text(yaml.safe_dump(arm_yaml(arm, a.backend, a.device, a.kv_tokens, extra, drafters)))
        entry = report["arms"][arm] = {"yaml": yaml.safe_load(cfg.read_text())}
        try:
            offline = run_bench(["--model", a.model, "--extra-llm-api-options", str(cfg), *bench_argv(a)],
                                work / f"{arm}_offline.json", work / f"{arm}_offline.log", a.timeout_s)
            entry["offline"] = {"rows": offline["results"], "capacity": offline["capacity_report"]}
            folder = work / f"{arm}_server"
            folder.mkdir(exist_ok=True)
            proc, url = start_server(a.model, arm, entry["yaml"], folder, a.timeout_s)   # folder/server.log
            try:
                served = run_bench(["--backend", "openai", "--base-url", url, *bench_argv(a)],
                                   work / f"{arm}_served.json", work / f"{arm}_client.log", a.timeout_s)
            finally:
                stop_server(proc)
            entry["served"] = {"rows": served["results"]}
            report["rows"] += overhead_rows(arm, offline, served)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            entry["error"] = str(e)[-2000:]
            print(f"[serve_bench] {arm}: {entry['error']}", file=sys.stderr, flush=True)
        entry["t_s"] = round(time.perf_counter() - t0, 1)
        (out / "serve_bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"[serve_bench +{entry['t_s']:.0f}s] {arm} done", flush=True)
    table = markdown(report["rows"])
    (out / "serve_bench.md").write_text(table + "\n")
    print(table)
    return 0 if all("error" not in e for e in report["arms"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
