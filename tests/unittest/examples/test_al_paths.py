"""examples/gpu/al_paths.py: path names become TorchLlmArgs, unknown ones are refused before any model
loads, and a CPU run reports AL and divergences (identical paths: no divergence, equal AL)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("gpu_al_paths", REPO / "examples" / "gpu" / "al_paths.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def test_paths_are_valid_engine_args_and_unknown_ones_are_refused(tiny_llama_dir):
    for name in ("prod", "graphs_eager_regions", "triton_eager", "vanilla_eager", "prod_fp32"):
        kw = ex.path_args(name)
        kw.pop("drafter_backend", None)
        TorchLlmArgs(model=str(tiny_llama_dir), **kw)
    assert ex.path_args("prod_fp32")["dtype"] == "float32" and "dtype" not in ex.path_args("prod")
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        ex.path_args("fast")


def test_first_divergence():
    assert ex.first_divergence([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == [None, 1]


def test_cpu_run_of_two_identical_paths(tiny_llama_dir, tiny_drafters, tmp_path, monkeypatch):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompts": ["Hello there", "Count to ten", "Name a color"]}))
    out = tmp_path / "al.json"
    monkeypatch.setattr(sys, "argv", ["al_paths", "--model", str(tiny_llama_dir), "--drafter", tiny_drafters["gqa"],
                                      "--prompts", str(prompts), "--paths", "vanilla_eager,vanilla_eager_fp32",
                                      "--max-tokens", "12", "--device", "cpu", "--kv-tokens", "4096",
                                      "--out", str(out)])
    ex.main()
    rows = json.loads(out.read_text())["paths"]
    assert [r["path"] for r in rows] == ["vanilla_eager", "vanilla_eager_fp32"]
    # on the CPU the model runs float32 either way: the same tokens, the same acceptance
    assert rows[1]["first_divergence_vs_vanilla_eager"] == [None, None, None]
    assert rows[0]["acceptance_length"] == rows[1]["acceptance_length"] >= 1.0
    assert len(rows[0]["al_per_prompt"]) == 3 and sum(rows[0]["accept_histogram"]) > 0
