"""Tests for tensorrt_llm.tools.convert_gguf on tiny synthetic GGUF files (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tensorrt_llm.tools.convert_gguf import convert_gguf, main, permute_qk, unpermute_qk

TEXTS = [
    "the quick brown fox",
    "Hello world! What's the capital of France?",
    "in 2024 we counted 1999 tokens;  double  spaces\n\nnewlines\ttabs",
    "naïve café — 日本語 🤖",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _convert(tiny, tmp_path: Path, **kwargs):
    src = tiny(**kwargs)
    out = convert_gguf(src.path, tmp_path / "hf")
    return src, out, load_file(out / "model.safetensors")


@pytest.mark.parametrize("shape", [(4 * 16, 64), (2 * 16, 64), (4 * 16,)])
def test_unpermute_inverts_llama_cpp_permute(permute_ref, shape):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    n_head = shape[0] // 16
    permuted = permute_ref(w, n_head)
    assert not np.array_equal(permuted, w)  # negative control: the permutation is not the identity
    np.testing.assert_array_equal(permute_qk(w, n_head), permuted)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_unpermute_rejects_bad_head_count():
    with pytest.raises(ValueError, match="cannot be split into 3 heads"):
        unpermute_qk(np.zeros((64, 8), np.float32), 3)


def test_qk_unpermutation_round_trips_through_file(tiny_gguf, tmp_path):
    src, out, ours = _convert(tiny_gguf, tmp_path)
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(src.path).tensors}
    for i in range(2):
        for proj, n_head in (("q", 4), ("k", 2)):
            hf = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            stored = raw[f"blk.{i}.attn_{proj}.weight"]
            np.testing.assert_array_equal(ours[hf], src.hf_weights[hf])
            # Negative controls: the file really is permuted, and un-permuting k with the query
            # head count (a classic GQA bug) gives something else.
            assert not np.array_equal(stored, src.hf_weights[hf])
            if proj == "k":
                assert not np.array_equal(unpermute_qk(stored, 4), src.hf_weights[hf])


def test_all_tensors_names_shapes_and_values(tiny_gguf, tmp_path):
    src, _, ours = _convert(tiny_gguf, tmp_path)
    assert set(ours) == set(src.hf_weights)
    assert "lm_head.weight" not in ours
    for name, want in src.hf_weights.items():
        assert ours[name].dtype == np.float32
        assert ours[name].shape == want.shape, name
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_untied_lm_head(tiny_gguf, tmp_path):
    src, out, ours = _convert(tiny_gguf, tmp_path, tied=False)
    np.testing.assert_array_equal(ours["lm_head.weight"], src.hf_weights["lm_head.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_quantized_tensors_dequantize_and_unpermute(tiny_gguf, tmp_path, qtype):
    src, _, ours = _convert(tiny_gguf, tmp_path, qtype=qtype)
    for name, want in src.hf_weights.items():
        if want.ndim == 2:
            # Quantization is per row block, so it commutes with the row permutation.
            want = gguf.quants.dequantize(gguf.quants.quantize(want, qtype), qtype)
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-6, err_msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(ours[q] - src.hf_weights[q]).max() > 1e-4  # it really was quantized


def test_qwen2_biases_and_no_permutation(tiny_gguf, tmp_path):
    src, out, ours = _convert(tiny_gguf, tmp_path, arch="qwen2", pre="qwen2")
    assert set(ours) == set(src.hf_weights)
    assert "model.layers.1.self_attn.k_proj.bias" in ours
    for name, want in src.hf_weights.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"


def test_config_and_side_files(tiny_gguf, tmp_path):
    src, out, _ = _convert(tiny_gguf, tmp_path)
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 256,
        "vocab_size": src.vocab_size, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) == (
        "<|im_start|>", "<|im_end|>", False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    meta = json.loads((out / "conversion_meta.json").read_text())
    assert meta["source_file"] == "tiny.gguf"
    assert meta["source_sha256"] == __import__("hashlib").sha256(src.path.read_bytes()).hexdigest()


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_tokenizer_matches_reference_bpe(tiny_gguf, tmp_path, pre):
    src, out, _ = _convert(tiny_gguf, tmp_path, pre=pre)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == src.reference_tokenizer.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>").ids == [1]  # control tokens stay whole
    assert ours.get_vocab_size() == src.vocab_size


def test_digit_split_negative_control(tiny_gguf, tmp_path):
    """The 'smollm' pre-tokenizer isolates digits; the plain GPT-2 split would not."""
    src, out, _ = _convert(tiny_gguf, tmp_path, pre="smollm")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    digits = ours.encode("2024").ids
    assert len(digits) == 4
    other = tmp_path / "other"
    other.mkdir()
    gpt2_src = tiny_gguf(name="gpt2.gguf", pre="gpt2")
    gpt2_tok = Tokenizer.from_file(str(convert_gguf(gpt2_src.path, other / "hf") / "tokenizer.json"))
    assert len(gpt2_tok.encode("2024").ids) < 4  # "2024" is merged by a vocab trained without the split


def test_transformers_loads_converted_folder(tiny_gguf, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src, out, _ = _convert(tiny_gguf, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(TEXTS[1])["input_ids"] == src.reference_tokenizer.encode(TEXTS[1]).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(state[q].numpy(), src.hf_weights[q])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model(torch.tensor([[1, 5, 7]])).logits
    assert logits.shape == (1, 3, src.vocab_size) and torch.isfinite(logits).all()


def test_errors_name_the_problem(tiny_gguf, tmp_path):
    src = tiny_gguf()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert_gguf(src.path, busy)
    with pytest.raises(ValueError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2arch.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture = 'gpt2' is not supported"):
        convert_gguf(tmp_path / "gpt2arch.gguf", tmp_path / "out2")


def test_cli_prints_output_folder_last(tiny_gguf, tmp_path, capsys):
    src = tiny_gguf()
    assert main([str(src.path), str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str((tmp_path / "cli").resolve())


@pytest.mark.parametrize("content", [b"hello, not a gguf file\n", b"GGUF\x03\x00\x00\x00"], ids=["text", "truncated"])
def test_cli_on_a_non_gguf_file_prints_one_error_naming_it(tmp_path, capsys, content):
    """Issue #19 item 11: a non-GGUF input used to end in a traceback from the gguf package without
    the file name; now one line names the file, the exit code is non-zero and nothing is written."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    assert main([str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trtllm-convert-gguf: error: ") and str(bad) in err[0]
    assert "not a readable GGUF file" in err[0] and not (tmp_path / "out").exists()
