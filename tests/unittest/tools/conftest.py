"""Fixtures for the model-acquisition tools: a tiny trained byte-level BPE and a tiny llama/qwen2 GGUF.

``tiny_gguf`` writes a 2-layer model (hidden 64, 4 heads, 2 KV heads, head_dim 16) whose q/k
weights are permuted exactly as llama.cpp's ``convert_hf_to_gguf.py`` does, and returns the HF-layout
weights it started from, so tests can check the converter gets the originals back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! what's the capital of france? paris.",
    "in 2024 we counted 1999 tokens; don't we'll they've",
    "naïve café déjà vu — 日本語 テキスト",
] * 10


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Verbatim llama.cpp ``LlamaModel.permute`` (convert_hf_to_gguf.py), kept independent of our code."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def train_tiny_bpe(pre: str) -> Tokenizer:
    """A ~300-token byte-level BPE trained on a fixed corpus; ``pre`` in {"gpt2", "smollm"}."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        byte_level if pre == "gpt2" else pre_tokenizers.Sequence([pre_tokenizers.Digits(True), byte_level])
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


@dataclass
class TinyGguf:
    """A written tiny GGUF and what went into it."""

    path: Path
    hf_weights: dict[str, np.ndarray]  # HF names, HF (un-permuted) layout, float32 before quantization
    reference_tokenizer: Tokenizer
    vocab_size: int


def _hf_weights(rng: np.random.Generator, vocab: int, tied: bool, qkv_bias: bool) -> dict[str, np.ndarray]:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": 1 + rand(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        if qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                w[p + f"self_attn.{proj}.bias"] = rand(w[p + f"self_attn.{proj}.weight"].shape[0])
        w[p + "mlp.gate_proj.weight"] = rand(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTER)
    return w


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> llama.cpp GGUF tensor name (test-side mapping, independent of the converter)."""
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_LAYER_TO_GGUF['.'.join(module)]}.{kind}"


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = True,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    pre: str = "smollm",
    seed: int = 0,
) -> TinyGguf:
    """Write a tiny GGUF the way llama.cpp's converter would (q/k permuted for llama only)."""
    reference = train_tiny_bpe(pre)
    spec = json.loads(reference.to_str())["model"]
    vocab: dict[str, int] = spec["vocab"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    weights = _hf_weights(np.random.default_rng(seed), len(tokens), tied, qkv_bias=arch == "qwen2")

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, array in weights.items():
        name = gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, HEADS, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, HEADS, KV_HEADS)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGguf(path=path, hf_weights=weights, reference_tokenizer=reference, vocab_size=len(tokens))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Callable[..., TinyGguf]:
    """Factory: ``tiny_gguf(name="m.gguf", **write_tiny_gguf_kwargs)`` writes into ``tmp_path``."""

    def make(name: str = "tiny.gguf", **kwargs: object) -> TinyGguf:
        return write_tiny_gguf(tmp_path / name, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def permute_ref() -> Callable[..., np.ndarray]:
    """llama.cpp's q/k permutation, for tests to build their own expectations."""
    return llama_cpp_permute


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """The tiny Llama target with tokenizer and chat template (`dspark_tiny.build_tiny_target`)."""
    from dspark_tiny import build_tiny_target
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))
