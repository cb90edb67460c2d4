"""`trtllm-bench --backend openai`: a serving benchmark client against an OpenAI-compatible server
(the shape of vLLM's benchmark_serving).

    trtllm-bench --backend openai --base-url http://localhost:8000 --dataset mtbench \\
        --num-requests 64 --concurrency 1 16 64 --request-rate 8 --max-tokens 128 --ignore-eos

Per concurrency level, requests arrive as a Poisson process of ``--request-rate`` req/s (inf: all at
once) and at most C are in flight. Every request streams (SSE, ``stream_options.include_usage``):
TTFT = first text chunk - send; ITL = gaps between text chunks (one chunk per engine step, so with
speculation a chunk may carry several tokens); TPOT = (e2e - TTFT) / (output tokens - 1), per request;
output tokens from the server's `usage`. AL is read from the server's /metrics (or --metrics-url's:
the GEN worker behind a disaggregated router) before and after the level (accepted draft tokens /
verify steps over that level).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from . import datasets
from .benchmark import _mean, _ms, level_prompts, percentile


@dataclass
class RequestResult:
    ok: bool
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: Optional[str] = None


def scrape_spec(client: httpx.Client) -> dict[str, float]:
    """Speculative counters of /metrics (empty without a drafter, or where the server has no /metrics:
    the disaggregated router, whose GEN workers count the drafts)."""
    r = client.get("/metrics")
    if r.status_code != 200:
        return {}
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in ("trtllm_spec_decode_num_drafts_total", "trtllm_spec_decode_num_accepted_tokens_total",
                          "trtllm_spec_decode_num_draft_tokens_total"):
                out[s.name] = s.value
    return out


def acceptance_length(before: dict[str, float], after: dict[str, float]) -> Optional[float]:
    key = "trtllm_spec_decode_num_drafts_total"
    if key not in after:
        return None
    steps = after[key] - before.get(key, 0.0)
    acc = after["trtllm_spec_decode_num_accepted_tokens_total"] - before.get(
        "trtllm_spec_decode_num_accepted_tokens_total", 0.0)
    return 1.0 + acc / steps if steps else None


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> RequestResult:
    """One streamed request, timed on the client."""
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last: Optional[float] = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for c in chunk["choices"]:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no text was streamed"
    return res


async def run_level(base_url: str, path: str, bodies: Sequence[dict], concurrency: int, request_rate: float,
                    seed: int = 0) -> tuple[list[RequestResult], float]:
    """All requests of one level: Poisson arrivals at `request_rate`, at most `concurrency` in flight."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=30), limits=limits) as client:

        async def one(body: dict) -> RequestResult:
            async with sem:
                return await send(client, path, body)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: Sequence[RequestResult], elapsed: float, concurrency: int, request_rate: float,
              al: Optional[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {
        "arm": "openai", "concurrency": concurrency, "request_rate": request_rate, "num_requests": len(results),
        "failures": len(results) - len(ok), "elapsed_s": elapsed, "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens, "requests_per_s": len(ok) / elapsed, "output_tok_s": out_tokens / elapsed,
        "acceptance_length": al,
        "first_error": next((r.error for r in results if not r.ok), None)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row[f"{name}_mean_s"], row[f"{name}_p50_s"], row[f"{name}_p99_s"] = _mean(xs), percentile(xs, 50), percentile(xs, 99)
    return row


def format_serving_table(rows: Sequence[dict]) -> str:
    head = ["C", "rate", "req/s", "out tok/s", "fail", "TTFT mean/p50/p99 ms", "TPOT mean/p50/p99 ms",
            "ITL mean/p50/p99 ms", "AL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        trip = {n: "/".join(_ms(r[f"{n}_{s}_s"]) for s in ("mean", "p50", "p99")) for n in ("ttft", "tpot", "itl")}
        al = r["acceptance_length"]
        lines.append("| " + " | ".join([str(r["concurrency"]), f"{r['request_rate']:g}", f"{r['requests_per_s']:.2f}",
                                        f"{r['output_tok_s']:.1f}", str(r["failures"]), trip["ttft"], trip["tpot"],
                                        trip["itl"], "-" if al is None else f"{al:.2f}"]) + " |")
    return "\n".join(lines)


def request_bodies(client: httpx.Client, model: str, texts: Sequence[str], chat: bool, max_tokens: int,
                   ignore_eos: bool, max_input_len: Optional[int], max_model_len: int) -> list[dict]:
    """One body per prompt; prompts that cannot fit (counted by the server's /tokenize) are dropped
    and the rest cycled to keep the request count."""
    bodies = []
    for t in texts:
        tok = {"messages": [{"role": "user", "content": t}]} if chat else {"prompt": t}
        n = client.post("/tokenize", json=tok).json()["count"]
        if n + max_tokens > max_model_len or (max_input_len is not None and n > max_input_len):
            continue
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, **tok}
        bodies.append(body)
    if not bodies:
        raise ValueError(f"no prompt fits in {max_model_len} - {max_tokens} tokens")
    return [bodies[i % len(bodies)] for i in range(len(texts))]


def run_serving_benchmark(args) -> dict[str, Any]:
    """`trtllm-bench --backend openai`: every --concurrency level against --base-url; the JSON report."""
    if not args.base_url:
        raise ValueError("--backend openai needs --base-url (e.g. http://localhost:8000)")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.min_requests < 1:
        raise ValueError(f"--min-requests must be >= 1, got {args.min_requests}")
    base = args.base_url.rstrip("/")
    with httpx.Client(base_url=base, timeout=60) as client:
        try:
            card = client.get("/v1/models").json()["data"][0]
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the server at {base}: {e}") from e
        texts = datasets.load_prompts(args.dataset, args.num_requests, args.dataset_cache_dir)
        bodies = request_bodies(client, card["id"], texts, args.chat_template, args.max_tokens, args.ignore_eos,
                                args.max_input_len, card.get("max_model_len", 1 << 30))
        path = "/v1/chat/completions" if args.chat_template else "/v1/completions"
        asyncio.run(run_level(base, path, bodies[:1], 1, float("inf")))          # warm-up, not timed
        rows = []
        with httpx.Client(base_url=(args.metrics_url or base).rstrip("/"), timeout=60) as metrics:
            for c in args.concurrency:
                level = level_prompts(bodies, c, args.waves, args.min_requests)
                before = scrape_spec(metrics)
                results, elapsed = asyncio.run(run_level(base, path, level, c, args.request_rate))
                rows.append(summarize(results, elapsed, c, args.request_rate,
                                      acceptance_length(before, scrape_spec(metrics))))
    return {"config": {k: v for k, v in vars(args).items()}, "server": {"base_url": base, "model": card},
            "results": rows}
