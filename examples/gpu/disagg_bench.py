"""Disaggregated CTX/GEN serving against aggregated serving, on ONE GPU, per drafter arm.

For each arm of --arms (gqa, mla, nospec; one YAML each, as `trtllm-serve --config` takes it), every
server is started ONCE, all of them in parallel, and kept up across the rounds:
- aggregated: `trtllm-serve MODEL --config ARM.yaml`;
- disaggregated: a CTX worker and a GEN worker (`--server_role context|generation`, two processes on
  the same GPU, KV of both pools over NIXL: VRAM -> VRAM through UCX) and the router
  (`trtllm-serve disaggregated -c disagg.yaml`).
A round runs `trtllm-bench --backend openai` (streaming chat completions, or --api completions;
MT-Bench first turns, --max-tokens output tokens with --ignore-eos, T = 0) at each --concurrency
level against the aggregated server, then against the router; rounds alternate the arm order. Around
each disaggregated run the GEN worker's GET /disagg/state gives that run's transfers (pages, bytes per
pool, seconds); the client reads AL from the GEN worker's /metrics (`--metrics-url`: the router has none).

Report (median and min-max over rounds): output tok/s, TTFT / TPOT p50 and mean, failures and AL for
aggregated vs disaggregated; KV bytes per request per pool (target, draft), transfer GB/s (median,
min-max over the requests) and the draft bytes GQA / MLA. Writes OUT/disagg_bench.json and .md only
(rewritten after every round); YAMLs, per-run JSON and logs stay in --work-dir. A failed server or
run puts its log tail into the report and the script goes on.

Device call (after the carry parts, see examples/gpu/prepare_carry.sh; nixl on PYTHONPATH):
  . examples/gpu/device_setup.sh >/dev/null && python3 examples/gpu/disagg_bench.py --out $OUT/disagg
Time on the H200 (2026-12-03): the six servers' parallel start took 118 s (CUDA graphs + torch.compile;
--start-timeout-s 360 each), each round of 2 arms x 2 modes at C=16 with 32 requests 22-25 s, 187 s in
all; --deadline-s (default 500) starts no round that would end past it, and the report is rewritten after
every round.
CPU dry run (the tiny chat target of the serving tests, the trained tiny MLA drafter, a random GQA one):
  python3 examples/gpu/disagg_bench.py --device cpu --tiny-cpu /tmp/dbench_tiny --dataset default \\
      --num-requests 4 --concurrency 2 --max-tokens 16 --rounds 2 --kv-tokens 4096 --out /tmp/dbench_out
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
from typing import Any, Callable, Optional

import httpx
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from serve_bench import arm_yaml  # noqa: E402
from sidebyside import DEVICE_CARRY, DEVICE_MODEL, drafter_dir  # noqa: E402

sys.path.insert(0, str(REPO))
from tensorrt_llm.bench.lm_eval_gsm8k import (OFFLINE_ENV, free_port, start_server, stop_server,  # noqa: E402
                                              wait_healthy)
from tensorrt_llm.bench.sidebyside import rotated  # noqa: E402
from tensorrt_llm.bench.yaml_option import yaml_mapping  # noqa: E402

ARMS = ("nospec", "gqa", "mla")
ROW_KEYS = ("output_tok_s", "ttft_p50_s", "ttft_mean_s", "tpot_p50_s", "tpot_mean_s", "failures", "al")


def tail(path: Path, n: int = 2000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} missing)"


def run_client(argv: list[str], json_out: Path, log: Path, timeout: float) -> dict:
    """`trtllm-bench ARGV --json json_out` in a subprocess (output in `log`) -> its first row."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "tensorrt_llm.bench.benchmark", *argv, "--json", str(json_out)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout).returncode
    if rc != 0 or not json_out.is_file():
        raise RuntimeError(f"trtllm-bench exited with {rc}:\n{tail(log)}")
    return json.loads(json_out.read_text())["results"][0]


def start_router(ctx: str, gen: str, folder: Path, timeout: float) -> tuple[Any, str]:
    """`trtllm-serve disaggregated -c folder/disagg.yaml` over one CTX and one GEN worker."""
    port = free_port()
    cfg = folder / "disagg.yaml"
    cfg.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "context_servers": {"urls": [ctx]},
                                   "generation_servers": {"urls": [gen]}, "request_timeout_s": timeout}))
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(folder / "router.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tensorrt_llm.serve.cli", "disaggregated", "-c", str(cfg),
                                 "--log_level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, folder / "router.log", "router", timeout)
    return proc, url


class ArmServers:
    """The aggregated server, the CTX and GEN workers and the router of one arm (started once)."""

    def __init__(self, arm: str, model: str, args: dict, work: Path):
        self.arm, self.model, self.args = arm, model, args
        self.folders = {k: work / f"{arm}_{k}" for k in ("agg", "ctx", "gen", "router")}
        for f in self.folders.values():
            f.mkdir(parents=True, exist_ok=True)
        self.procs: list[Any] = []
        self.urls: dict[str, str] = {}

    def start(self, pool: ThreadPoolExecutor, timeout: float) -> None:
        """Aggregated, CTX and GEN in parallel (threads of `pool`), then the router."""
        roles = {"agg": (), "ctx": ("--server_role", "context"), "gen": ("--server_role", "generation")}
        futs = {k: pool.submit(start_server, self.model, self.arm, self.args, self.folders[k], timeout, argv)
                for k, argv in roles.items()}
        errors = []
        for k, f in futs.items():
            try:
                proc, self.urls[k] = f.result()
                self.procs.append(proc)
            except RuntimeError as e:
                errors.append(f"{k}: {str(e).splitlines()[0]}\n{tail(self.folders[k] / 'server.log')}")
        if errors:
            raise RuntimeError("\n".join(errors))
        proc, self.urls["router"] = start_router(self.urls["ctx"], self.urls["gen"], self.folders["router"], timeout)
        self.procs.append(proc)

    def warm_up(self, chat: bool) -> None:
        """One request through the router: the first contact (layout check, NIXL peer) before any timing."""
        body: dict[str, Any] = {"model": self.arm, "max_tokens": 4, "temperature": 0}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": "Hello!"}]} if chat else {"prompt": "Hello!"})
        for url in (self.urls["agg"], self.urls["router"]):
            r = httpx.post(f"{url}{path}", json=body, timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"warm-up on {url} answered {r.status_code}: {r.text[:500]}")

    def log_tails(self, n: int = 600) -> str:
        return "\n".join(f"--- {k}:\n{tail(f / ('router.log' if k == 'router' else 'server.log'), n)}"
                         for k, f in self.folders.items())

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            stop_server(p)


def transfer_summary(records: list[dict]) -> dict[str, Any]:
    """Per request (one record each): bytes per pool, GB/s; medians and ranges over the requests."""
    if not records:
        return {"requests": 0}
    gbps = [r["bytes"] / r["seconds"] / 1e9 for r in records if r["seconds"] > 0]
    pools = sorted({n for r in records for n in r["pool_bytes"]})
    out: dict[str, Any] = {"requests": len(records),
                           "pages_per_request": statistics.mean(len(r["pages"]) for r in records),
                           "descriptors_per_request": statistics.mean(r.get("descriptors", 0) for r in records),
                           "bytes_per_request": {n: statistics.mean(r["pool_bytes"].get(n, 0) for r in records)
                                                 for n in pools},
                           "bytes_per_page": {n: max(r["pool_bytes"].get(n, 0) / len(r["pages"]) for r in records
                                                     if r["pages"]) for n in pools},
                           "seconds_median": statistics.median(r["seconds"] for r in records)}
    if gbps:
        out["gbps"] = {"median": statistics.median(gbps), "min": min(gbps), "max": max(gbps)}
    return out


def measure(url: str, c: int, a: argparse.Namespace, work: Path, tag: str,
            gen: Optional[str] = None) -> dict[str, Any]:
    """One trtllm-bench run at concurrency c against `url` (its first `num_requests` prompts); with `gen`
    (disaggregated) AL from that GEN worker's /metrics and the run's transfers from its /disagg/state."""
    argv = ["--backend", "openai", "--base-url", url, "--dataset", a.dataset, "--num-requests", str(a.num_requests),
            "--concurrency", str(c), "--max-tokens", str(a.max_tokens), "--ignore-eos", "--log-level", "error"]
    if a.api == "completions":
        argv.append("--no-chat-template")
    if a.dataset_cache_dir:
        argv += ["--dataset-cache-dir", a.dataset_cache_dir]
    if gen:
        argv += ["--metrics-url", gen]
        before = httpx.get(f"{gen}/disagg/state", timeout=30).json()["transfers"]
        seen = {(t["ctx_url"], t["ctx_request_id"]) for t in before}
    row = run_client(argv, work / f"{tag}.json", work / f"{tag}.log", a.timeout_s)
    out = {k: row[k] for k in ROW_KEYS if k in row}
    out.update(al=row["acceptance_length"], first_error=row["first_error"], requests=row["num_requests"])
    if gen:     # the client's warm-up request is among them (one transfer more than `requests`)
        state = httpx.get(f"{gen}/disagg/state", timeout=30).json()
        out["transfers"] = transfer_summary([t for t in state["transfers"]
                                             if (t["ctx_url"], t["ctx_request_id"]) not in seen])
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(report: dict) -> list[dict]:
    """One row per (arm, mode, C): median / min / max over rounds of each figure."""
    rows = []
    for arm, entry in report["arms"].items():
        for mode in ("aggregated", "disaggregated"):
            for c in report["config"]["concurrency"]:
                runs = [r[mode][str(c)] for r in entry.get("rounds", []) if str(c) in r.get(mode, {})]
                runs = [r for r in runs if "error" not in r]
                if not runs:
                    continue
                row: dict[str, Any] = {"arm": arm, "mode": mode, "concurrency": c, "rounds": len(runs)}
                for k in ROW_KEYS:
                    xs = [r[k] for r in runs if r.get(k) is not None]
                    row[k] = spread(xs) if xs else None
                tr = [r["transfers"] for r in runs if r.get("transfers", {}).get("requests")]
                if tr:
                    row["transfers"] = {
                        "bytes_per_request": {n: statistics.median(t["bytes_per_request"][n] for t in tr)
                                              for n in tr[0]["bytes_per_request"]},
                        "bytes_per_page": tr[0]["bytes_per_page"],
                        "gbps_median": spread([t["gbps"]["median"] for t in tr if "gbps" in t]),
                        "gbps_min": min(t["gbps"]["min"] for t in tr if "gbps" in t),
                        "gbps_max": max(t["gbps"]["max"] for t in tr if "gbps" in t)}
                rows.append(row)
    return rows


def draft_ratio(rows: list[dict]) -> Optional[dict[str, float]]:
    """Draft-pool bytes GQA / MLA: per request (the same prompts) and per page (the layouts alone)."""
    by = {r["arm"]: r["transfers"] for r in rows if r["mode"] == "disaggregated" and "transfers" in r}
    if "gqa" not in by or "mla" not in by or not by["mla"]["bytes_per_page"].get("draft"):
        return None
    return {"per_request": by["gqa"]["bytes_per_request"]["draft"] / by["mla"]["bytes_per_request"]["draft"],
            "per_page": by["gqa"]["bytes_per_page"]["draft"] / by["mla"]["bytes_per_page"]["draft"]}


def _fmt(s: Optional[dict], scale: float = 1.0, digits: int = 1) -> str:
    if s is None:
        return "-"
    f = lambda x: f"{x * scale:,.{digits}f}"  # noqa: E731
    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})" if s["min"] != s["max"] else f(s["median"])


def markdown(report: dict) -> str:
    rows = report["rows"]
    cfg = report["config"]
    out = [f"{cfg['api']} API, {cfg['num_requests']} requests x {cfg['max_tokens']} tokens per level and run, "
           f"servers up after {report.get('start_s', '-')} s, total {report.get('t_s', '-')} s"
           + (f"; {report['cut']}" if report.get("cut") else "") + ".", "",
           "| arm | mode | C | rounds | out tok/s | TTFT p50 ms | TTFT mean ms | TPOT p50 ms | TPOT mean ms | AL "
           "| failures |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['arm']} | {r['mode']} | {r['concurrency']} | {r['rounds']} | {_fmt(r['output_tok_s'], 1, 0)} "
                   f"| {_fmt(r['ttft_p50_s'], 1e3)} | {_fmt(r['ttft_mean_s'], 1e3)} | {_fmt(r['tpot_p50_s'], 1e3, 2)} "
                   f"| {_fmt(r['tpot_mean_s'], 1e3, 2)} | {_fmt(r['al'], 1, 2)} | {_fmt(r['failures'], 1, 0)} |")
    tr = [r for r in rows if "transfers" in r]
    if tr:
        out += ["", "| arm | C | target KiB / request | draft KiB / request | target / draft KiB per page "
                "| transfer GB/s median over requests (rounds' range) | min-max over requests |",
                "|---|---|---|---|---|---|---|"]
        for r in tr:
            t = r["transfers"]
            b, pg = t["bytes_per_request"], t["bytes_per_page"]
            out.append(f"| {r['arm']} | {r['concurrency']} | {b.get('target', 0) / 1024:,.1f} | "
                       f"{b.get('draft', 0) / 1024:,.1f} | {pg.get('target', 0) / 1024:,.1f} / "
                       f"{pg.get('draft', 0) / 1024:,.1f} | {_fmt(t['gbps_median'], 1, 2)} | "
                       f"{t['gbps_min']:.2f}-{t['gbps_max']:.2f} |")
    ratio = report.get("draft_bytes_gqa_over_mla")
    if ratio:
        out += ["", f"Draft-pool bytes GQA / MLA: {ratio['per_request']:.2f}x per request "
                    f"({ratio['per_page']:.2f}x per page)."]
    for arm, e in report["arms"].items():
        if e.get("error"):
            out += ["", f"{arm} failed:", "```", e["error"][-1500:], "```"]
    return "\n".join(out)


def write(report: dict, out: Path) -> str:
    report["rows"] = summarize(report)
    report["draft_bytes_gqa_over_mla"] = draft_ratio(report["rows"])
    (out / "disagg_bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = markdown(report)
    (out / "disagg_bench.md").write_text(table + "\n")
    return table


def tiny_cpu(folder: Path) -> tuple[str, dict[str, str]]:
    """The serving tests' tiny chat target, their trained MLA drafter and a random GQA drafter for it."""
    sys.path.insert(0, str(REPO / "tests" / "unittest" / "tools"))
    from dspark_tiny import build_tiny_target

    from tensorrt_llm._torch.models.checkpoint import read_config
    from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
    target = folder / "target"
    if not (target / "config.json").is_file():
        build_tiny_target(target)
    gqa = folder / "drafter_gqa"
    if not (gqa / "config.json").is_file():
        tc = LlamaConfig.from_dict(read_config(target), "target")
        DSparkForCausalLMBase.random_init("gqa", tc, seed=3, markov_rank=4).save_pretrained(gqa)
    mla = REPO / "tests" / "unittest" / "serve" / "data" / "tiny_dspark_mla"
    return str(target), {"gqa": str(gqa), "mla": str(mla)}


def start_all(servers: dict[str, ArmServers], report: dict, a: argparse.Namespace,
              t0: float) -> dict[str, ArmServers]:
    """Every arm's servers in parallel, each arm warmed up; the arms that came up (the others' errors,
    with log tails, go into the report)."""
    with ThreadPoolExecutor(max_workers=4 * len(servers)) as pool:    # an arm's start waits on its three
        starting = {arm: pool.submit(s.start, pool, a.start_timeout_s) for arm, s in servers.items()}
        for arm, fut in starting.items():
            entry = report["arms"][arm]
            try:
                fut.result()
                servers[arm].warm_up(a.api == "chat")
            except RuntimeError as e:
                entry["error"] = str(e)[-4000:]
            except httpx.HTTPError as e:
                entry["error"] = f"warm-up: {type(e).__name__}: {e}\n{servers[arm].log_tails()}"
            if "error" in entry:
                print(f"[disagg_bench] {arm} failed to start: {entry['error'][-2000:]}", file=sys.stderr, flush=True)
    live = {arm: s for arm, s in servers.items() if "error" not in report["arms"][arm]}
    report["start_s"] = round(time.perf_counter() - t0, 1)
    print(f"[disagg_bench +{report['start_s']:.0f}s] servers up: {list(live)}", flush=True)
    return live


def run_rounds(report: dict, servers: dict[str, ArmServers], a: argparse.Namespace, work: Path,
               save: Callable[[], None], t0: float) -> None:
    """`--rounds` rounds in rotated arm order; none starts that would end past t0 + --deadline-s."""
    last = 0.0
    for rnd in range(a.rounds):
        if time.perf_counter() - t0 + last > a.deadline_s:
            report["cut"] = f"round {rnd + 1} of {a.rounds} not started: it would end past --deadline-s"
            break
        start = time.perf_counter()
        for arm in rotated(list(servers), rnd):
            s, res = servers[arm], {"round": rnd + 1, "aggregated": {}, "disaggregated": {}}
            for c in a.concurrency:
                for mode, url, gen in (("aggregated", s.urls["agg"], None),
                                       ("disaggregated", s.urls["router"], s.urls["gen"])):
                    tag = f"{arm}_{mode}_c{c}_r{rnd + 1}"
                    try:
                        res[mode][str(c)] = measure(url, c, a, work, tag, gen)
                    except (RuntimeError, ValueError, KeyError, httpx.HTTPError, OSError,
                            subprocess.TimeoutExpired) as e:
                        res[mode][str(c)] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
                        print(f"[disagg_bench] {tag}: {res[mode][str(c)]['error']}", file=sys.stderr, flush=True)
            report["arms"][arm].setdefault("rounds", []).append(res)
        last = time.perf_counter() - start
        save()
        print(f"[disagg_bench +{time.perf_counter() - t0:.0f}s] round {rnd + 1} done ({last:.0f} s)", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEVICE_MODEL)
    ap.add_argument("--arms", default="gqa,mla", help="comma-separated subset of nospec,gqa,mla")
    ap.add_argument("--gqa", default=None, help="GQA drafter folder (default: staged, else examples/models)")
    ap.add_argument("--mla", default=None, help="MLA drafter folder (default: staged, else examples/models)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="attn_backend (default: TRITON on cuda, AUTO on cpu)")
    ap.add_argument("--kv-tokens", type=int, default=131072, help="kv_cache_config.max_tokens of every server")
    ap.add_argument("--extra-yaml", default=None,
                    help="YAML mapping merged into every arm's args (default on cuda: "
                         "'{torch_compile_config: {enable_inductor: true}}', on cpu: none)")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat")
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--dataset-cache-dir", default=str(DEVICE_CARRY / "ds") if (DEVICE_CARRY / "ds").is_dir() else None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--num-requests", type=int, default=32, help="requests per level and run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--start-timeout-s", type=float, default=360,
                    help="per server start (all six start together, compiling at once)")
    ap.add_argument("--timeout-s", type=float, default=240, help="per trtllm-bench run")
    ap.add_argument("--deadline-s", type=float, default=500, help="no round starts that would end past this")
    ap.add_argument("--tiny-cpu", default=None, metavar="DIR",
                    help="dry run: build the tests' tiny target and drafters in DIR (overrides --model/--gqa/--mla)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", default=None, help="YAMLs, per-run JSON and logs (default: a new temp folder)")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - set(ARMS) or len(set(arms)) != len(arms):
        ap.error(f"--arms {a.arms!r}: distinct names from {','.join(ARMS)}")
    if a.rounds < 1 or a.num_requests < 1 or min(a.concurrency) < 1 or a.max_tokens < 1:
        ap.error("--rounds, --num-requests, --concurrency and --max-tokens must be >= 1")
    if a.extra_yaml is None:
        a.extra_yaml = "{torch_compile_config: {enable_inductor: true}}" if a.device == "cuda" else "{}"
    try:
        extra = yaml_mapping(a.extra_yaml, "--extra-yaml")
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="disagg_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    a.backend = a.backend or ("TRITON" if a.device == "cuda" else "AUTO")
    model, drafters = a.model, {"gqa": a.gqa or drafter_dir("gqa"), "mla": a.mla or drafter_dir("mla")}
    if a.tiny_cpu:
        model, drafters = tiny_cpu(Path(a.tiny_cpu))
        os.environ["OMP_NUM_THREADS"] = "1"      # six CPU engines (and the clients) share a small host
    report: dict = {"config": {**vars(a), "model": model, "drafters": drafters, "work_dir": str(work)}, "arms": {}}
    servers: dict[str, ArmServers] = {}
    t0 = time.perf_counter()
    for arm in arms:
        args = arm_yaml(arm, a.backend, a.device, a.kv_tokens, extra, drafters)
        report["arms"][arm] = {"yaml": args}
        servers[arm] = ArmServers(arm, model, args, work)
    try:
        live = start_all(servers, report, a, t0)
        run_rounds(report, live, a, work, lambda: write(report, out), t0)
    finally:
        for s in servers.values():
            s.stop()
    report["t_s"] = round(time.perf_counter() - t0, 1)
    print(write(report, out))
    failed = any(e.get("error") for e in report["arms"].values())
    return 1 if failed or not report["rows"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
