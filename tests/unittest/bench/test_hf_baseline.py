"""The HF baseline in its own process (`HFProcess`, the side-by-side driver's HF arm): the same
greedy tokens as the in-process `HFBaseline`, its timing row, and a clear error (no hang) when the
child cannot load the model."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm.bench.hf_baseline import HFBaseline, HFProcess


def test_hf_process_matches_in_process(tiny_llama_dir):
    pytest.importorskip("transformers")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = HFBaseline(tiny_llama_dir, device="cpu").generate(prompts, 6)
    hf = HFProcess(tiny_llama_dir, device="cpu", timeout_s=300)
    try:
        got = hf.generate(prompts, 6)
        assert torch.equal(torch.tensor(got), want)
        row = hf.run(prompts * 2, 2, 3)
        assert row["num_requests"] == 4 and row["output_tokens"] == 12 and row["output_tok_s"] > 0
    finally:
        hf.close()
    assert not hf._proc.is_alive()


def test_hf_process_reports_a_failed_load(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(RuntimeError, match="HF baseline process failed"):
        HFProcess(tmp_path / "missing", device="cpu", timeout_s=300)
