"""Strict configs: unknown keys raise, validated args are frozen, YAML round trip, spec union."""
from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi.llm_args import DSparkDecodingConfig, KvCacheConfig, TorchLlmArgs


def test_unknown_keys_raise_everywhere():
    with pytest.raises(ValidationError, match="max_token"):
        KvCacheConfig(max_token=10)                       # typo of max_tokens
    with pytest.raises(ValidationError, match="max_batch"):
        TorchLlmArgs(model="m", max_batch=4)
    with pytest.raises(ValidationError, match="enable_reuse"):
        TorchLlmArgs(model="m", kv_cache_config={"enable_reuse": True})   # nested dict too
    with pytest.raises(ValidationError, match="bogus"):
        DSparkDecodingConfig(speculative_model="d", bogus=1)
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParams(temprature=0.5)


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_config": {"tokens_per_block": 24}},        # not a power of two
    {"kv_cache_config": {"free_gpu_memory_fraction": 0.0}},
    {"kv_cache_config": {"max_tokens": 0}},
    {"kv_cache_config": {"dtype": "int4"}},
    {"attn_backend": "FAST"},
    {"dtype": "float64"},
    {"device": "tpu"},
    {"max_batch_size": 0},
    {"max_seq_len": 1},
])
def test_invalid_values_raise(kwargs):
    with pytest.raises(ValidationError):
        TorchLlmArgs(model="m", **kwargs)


@pytest.mark.parametrize("name", ["TRTLLM", "CUTEDSL", "FAST"])
def test_unknown_attention_backend_names_the_known_ones(name):
    known = r"'AUTO', 'VANILLA' or 'FLASHINFER'"
    with pytest.raises(ValidationError, match=rf"(?s)attn_backend.*{known}"):
        TorchLlmArgs(model="m", attn_backend=name)
    with pytest.raises(ValidationError, match=rf"(?s)attention_backend.*{known}"):
        DSparkDecodingConfig(speculative_model="d", attention_backend=name)


def test_attention_backend_names_match_the_resolver():
    from typing import get_args

    from tensorrt_llm._torch.attention_backend.resolver import KNOWN_BACKENDS
    from tensorrt_llm.llmapi.llm_args import AttentionBackendName
    assert get_args(AttentionBackendName) == ("AUTO", *KNOWN_BACKENDS)


def test_validated_args_are_frozen():
    args = TorchLlmArgs(model="m", kv_cache_config={"max_tokens": 64})
    with pytest.raises(ValidationError):
        args.max_batch_size = 3
    with pytest.raises(ValidationError):
        args.kv_cache_config.max_tokens = 128
    assert isinstance(args.kv_cache_config, KvCacheConfig) and args.kv_cache_config.max_tokens == 64


def test_every_field_has_a_description():
    for cls in (KvCacheConfig, TorchLlmArgs, DSparkDecodingConfig, SamplingParams):
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"


def test_speculative_config_union():
    args = TorchLlmArgs(model="m", speculative_config={"decoding_type": "DSpark", "speculative_model": "d",
                                                       "max_draft_len": 4})
    assert isinstance(args.speculative_config, DSparkDecodingConfig)
    assert args.speculative_config.max_draft_len == 4
    with pytest.raises(ValidationError, match="Eagle"):
        TorchLlmArgs(model="m", speculative_config={"decoding_type": "Eagle", "speculative_model": "d"})
    with pytest.raises(ValidationError, match="decoding_type"):
        TorchLlmArgs(model="m", speculative_config={"speculative_model": "d"})   # no discriminator
    with pytest.raises(ValidationError, match="max_draft_len"):
        TorchLlmArgs(model="m", speculative_config={"decoding_type": "DSpark", "speculative_model": "d",
                                                    "max_draft_len": 0})


def test_from_yaml_round_trip_and_overrides(tmp_path):
    args = TorchLlmArgs(model="/ckpt", max_num_tokens=96, seed=7, attn_backend="VANILLA",
                        kv_cache_config={"max_tokens": 512, "tokens_per_block": 16, "enable_block_reuse": True},
                        speculative_config={"decoding_type": "DSpark", "speculative_model": "/d"})
    f = tmp_path / "args.yaml"
    f.write_text(yaml.safe_dump(args.model_dump()))
    assert TorchLlmArgs.from_yaml(f) == args
    over = TorchLlmArgs.from_yaml(f, seed=9)
    assert over.seed == 9 and over.max_num_tokens == 96


def test_from_yaml_rejects_unknown_keys_and_bad_files(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model: /ckpt\nkv_cache_config:\n  max_tokens: 64\n  page_size: 16\n")
    with pytest.raises(ValueError, match=r"(?s)bad\.yaml.*page_size"):
        TorchLlmArgs.from_yaml(f)
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        TorchLlmArgs.from_yaml(f)
    with pytest.raises(ValueError, match="not found"):
        TorchLlmArgs.from_yaml(tmp_path / "missing.yaml")


def test_llm_from_yaml_file(tiny_llama_dir, tmp_path, make_llm):
    f = tmp_path / "args.yaml"
    f.write_text(yaml.safe_dump({"model": str(tiny_llama_dir), "device": "cpu", "max_num_tokens": 32,
                                 "kv_cache_config": {"max_tokens": 256, "tokens_per_block": 16}}))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    from_yaml = LLM(str(f))
    try:
        assert from_yaml.args.max_num_tokens == 32
        assert from_yaml.capacity_report["max_tokens"] == 256
        got = from_yaml.generate("the quick brown fox", params).outputs[0].token_ids
    finally:
        from_yaml.shutdown()
    ref = make_llm(tiny_llama_dir).generate("the quick brown fox", params).outputs[0].token_ids
    assert got == ref and len(got) == 6


def test_llm_constructor_argument_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="model"):
        LLM()
    with pytest.raises(ValueError, match="either"):
        LLM(str(tiny_llama_dir), args=TorchLlmArgs(model=str(tiny_llama_dir)))
    with pytest.raises(ValidationError, match="max_batch"):
        LLM(str(tiny_llama_dir), max_batch=3)
