"""examples/gpu/disagg_bench.py: the transfer summary of GEN's /disagg/state records (bytes per pool, GB/s),
the spreads over rounds, the GQA / MLA draft-bytes ratio and the markdown; bad options are refused
before any server starts. (The whole script runs end to end as its CPU dry run: see its docstring.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("gpu_disagg_bench", REPO / "examples" / "gpu" / "disagg_bench.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def _record(rid: int, pages: int, target: int, draft: int, seconds: float) -> dict:
    return {"ctx_url": "http://ctx", "ctx_request_id": rid, "pages": list(range(pages)), "seconds": seconds,
            "pool_bytes": {"target": target * pages, "draft": draft * pages}, "bytes": (target + draft) * pages,
            "descriptors": 2 * pages}


def test_transfer_summary():
    recs = [_record(0, 2, 1000, 300, 1e-6), _record(1, 4, 1000, 300, 4e-6), _record(2, 1, 1000, 300, 2e-6)]
    t = ex.transfer_summary(recs)
    assert t["requests"] == 3 and t["pages_per_request"] == pytest.approx(7 / 3)
    assert t["bytes_per_request"] == {"draft": pytest.approx(300 * 7 / 3), "target": pytest.approx(1000 * 7 / 3)}
    assert t["bytes_per_page"] == {"draft": 300, "target": 1000}
    # GB/s per request: 2.6, 1.3, 0.65
    assert t["gbps"] == {"median": pytest.approx(1.3), "min": pytest.approx(0.65), "max": pytest.approx(2.6)}
    assert ex.transfer_summary([]) == {"requests": 0}


def _report() -> dict:
    def run(tok_s: float, draft: int, gbps_seconds: float) -> dict:
        return {"output_tok_s": tok_s, "ttft_p50_s": 0.1, "ttft_mean_s": 0.12, "tpot_p50_s": 0.004,
                "tpot_mean_s": 0.005, "failures": 0, "al": 2.5, "requests": 32,
                "transfers": ex.transfer_summary([_record(i, 3, 1000, draft, gbps_seconds) for i in range(4)])}

    arms = {}
    for arm, draft in (("gqa", 360), ("mla", 100)):
        rounds = [{"round": r + 1, "aggregated": {"16": {k: v for k, v in run(1000.0 + r, 0, 1).items()
                                                         if k != "transfers"}},
                   "disaggregated": {"16": run(900.0 + 10 * r, draft, 1e-5 * (r + 1))}} for r in range(3)]
        arms[arm] = {"rounds": rounds}
    arms["nospec"] = {"error": "trtllm-serve exited with 1: boom"}
    return {"config": {"concurrency": [16], "api": "chat", "num_requests": 32, "max_tokens": 256}, "arms": arms,
            "start_s": 61.0, "t_s": 300.0}


def test_summary_over_rounds_and_draft_ratio():
    report = _report()
    rows = ex.summarize(report)
    assert [(r["arm"], r["mode"]) for r in rows] == [("gqa", "aggregated"), ("gqa", "disaggregated"),
                                                     ("mla", "aggregated"), ("mla", "disaggregated")]
    d = rows[1]
    assert d["rounds"] == 3 and d["output_tok_s"] == {"median": 910.0, "min": 900.0, "max": 920.0}
    assert d["transfers"]["bytes_per_request"] == {"draft": 1080, "target": 3000}
    gbps = [1360 * 3 / (1e-5 * (r + 1)) / 1e9 for r in range(3)]     # a request's bytes / seconds, per round
    assert d["transfers"]["gbps_median"]["median"] == pytest.approx(gbps[1])
    assert d["transfers"]["gbps_min"] == pytest.approx(gbps[2])
    assert d["transfers"]["gbps_max"] == pytest.approx(gbps[0])
    assert "transfers" not in rows[0]
    ratio = ex.draft_ratio(rows)
    assert ratio == {"per_request": pytest.approx(3.6), "per_page": pytest.approx(3.6)}
    assert ex.draft_ratio([r for r in rows if r["arm"] != "mla"]) is None
    report["rows"], report["draft_bytes_gqa_over_mla"] = rows, ratio
    md = ex.markdown(report)
    assert "| gqa | disaggregated | 16 | 3 | 910 (900-920) |" in md
    assert "Draft-pool bytes GQA / MLA: 3.60x per request (3.60x per page)." in md
    assert "nospec failed:" in md and "boom" in md


@pytest.mark.parametrize("argv, msg", [(["--arms", "gqa,hf"], "--arms"), (["--arms", "gqa,gqa"], "--arms"),
                                       (["--rounds", "0"], "must be >= 1"), (["--extra-yaml", "[1]"], "mapping")])
def test_bad_options_refused(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ex.main([*argv, "--out", str(tmp_path / "out")])
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
