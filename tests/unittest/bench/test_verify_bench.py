"""verify_bench runs the per-step verification of each rejection sampler on a small CPU case."""
from __future__ import annotations

import json

from tensorrt_llm.bench import verify_bench


def test_small_cpu_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "vb.json"
    rows = verify_bench.main(["--batch", "1", "3", "--drafts", "3", "--vocab", "64", "--iters", "3",
                              "--device", "cpu", "--json", str(out)])
    assert [(r["sampler"], r["batch"]) for r in rows] == [("torch", 1), ("batched", 1), ("torch", 3), ("batched", 3)]
    assert all(r["ms_per_step"] > 0 and 0 <= r["accepted_per_request"] <= 3 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    assert "| batched | 3 |" in capsys.readouterr().out
