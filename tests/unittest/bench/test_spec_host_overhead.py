"""spec_host_overhead bench: runs end to end on the CPU (tiny target and drafters) and reports every component."""
from __future__ import annotations

import json

import pytest

from tensorrt_llm.bench import spec_host_overhead as sho


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_spec_host_overhead_runs_and_reports(tiny_llama_dir, tiny_drafters, tmp_path, capsys, kind):
    out_json = tmp_path / "host.json"
    out = sho.main(["--model", str(tiny_llama_dir), "--drafter", tiny_drafters[kind], "--batch-sizes", "1", "3",
                    "--prompt-len", "12", "--max-tokens", "200", "--warmup", "1", "--steps", "4", "--rounds", "1",
                    "--threads", "1", "--json", str(out_json)])
    table = capsys.readouterr().out
    assert "| host |" in table and "B=3" in table
    res = json.loads(out_json.read_text())["ms_per_step"]
    assert res == json.loads(json.dumps(out["ms_per_step"]))
    for b in ("1", "3"):
        row = res[b]
        assert set(row) == set(sho.COMPONENTS)
        assert row["forward"] > 0 and row["graph_inputs"] > 0 and row["complete"] > 0 and row["segments"] > 0
        parts = sum(row[k] for k in ("schedule", "segments", "graph_inputs", "launch_other", "complete", "other"))
        assert parts == pytest.approx(row["host"])
        assert row["host"] < 50 * row["forward"] + 50    # the forward is subtracted, not counted twice


def test_spec_host_overhead_arrivals_mode_splits_prompt_steps(tiny_llama_dir, tiny_drafters, capsys):
    # 3 x 4 requests of 4..40 tokens: they end at different steps, and each end admits a queued prompt
    out = sho.main(["--model", str(tiny_llama_dir), "--drafter", tiny_drafters["gqa"], "--batch-sizes", "4",
                    "--prompt-len", "12", "--waves", "3", "--min-tokens", "4", "--max-tokens", "40", "--rounds", "1",
                    "--threads", "1"])
    row = out["ms_per_step"]["4"]
    assert set(row) == set(sho.ARRIVAL_COLUMNS)
    assert row["steps_plain"] >= 1 and row["steps_prompt"] >= 1
    assert row["host_plain"] > 0 and row["host_prompt"] > 0
    assert "| host_prompt |" in capsys.readouterr().out


def test_spec_host_overhead_rejects_bad_arguments(tiny_llama_dir, tiny_drafters):
    with pytest.raises(ValueError, match="must be >= 1"):
        sho.parse_args(["--model", "m", "--drafter", "d", "--steps", "0"])
    with pytest.raises(ValueError, match="min-tokens"):
        sho.parse_args(["--model", "m", "--drafter", "d", "--waves", "2", "--min-tokens", "300"])
    # one wave of equal requests: no prompt arrives while they run, so there are no prompt steps to time
    with pytest.raises(ValueError, match="with a prompt chunk were timed"):
        sho.main(["--model", str(tiny_llama_dir), "--drafter", tiny_drafters["gqa"], "--batch-sizes", "2",
                  "--prompt-len", "12", "--waves", "1", "--min-tokens", "20", "--max-tokens", "20", "--rounds", "1"])
    # requests that end before the window: the run says so instead of reporting a short window
    with pytest.raises(ValueError, match=r"only [0-3] of 4 steps were timed"):
        sho.main(["--model", str(tiny_llama_dir), "--drafter", tiny_drafters["gqa"], "--batch-sizes", "2",
                  "--prompt-len", "12", "--max-tokens", "3", "--warmup", "1", "--steps", "4", "--rounds", "1"])
