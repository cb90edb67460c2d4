"""trtllm-serve against the same engine offline, in one lease: the server's overhead per level.

Arms (no-spec, DSpark-GQA, DSpark-MLA; one YAML each, as `trtllm-serve --config` takes it) plus
served-only variants (`--variant NAME=ARM:YAML`, e.g. `nospec_si8=nospec:{stream_interval: 8}`: a
server whose YAML is ARM's merged with YAML, compared against ARM's offline figures). Every engine is
built ONCE: one offline `LLM` per arm in this process, one `trtllm-serve` subprocess per arm and
variant (started together), all resident on the device together. Then `--rounds` rounds; round r runs the arms in the
order rotated by r, and per arm: offline (`run_concurrency` of `trtllm-bench`'s engine path: MT-Bench
first turns with the chat template, every request exactly --max-tokens tokens, T = 0, each
concurrency level), then served for the arm and each of its variants (`trtllm-bench --backend
openai` in a subprocess: streaming chat completions, the same prompts and levels, AL from /metrics).
The report gives per (server, C) the median and min-max over rounds of offline and served tok/s,
the server's overhead (1 - served / offline, of the medians), TTFT p50 and AL. Writes
OUT/serve_bench.json and .md only; YAMLs, per-run JSON and logs stay in --work-dir, and a failed
run's log tail goes into the report.

Device call (after the carry parts; examples/gpu/prepare_carry.sh carries the server's wheels):
  run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/serve_bench.py --out $OUT/serve",
      carry=[], timeout_s=600)
Both DSpark and no-spec arms use --backend (default on cuda TRITON: no flashinfer JIT on a fresh machine).
On a CPU (a dry run of the script itself): --model a small checkpoint --device cpu --arms nospec.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from sidebyside import DEVICE_CARRY, DEVICE_MODEL, drafter_dir  # noqa: E402

sys.path.insert(0, str(REPO))
from tensorrt_llm import LLM, SamplingParams  # noqa: E402
from tensorrt_llm.bench import benchmark, datasets  # noqa: E402
from tensorrt_llm.bench.lm_eval_gsm8k import start_server, stop_server  # noqa: E402
from tensorrt_llm.bench.sidebyside import rotated  # noqa: E402
from tensorrt_llm.bench.yaml_option import yaml_mapping  # noqa: E402

ARMS = ("nospec", "gqa", "mla")


def arm_yaml(arm: str, backend: str, device: str, kv_tokens: int, extra: dict, drafters: dict) -> dict:
    args = {"device": device, "attn_backend": backend, "use_cuda_graph": device == "cuda",
            "kv_cache_config": {"max_tokens": kv_tokens}, **extra}
    if arm != "nospec":
        args["speculative_config"] = {"decoding_type": "DSpark", "speculative_model": drafters[arm]}
    return args


def parse_variant(text: str, arms: list[str]) -> tuple[str, str, dict]:
    """``NAME=ARM:YAML`` -> (name, arm, YAML mapping merged into the arm's server YAML)."""
    name, sep, rest = text.partition("=")
    arm, sep2, spec = rest.partition(":")
    if not (sep and sep2 and name and spec) or arm not in arms:
        raise ValueError(f"--variant {text!r}: expected NAME=ARM:YAML with ARM one of {arms}")
    if name in ARMS:
        raise ValueError(f"--variant {text!r}: NAME must differ from the arm names {ARMS}")
    return name, arm, yaml_mapping(spec, f"--variant {name}")


def bench_argv(a: argparse.Namespace) -> list[str]:
    """The served client's options (the offline rows use the same prompts and levels)."""
    argv = ["--dataset", "mtbench", "--num-requests", "80", "--concurrency", *map(str, a.concurrency),
            "--waves", str(a.waves), "--min-requests", str(a.min_requests), "--max-tokens", str(a.max_tokens),
            "--ignore-eos", "--log-level", "error"]
    if a.dataset_cache_dir:
        argv += ["--dataset-cache-dir", a.dataset_cache_dir]
    return argv


def run_client(url: str, a: argparse.Namespace, json_out: Path, log: Path) -> list[dict]:
    """`trtllm-bench --backend openai` against `url` in a subprocess -> its rows (one per level)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = ["--backend", "openai", "--base-url", url, *bench_argv(a), "--json", str(json_out)]
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "tensorrt_llm.bench.benchmark", *argv], stdout=f,
                            stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=a.timeout_s).returncode
    if rc != 0 or not json_out.is_file():
        raise RuntimeError(f"trtllm-bench --backend openai exited with {rc}:\n{log.read_text()[-2000:]}")
    return json.loads(json_out.read_text())["results"]


class Offline:
    """One arm's engine in this process, its MT-Bench prompts tokenized once, warmed up."""

    def __init__(self, model: str, cfg: Path, a: argparse.Namespace):
        self.llm = LLM(args=benchmark.build_llm_args(model, str(cfg), a.concurrency))
        texts = datasets.load_prompts("mtbench", 80, a.dataset_cache_dir)
        self.prompts = benchmark.tokenize_prompts(self.llm, texts, True, a.max_tokens, None)
        self.params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
        self.llm.generate_async(self.prompts[0], self.params).result()    # warm-up, not timed
        self.a = a

    def run(self) -> list[dict]:
        return [benchmark.run_concurrency(self.llm, benchmark.level_prompts(self.prompts, c, self.a.waves,
                                                                             self.a.min_requests), c, self.params)
                for c in self.a.concurrency]


def _spread(xs: list[Optional[float]]) -> Optional[dict]:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def summarize(runs: list[dict], servers: dict[str, str]) -> list[dict]:
    """Per (server, C): spreads over rounds of offline (its arm's) and served rows."""
    out = []
    for name, arm in servers.items():
        for c in sorted({r["concurrency"] for r in runs if r["server"] == name}):
            off = [r for r in runs if r["kind"] == "offline" and r["server"] == arm and r["concurrency"] == c]
            srv = [r for r in runs if r["kind"] == "served" and r["server"] == name and r["concurrency"] == c]
            o, s = _spread([r["output_tok_s"] for r in off]), _spread([r["output_tok_s"] for r in srv])
            out.append({"server": name, "arm": arm, "concurrency": c, "offline_tok_s": o, "served_tok_s": s,
                        "overhead": 1.0 - s["median"] / o["median"] if o and s else None,
                        "served_failures": sum(r["failures"] for r in srv),
                        "offline_ttft_p50_s": _spread([r["ttft_p50_s"] for r in off]),
                        "served_ttft_p50_s": _spread([r["ttft_p50_s"] for r in srv]),
                        "served_itl_mean_s": _spread([r["itl_mean_s"] for r in srv]),
                        "offline_al": _spread([(r.get("speculative") or {}).get("acceptance_length") for r in off]),
                        "served_al": _spread([r["acceptance_length"] for r in srv])})
    return out


def _cell(s: Optional[dict], fmt: str = "{:,.0f}", scale: float = 1.0) -> str:
    if s is None:
        return "-"
    return f"{fmt.format(scale * s['median'])} ({fmt.format(scale * s['min'])}-{fmt.format(scale * s['max'])})"


def markdown(rows: list[dict]) -> str:
    out = ["| server | C | offline tok/s | served tok/s | server overhead | failures | TTFT p50 ms offline / served "
           "| ITL mean ms served | AL offline / served |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ov = "-" if r["overhead"] is None else f"{100 * r['overhead']:.1f}%"
        ttft = " / ".join(_cell(r[k], "{:.1f}", 1e3) for k in ("offline_ttft_p50_s", "served_ttft_p50_s"))
        al = " / ".join("-" if r[k] is None else f"{r[k]['median']:.2f}" for k in ("offline_al", "served_al"))
        out.append(f"| {r['server']} | {r['concurrency']} | {_cell(r['offline_tok_s'])} | {_cell(r['served_tok_s'])} "
                   f"| {ov} | {r['served_failures']} | {ttft} | {_cell(r['served_itl_mean_s'], '{:.2f}', 1e3)} "
                   f"| {al} |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEVICE_MODEL)
    ap.add_argument("--arms", default="nospec,mla", help="comma-separated subset of nospec,gqa,mla")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:YAML",
                    help="a served-only variant of ARM (its offline figures are ARM's); repeatable")
    ap.add_argument("--gqa", default=None)
    ap.add_argument("--mla", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="attn_backend (default: TRITON on cuda, AUTO elsewhere)")
    ap.add_argument("--kv-tokens", type=int, default=262144)
    ap.add_argument("--extra-yaml", default="{torch_compile_config: {enable_inductor: true}}",
                    help="YAML mapping merged into every arm's args ('{}' for none)")
    ap.add_argument("--dataset-cache-dir", default=str(DEVICE_CARRY / "ds") if (DEVICE_CARRY / "ds").is_dir() else None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout-s", type=float, default=240, help="per client run and per server start")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", default=None, help="YAMLs, per-run JSON and logs (default: a new temp folder)")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - set(ARMS) or a.rounds < 1:
        ap.error(f"--arms {a.arms!r}: choose from {','.join(ARMS)}; --rounds must be >= 1")
    try:
        extra = yaml_mapping(a.extra_yaml, "--extra-yaml")
        variants = [parse_variant(v, arms) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    a.backend = a.backend or ("TRITON" if a.device == "cuda" else "AUTO")
    drafters = {"gqa": str(Path(a.gqa or drafter_dir("gqa")).resolve()),
                "mla": str(Path(a.mla or drafter_dir("mla")).resolve())}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="serve_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    servers = {arm: arm for arm in arms} | {name: arm for name, arm, _ in variants}   # server name -> its arm
    yamls = {arm: arm_yaml(arm, a.backend, a.device, a.kv_tokens, extra, drafters) for arm in arms}
    yamls |= {name: {**yamls[arm], **more} for name, arm, more in variants}
    report: dict[str, Any] = {"config": {**vars(a), "work_dir": str(work)}, "yaml": yamls, "errors": {},
                              "runs": [], "rows": []}
    t0 = time.perf_counter()

    def save(msg: str) -> None:
        report["t_s"] = round(time.perf_counter() - t0, 1)
        (out / "serve_bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"[serve_bench +{report['t_s']:.0f}s] {msg}", flush=True)

    live: dict[str, tuple[subprocess.Popen, str]] = {}
    offline: dict[str, Offline] = {}
    try:
        def start(name: str) -> tuple[subprocess.Popen, str]:
            folder = work / f"{name}_server"
            folder.mkdir(exist_ok=True)
            return start_server(a.model, name, yamls[name], folder, a.timeout_s)    # folder/server.log

        with ThreadPoolExecutor(len(yamls)) as pool:     # every server once, started together, up for all rounds
            for name, fut in [(n, pool.submit(start, n)) for n in yamls]:
                try:
                    live[name] = fut.result()
                except RuntimeError as e:
                    report["errors"][f"{name} server"] = str(e)[-2000:]
                save(f"server {name}: {'up' if name in live else 'failed'}")
        for arm in arms:
            cfg = work / f"{arm}.yaml"
            cfg.write_text(yaml.safe_dump(yamls[arm]))
            try:
                offline[arm] = Offline(a.model, cfg, a)
            except (RuntimeError, ValueError) as e:
                report["errors"][f"{arm} offline"] = str(e)[-2000:]
            save(f"offline {arm}: {'built' if arm in offline else 'failed'}")
        for r in range(a.rounds):
            for arm in rotated(arms, r):
                if arm in offline:
                    for row in offline[arm].run():
                        report["runs"].append({**row, "kind": "offline", "server": arm, "round": r})
                for name in [n for n, m in servers.items() if m == arm and n in live]:
                    try:
                        rows = run_client(live[name][1], a, work / f"{name}_r{r}.json", work / f"{name}_r{r}.log")
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        report["errors"][f"{name} round {r}"] = str(e)[-2000:]
                        continue
                    report["runs"] += [{**row, "kind": "served", "server": name, "round": r} for row in rows]
                save(f"round {r} {arm} done")
    finally:
        for proc, _ in live.values():
            stop_server(proc)
        for o in offline.values():
            o.llm.shutdown()
    report["rows"] = summarize(report["runs"], servers)
    save("done")
    table = markdown(report["rows"])
    (out / "serve_bench.md").write_text(table + "\n")
    print(table)
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
