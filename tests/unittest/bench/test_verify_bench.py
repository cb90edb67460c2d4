"""verify_bench runs a step of RejectionSampler verification per mode on a small CPU case."""
from __future__ import annotations

import json

from tensorrt_llm.bench import verify_bench


def test_small_cpu_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "vb.json"
    rows = verify_bench.main(["--batch", "1", "3", "--drafts", "3", "--vocab", "64", "--iters", "3",
                              "--device", "cpu", "--json", str(out)])
    assert [(r["mode"], r["batch"]) for r in rows] == [("greedy", 1), ("sampled", 1), ("greedy", 3), ("sampled", 3)]
    assert all(r["ms_per_step"] > 0 and 0 <= r["accepted_per_request"] <= 3 for r in rows)
    # the sampled drafts come from a perturbed target: some, not all, are accepted
    assert 0 < rows[-1]["accepted_per_request"] < 3
    assert json.loads(out.read_text())["rows"] == rows
    assert "| sampled | 3 |" in capsys.readouterr().out
