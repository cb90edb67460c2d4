"""Strict configs: unknown keys raise, validated args are frozen, YAML round trip, spec union."""
from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("name", ["TRTLLM", "FAST"])
def test_unknown_attention_backend_names_the_known_ones(name):
    known = r"'AUTO', 'VANILLA', 'FLASHINFER', 'TRITON' or 'CUTEDSL'"
    with pytest.raises(ValidationError, match=rf"(?s)attn_backend.*{known}"):
        TorchLlmArgs(model="m", attn_backend=name)
    with pytest.raises(ValidationError, match=rf"(?s)attention_backend.*{known}"):
        DSparkDecodingConfig(speculative_model="d", attention_backend=name)


def test_cutedsl_is_a_drafter_backend_only():
    assert DSparkDecodingConfig(speculative_model="d", attention_backend="CUTEDSL").attention_backend == "CUTEDSL"
    with pytest.raises(ValidationError, match=r"(?s)attn_backend CUTEDSL is the DSpark drafter's norm \+ RoPE prep "
                                              r"backend; set it as speculative_config.attention_backend"):
        TorchLlmArgs(model="m", attn_backend="CUTEDSL")


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


# ---- paths and bad values (issue #19 items 8 and 11) ----------------------------------------
def test_paths_expand_home(tmp_path, monkeypatch):
    """`~` was kept literally in model / tokenizer / speculative_model (a folder named '~' was
    looked for); it is expanded. Negative control: paths without `~` are left as given."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = TorchLlmArgs(model="~/ckpt", tokenizer="~/tok", speculative_config={
        "decoding_type": "DSpark", "speculative_model": "~/drafter", "accept_stats_dir": "~/stats"})
    assert (args.model, args.tokenizer) == (str(tmp_path / "ckpt"), str(tmp_path / "tok"))
    assert args.speculative_config.speculative_model == str(tmp_path / "drafter")
    assert args.speculative_config.accept_stats_dir == str(tmp_path / "stats")
    plain = TorchLlmArgs(model="rel/ckpt", tokenizer="/abs/tok")
    assert (plain.model, plain.tokenizer) == ("rel/ckpt", "/abs/tok")


def test_llm_loads_a_model_and_a_yaml_under_home(tiny_llama_dir, tmp_path, monkeypatch, make_llm):
    """The README quick start (`LLM(model="~/...")`, a YAML whose `model:` starts with `~`) used to
    fail with 'checkpoint folder not found'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_llama_dir)
    (tmp_path / "args.yaml").write_text("model: ~/models/tiny\nmax_num_tokens: 32\n")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = make_llm(tiny_llama_dir).generate("once upon a time", params).outputs[0].token_ids
    for model in ("~/models/tiny", "~/args.yaml"):
        llm = make_llm(model)
        assert llm.generate("once upon a time", params).outputs[0].token_ids == ref
    assert llm.args.model == str(tmp_path / "models" / "tiny") and llm.args.max_num_tokens == 32


def test_yaml_relative_paths_resolve_against_the_yaml_folder(tiny_llama_dir, tmp_path, monkeypatch, make_llm):
    """A relative `speculative_model` (or model, tokenizer) in a YAML used to resolve against the
    working directory; it resolves against the YAML file's folder. Overrides are taken as given,
    and absolute paths are left alone (negative controls)."""
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (tmp_path / "tiny").symlink_to(tiny_llama_dir)
    f = cfg / "args.yaml"
    f.write_text("model: ../tiny\ntokenizer: /abs/tok\nspeculative_config:\n  decoding_type: DSpark\n"
                 "  speculative_model: drafters/mla\n  accept_stats_dir: stats\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    args = TorchLlmArgs.from_yaml(f)
    assert Path(args.model).resolve() == (tmp_path / "tiny").resolve() and args.tokenizer == "/abs/tok"
    assert args.speculative_config.speculative_model == str(cfg / "drafters" / "mla")
    assert args.speculative_config.accept_stats_dir == str(cfg / "stats")
    assert TorchLlmArgs.from_yaml(f, tokenizer="rel/tok").tokenizer == "rel/tok"
    f.write_text("model: ../tiny\n")
    llm = make_llm(Path("..") / "configs" / "args.yaml")     # the YAML itself is found from the cwd
    assert len(llm.generate("once upon a time", SamplingParams(max_tokens=3)).outputs[0].token_ids) == 3


def test_yaml_syntax_error_names_the_file(tmp_path):
    """A YAML syntax error used to surface as yaml's own ScannerError/ParserError without the file."""
    f = tmp_path / "broken.yaml"
    f.write_text("model: /ckpt\nkv_cache_config: {max_tokens: 64\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: invalid YAML"):
        TorchLlmArgs.from_yaml(f)


@pytest.mark.parametrize("kwargs", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                    dict(temperature=-0.5), dict(seed=-1), dict(seed=2**64)])
def test_sampling_params_reject_non_finite_temperature_and_seed_out_of_range(kwargs):
    """temperature=inf (random output) and seeds outside [0, 2**64) used to be accepted."""
    with pytest.raises(ValidationError, match="temperature" if "temperature" in kwargs else "seed"):
        SamplingParams(**kwargs)


def test_sampling_params_edge_values_are_accepted():
    """Negative control of the test above: the edges of the valid ranges."""
    p = SamplingParams(temperature=1e6, seed=2**64 - 1)
    assert p.seed == 2**64 - 1 and SamplingParams(seed=0).seed == 0
