"""gc_heap bench: a started engine's heap tracked against frozen, on the CPU (tiny target)."""
from __future__ import annotations

import gc
import json

import pytest

from tensorrt_llm.bench import gc_heap


def test_gc_heap_reports_the_tracked_and_the_frozen_heap(tiny_llama_dir, tiny_drafters, tmp_path, capsys):
    out_json = tmp_path / "gc.json"
    out = gc_heap.main(["--model", str(tiny_llama_dir), "--drafter", tiny_drafters["gqa"], "--passes", "2",
                        "--json", str(out_json)])
    assert "tracked objects" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["tracked_objects"] == out["tracked_objects"]
    assert out["tracked_objects"] > 10_000 and out["frozen_objects"] >= out["tracked_objects"] // 2
    # frozen, a full pass walks only what was made since: far cheaper than over the tracked heap
    assert out["full_pass_ms_frozen"] < out["full_pass_ms_tracked"] / 3
    assert gc.get_freeze_count() == 0      # the bench's LLM was shut down: the heap is unfrozen again


def test_gc_heap_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--passes"):
        gc_heap.parse_args(["--model", "m", "--passes", "0"])
