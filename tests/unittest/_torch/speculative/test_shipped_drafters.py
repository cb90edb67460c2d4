"""The shipped SmolLM2 DSpark drafters load in the engine and are lossless on the real target."""
from __future__ import annotations

from pathlib import Path

import pytest

from tensorrt_llm import LLM, SamplingParams

DRAFTERS = Path(__file__).resolve().parents[4] / "examples" / "models"
QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that returns the square of a number."]


@pytest.fixture(scope="module")
def baseline(real_model):
    with LLM(str(real_model), device="cpu", kv_cache_config={"max_tokens": 4096}) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_shipped_drafter_is_lossless_and_accepts(real_model, baseline, kind):
    drafter = DRAFTERS / f"smollm2-135m-dspark-{kind}"
    if not (drafter / "model.safetensors").is_file():
        pytest.skip(f"no shipped drafter at {drafter}")
    prompts, want = baseline
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    with LLM(str(real_model), device="cpu", kv_cache_config={"max_tokens": 4096},
             speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = llm.get_stats()["speculative"]
        assert llm.capacity_report["pools"]["draft"]["kind"] == kind
    # a trained drafter accepts drafts (a random one stays near AL 1.0)
    assert stats["acceptance_length"] > 1.15, stats
