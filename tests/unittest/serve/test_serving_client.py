"""`trtllm-bench --backend openai` against the tiny server: every request counted, figures consistent."""
from __future__ import annotations

import json

import pytest

from tensorrt_llm.bench import benchmark as bm
from tensorrt_llm.bench.serving_client import RequestResult, acceptance_length, summarize


def test_bench_openai_backend_reports_every_level(tiny_server, tmp_path):
    out = tmp_path / "bench.json"
    assert bm.main(["--backend", "openai", "--base-url", tiny_server.base_url, "--num-requests", "8",
                    "--concurrency", "1", "4", "--request-rate", "200", "--max-tokens", "8", "--ignore-eos",
                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["failures"] == 0 and r["num_requests"] == 8 and r["output_tokens"] == 8 * 8
        assert r["requests_per_s"] > 0 and r["output_tok_s"] == pytest.approx(64 / r["elapsed_s"])
        for k in ("ttft", "tpot", "itl"):
            assert 0 < r[f"{k}_p50_s"] <= r[f"{k}_p99_s"] and r[f"{k}_mean_s"] > 0
        assert r["acceptance_length"] is None           # no drafter on this server


def test_bench_openai_needs_a_reachable_server():
    with pytest.raises(SystemExit):
        bm.main(["--backend", "openai", "--num-requests", "2"])            # no --base-url
    with pytest.raises(SystemExit):
        bm.main(["--backend", "openai", "--base-url", "http://127.0.0.1:9", "--num-requests", "2"])


def test_summary_and_al_arithmetic():
    ok = RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.2, 0.2], output_tokens=5)
    bad = RequestResult(ok=False, error="HTTP 400")
    row = summarize([ok, bad], elapsed=2.0, concurrency=2, request_rate=1.0, al=None)
    assert row["failures"] == 1 and row["first_error"] == "HTTP 400" and row["output_tok_s"] == 2.5
    assert row["tpot_mean_s"] == pytest.approx(0.1) and row["itl_p50_s"] == pytest.approx(0.2)
    before = {"trtllm_spec_decode_num_drafts_total": 10, "trtllm_spec_decode_num_accepted_tokens_total": 20}
    after = {"trtllm_spec_decode_num_drafts_total": 14, "trtllm_spec_decode_num_accepted_tokens_total": 30}
    assert acceptance_length(before, after) == 1 + 10 / 4
    assert acceptance_length({}, {}) is None
