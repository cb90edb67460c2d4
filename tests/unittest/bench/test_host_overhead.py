"""host_overhead bench: runs end to end on the CPU (tiny settings) and reports every component."""
from __future__ import annotations

import json

import pytest

from tensorrt_llm.bench import host_overhead


def test_host_overhead_bench_runs_and_reports(tiny_llama_dir, tmp_path, capsys):
    out_json = tmp_path / "host.json"
    out = host_overhead.main(["--batch-sizes", "1", "3", "--max-batch-size", "4", "--prompt-len", "40",
                              "--max-tokens", "24", "--warmup", "4", "--steps", "8", "--rounds", "1",
                              "--tokenizer", str(tiny_llama_dir), "--json", str(out_json)])
    table = capsys.readouterr().out
    assert "| total |" in table and "B=3" in table
    res = json.loads(out_json.read_text())["us_per_step"]
    assert res == json.loads(json.dumps(out["us_per_step"]))
    for b in ("1", "3"):
        row = res[b]
        assert set(host_overhead.COMPONENTS) <= set(row)
        assert row["total"] > 0 and row["graph_inputs"] > 0 and row["step_pages"] > 0
        assert row["callbacks_stream"] > row["callbacks"] >= 0


def test_host_overhead_rejects_bad_arguments():
    with pytest.raises(ValueError, match="must stay below"):
        host_overhead.parse_args(["--warmup", "200", "--steps", "100"])
    with pytest.raises(ValueError, match="max-batch-size"):
        host_overhead.parse_args(["--batch-sizes", "128"])
