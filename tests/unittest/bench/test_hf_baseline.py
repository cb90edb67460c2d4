"""The HF baseline in its own process (`HFProcess`, the side-by-side driver's HF arm): the same
greedy tokens as the in-process `HFBaseline`, its timing row, and a clear error (no hang) when the
child cannot load the model."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm.bench.hf_baseline import HFBaseline, HFProcess, _left_pad, static_pad_width


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


def test_left_pad_to_one_width():
    ids, mask = _left_pad([[5, 6], [7]], pad_id=0, multiple=64, device=torch.device("cpu"), width=4)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert _left_pad([[5, 6]], 0, 64, torch.device("cpu"))[0].shape == (1, 64)   # rounded up by default
    with pytest.raises(ValueError, match="pad width 1 < the longest prompt"):
        _left_pad([[5, 6]], 0, 64, torch.device("cpu"), width=1)
    assert static_pad_width([[1] * 64]) == 64 and static_pad_width([[1] * 65, [1]]) == 128


def test_static_run_pads_every_batch_to_one_width(tiny_llama_dir):
    """A static-cache run traces one prompt width: the batches of short and long prompts alike."""
    pytest.importorskip("transformers")
    hf = HFBaseline(tiny_llama_dir, device="cpu", static_cache=True)
    widths = []
    generate = hf.generate
    hf.generate = lambda b, n, w=None: (widths.append(w), generate(b, n, w))[1]
    row = hf.run([[1, 2], [3] * 70, [4]], 1, 2)
    assert row["pad_width"] == 128 and widths == [128] * 4   # warm-up + 3 timed batches
    assert len(row["batch_times_s"]) == 3
