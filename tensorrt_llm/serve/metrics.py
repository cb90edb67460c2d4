"""Prometheus metrics of the server (GET /metrics), through prometheus-client.

Two sources:
  * per request, recorded by the server when a request ends: request counts by finish reason,
    prompt / generation tokens, TTFT / TPOT / end-to-end latency histograms;
  * engine state, read from `LLM.get_stats()` at scrape time (a custom collector, so the values are
    exactly the engine's): KV pages used / total, prefix-cache hit rate and token counts, executor
    iterations and, with speculation, drafts (verify steps, one per request per step), draft tokens,
    accepted tokens, accepted tokens per draft position and a histogram of tokens committed per step
    (1 + accepted drafts) whose mean is the acceptance length (AL).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "trtllm_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "error", "aborted")


def accepted_per_position(hist: list[int]) -> list[int]:
    """Accepted drafts at each position: the draft at position i is accepted on every step that
    accepted more than i drafts, so accepted[i] = sum(hist[i+1:]). hist[a] = steps accepting a drafts."""
    return [sum(hist[i + 1:]) for i in range(len(hist) - 1)]


class EngineCollector(Collector):
    """Reads `stats()` (an `LLM.get_stats()`) at every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        kv = s["kv_cache"]
        used = kv["num_pages"] - kv["free_pages"]
        yield GaugeMetricFamily(PREFIX + "kv_cache_pages_used", "KV pages held by requests or the prefix cache",
                                value=used)
        yield GaugeMetricFamily(PREFIX + "kv_cache_pages_total", "KV pages in the pool", value=kv["num_pages"])
        yield GaugeMetricFamily(PREFIX + "kv_cache_tokens_per_page", "tokens per KV page",
                                value=kv["tokens_per_block"])
        yield GaugeMetricFamily(PREFIX + "kv_cache_active_sequences", "requests that own KV pages",
                                value=kv["active_sequences"])
        reuse = s["prefix_cache"]
        yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate",
                                "prompt tokens served from the prefix cache / prompt tokens looked up",
                                value=reuse["hit_rate"])
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache",
                                  value=reuse["lookup_tokens"])
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits_tokens", "prompt tokens served from the prefix cache",
                                  value=reuse["reused_tokens"])
        yield CounterMetricFamily(PREFIX + "iterations", "executor steps", value=s["iterations"])
        spec: Optional[dict] = s.get("speculative")
        if spec is not None:
            yield from self._speculative(spec)

    @staticmethod
    def _speculative(spec: dict[str, Any]) -> Iterator[Metric]:
        hist = list(spec["accept_histogram"])
        yield CounterMetricFamily(PREFIX + "spec_decode_num_drafts", "verify steps (one per request per step)",
                                  value=spec["request_steps"])
        yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens", "draft tokens verified",
                                  value=spec["draft_tokens"])
        yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens", "draft tokens accepted",
                                  value=spec["accepted_tokens"])
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted at each draft position", labels=["position"])
        for i, n in enumerate(accepted_per_position(hist)):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        yield GaugeMetricFamily(PREFIX + "spec_decode_acceptance_length",
                                "acceptance length: tokens committed per verify step (0 before any step)",
                                value=spec["acceptance_length"])
        yield GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate", "accepted / drafted tokens",
                                value=spec["acceptance_rate"])
        # tokens committed per step = 1 + accepted drafts: bucket le=k counts steps committing <= k
        buckets, cum = [], 0
        for k, h in enumerate(hist):
            cum += h
            buckets.append((f"{k + 1}.0", cum))
        buckets.append(("+Inf", cum))
        yield HistogramMetricFamily(PREFIX + "spec_decode_acceptance_length_per_step",
                                    "tokens committed per verify step (1 + accepted drafts); mean = AL",
                                    buckets=buckets, sum_value=sum((k + 1) * h for k, h in enumerate(hist)))


class ServerMetrics:
    """The server's registry: per-request metrics + the engine collector."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "finished requests by finish reason", ["finish_reason"],
                                registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.rejected = Counter(PREFIX + "requests_rejected", "requests refused with a 4xx", ["endpoint"],
                                registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "requests in flight in the server", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time to first token (from arrival)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1), per request", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(stats))

    def record_finished(self, finish_reason: str, num_prompt: int, num_output: int,
                        metrics: dict[str, Any]) -> None:
        """One finished request (`metrics` = RequestOutput.metrics; may lack timings on abort/error)."""
        self.requests.labels(finish_reason if finish_reason in FINISH_REASONS else "error").inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        ttft, e2e = metrics.get("ttft_s"), metrics.get("e2e_s")
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)
            if ttft is not None and num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))
