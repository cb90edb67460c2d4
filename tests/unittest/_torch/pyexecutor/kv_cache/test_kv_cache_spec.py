"""Budget split: each pool charged at its allocated dtype, token parity, MLA vs GQA capacity."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec, split_budget

P = 64
TARGET_FP8 = KVCacheSpec("target", "gqa", 30, 2, 3, 64, torch.float8_e4m3fn)
TARGET_BF16 = KVCacheSpec("target", "gqa", 30, 2, 3, 64, torch.bfloat16)
DRAFT_MLA = KVCacheSpec("draft", "mla", 5, 1, 1, 576, torch.bfloat16)
DRAFT_GQA = KVCacheSpec("draft", "gqa", 5, 2, 16, 64, torch.bfloat16)


def test_bytes_per_token_slopes():
    assert TARGET_FP8.bytes_per_token == 30 * 2 * 3 * 64 * 1 == 11520
    assert TARGET_BF16.bytes_per_token == 23040
    assert DRAFT_MLA.bytes_per_token == 5760       # not 2,880: the draft pool stays bf16
    assert DRAFT_GQA.bytes_per_token == 20480
    # negative control: charging the drafter at the target's fp8 would halve its slope
    wrong = KVCacheSpec("draft", "mla", 5, 1, 1, 576, torch.float8_e4m3fn)
    assert wrong.bytes_per_token == 2880 != DRAFT_MLA.bytes_per_token


def test_pool_shapes():
    assert DRAFT_MLA.describe(100, P) == "5 x (100, 1, 1, 64, 576) bfloat16"
    assert DRAFT_GQA.describe(100, P) == "5 x (100, 2, 16, 64, 64) bfloat16"


@pytest.mark.parametrize("target", [TARGET_FP8, TARGET_BF16])
def test_token_parity_and_capacity_ratio(target):
    budget = 8 * 1024 ** 3
    fixed = 123_456_789
    pages_mla = split_budget(budget, [target, DRAFT_MLA], P, fixed_bytes=fixed)
    pages_gqa = split_budget(budget, [target, DRAFT_GQA], P, fixed_bytes=fixed)
    # token-independent state comes off first; both pools share the page count (token parity)
    assert pages_mla == (budget - fixed) // (P * (target.bytes_per_token + DRAFT_MLA.bytes_per_token))
    assert pages_gqa == (budget - fixed) // (P * (target.bytes_per_token + DRAFT_GQA.bytes_per_token))
    used = pages_mla * P * (target.bytes_per_token + DRAFT_MLA.bytes_per_token)
    assert used <= budget - fixed < used + P * (target.bytes_per_token + DRAFT_MLA.bytes_per_token)
    formula = (target.bytes_per_token + DRAFT_GQA.bytes_per_token) / (
        target.bytes_per_token + DRAFT_MLA.bytes_per_token)
    assert pages_mla / pages_gqa == pytest.approx(formula, rel=1e-3)
    if target is TARGET_FP8:
        assert formula == pytest.approx(32000 / 17280)


def test_budget_too_small_raises():
    with pytest.raises(ValueError, match="smaller than one page"):
        split_budget(1000, [TARGET_BF16, DRAFT_MLA], P)


def test_engine_fp8_target_keeps_drafter_dtype(tiny_llama_dir, tmp_path):
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm._torch.models.checkpoint import read_config
    from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "t")
    DSparkForCausalLMBase.random_init("mla", tc).save_pretrained(tmp_path / "d")
    budget = 4 * 1024 * 1024
    with LLM(str(tiny_llama_dir), device="cpu",
             kv_cache_config={"dtype": "fp8", "cpu_kv_budget_bytes": budget, "tokens_per_block": 16},
             speculative_config={"decoding_type": "DSpark", "speculative_model": str(tmp_path / "d")}) as llm:
        r = llm.capacity_report
        t, d = r["pools"]["target"], r["pools"]["draft"]
        assert t["dtype"] == "float8_e4m3fn" and d["dtype"] == "float32"
        assert t["bytes_per_token"] == 3 * 2 * 2 * 16 * 1
        assert t["max_tokens"] == d["max_tokens"] == r["max_tokens"]
        per_page = 16 * (t["bytes_per_token"] + d["bytes_per_token"])
        assert r["num_pages"] == budget // per_page
        out = llm.generate("the quick brown fox", SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 6
