"""Convert a llama/qwen2 GGUF file into a Hugging Face checkpoint folder (no model hub needed).

    trtllm-convert-gguf IN.gguf OUT_DIR

Output (``OUT_DIR``)::

    config.json              LlamaForCausalLM / Qwen2ForCausalLM hyper-parameters
    model.safetensors        float32 weights under HF names (quantized GGUF tensors are dequantized)
    tokenizer.json           byte-level BPE rebuilt from tokenizer.ggml.*   (see gguf_tokenizer.py)
    tokenizer_config.json    special tokens + chat template
    generation_config.json   bos/eos/pad ids
    conversion_meta.json     source file name + sha256; written last, so its presence means "complete"

The one subtle step: llama.cpp's converter permutes the rows of every *llama* ``attn_q`` / ``attn_k``
weight (and bias) from HF's rotate-half rotary layout to interleaved pairs::

    w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)

``unpermute_qk`` applies the inverse. ``attn_k`` uses the KV head count. qwen2 GGUFs are not
permuted (llama.cpp runs them with NEOX rotary), so their q/k are copied as is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from tensorrt_llm.tools.gguf_tokenizer import build_tokenizer, generation_config, special_token_ids, tokenizer_config

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    # GGUF general.architecture -> (HF architectures[0], HF model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
# GGUF per-layer tensor suffix -> HF per-layer module path.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF rotate-half rows -> interleaved pairs); the reference for tests.

    Args:
        weight: ``[n_head * head_dim, in_features]`` (or ``[n_head * head_dim]`` for a bias).
        n_head: heads in this projection (KV heads for ``k_proj``).
    """
    _check_rows(weight, n_head)
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: GGUF interleaved-pair rows -> HF rotate-half rows (same shape)."""
    _check_rows(weight, n_head)
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _check_rows(weight: np.ndarray, n_head: int) -> None:
    if n_head <= 0 or weight.shape[0] % (2 * n_head) != 0:
        raise ValueError(f"q/k tensor with {weight.shape[0]} rows cannot be split into {n_head} heads of even size")


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python value (arrays as lists)."""
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of an opened GGUF as ``{key: python value}``."""
    return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _arch_value(meta: Mapping[str, Any], arch: str, key: str, default: Any = None, required: bool = False) -> Any:
    full = f"{arch}.{key}"
    if full in meta:
        return meta[full]
    if required:
        raise ValueError(f"GGUF metadata is missing required key {full!r}")
    return default


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _arch_value(meta, arch, "rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _f32(_arch_value(meta, arch, "rope.scaling.factor", required=True))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = int(_arch_value(meta, arch, "rope.scaling.original_context_length", required=True))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise ValueError(f"GGUF key {arch}.rope.scaling.type = {kind!r} is not supported (only linear, yarn)")


def build_config(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """HF ``config.json`` for the GGUF; ``shapes`` are the numpy shapes of its tensors by GGUF name."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF general.architecture = {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    hf_arch, model_type = SUPPORTED_ARCHITECTURES[arch]
    hidden = int(_arch_value(meta, arch, "embedding_length", required=True))
    n_head = int(_arch_value(meta, arch, "attention.head_count", required=True))
    n_kv = int(_arch_value(meta, arch, "attention.head_count_kv", n_head))
    head_dim = int(_arch_value(meta, arch, "attention.key_length", hidden // n_head))
    value_dim = int(_arch_value(meta, arch, "attention.value_length", head_dim))
    rope_dim = int(_arch_value(meta, arch, "rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"GGUF has key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rope_dim}; "
            "only equal key/value/rotary head sizes are supported"
        )
    if n_head % n_kv != 0:
        raise ValueError(f"GGUF head_count={n_head} is not a multiple of head_count_kv={n_kv}")
    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF has no tensor 'token_embd.weight'")
    vocab_size = int(shapes["token_embd.weight"][0])
    ids = special_token_ids(meta)
    has_bias = "blk.0.attn_q.bias" in shapes
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_arch_value(meta, arch, "feed_forward_length", required=True)),
        "num_hidden_layers": int(_arch_value(meta, arch, "block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_arch_value(meta, arch, "attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": _f32(_arch_value(meta, arch, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": int(_arch_value(meta, arch, "context_length", required=True)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "torch_dtype": "float32",
        "dtype": "float32",  # transformers >= 5 spelling of torch_dtype
    }
    if model_type == "llama":
        config.update(attention_bias=has_bias, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])
    return config


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> numpy shape that ``config`` implies (biases per architecture)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    qwen2 = config["model_type"] == "qwen2"
    llama_bias = bool(config.get("attention_bias", False))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for proj, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, hidden)
            if qwen2 or llama_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if llama_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; ``ValueError`` for tensors this converter cannot place."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported by this converter"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart")


def _tensor_to_float32(tensor: Any) -> np.ndarray:
    """Dequantize one GGUF tensor to a float32 array in numpy (row-major, HF) order."""
    # GGUF lists dims fastest-first; numpy/HF order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        array = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}") from exc
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"GGUF tensor {tensor.name!r}: dequantized {array.size} values, expected shape {shape}")
    return array.reshape(shape)


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, source_sha256: str | None = None) -> Path:
    """Convert a llama/qwen2 GGUF into an HF checkpoint folder and return ``out_dir``.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder; created if missing, must be empty if present.
        source_sha256: the file's sha256 if the caller already computed it (else it is hashed here).

    Raises:
        ValueError: unsupported architecture/tokenizer/tensor, missing key, shape mismatch,
            or a non-empty ``out_dir``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {str(gguf_path)!r} does not exist")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output folder {str(out_dir)!r} is not empty; refusing to overwrite")
    start = time.perf_counter()
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the gguf package raises bare ValueError / IndexError on other files
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    meta = read_metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = build_config(meta, shapes)
    want = expected_shapes(config)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] == "llama"

    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc=f"convert {gguf_path.name}", unit="tensor", file=sys.stderr):
        name = hf_tensor_name(tensor.name)
        if name not in want:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({name}) is not expected for config {config['model_type']}")
        array = _tensor_to_float32(tensor)
        if array.shape != want[name]:
            raise ValueError(f"GGUF tensor {tensor.name!r} -> {name}: shape {array.shape}, expected {want[name]}")
        if permuted and ".attn_q." in tensor.name:
            array = unpermute_qk(array, n_head)
        elif permuted and ".attn_k." in tensor.name:
            array = unpermute_qk(array, n_kv)
        tensors[name] = np.ascontiguousarray(array)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"GGUF {gguf_path.name} lacks tensors for {missing[:5]} ({len(missing)} missing)")

    tokenizer = build_tokenizer(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    _write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
    _write_json(out_dir / "generation_config.json", generation_config(meta))
    _write_json(
        out_dir / "conversion_meta.json",
        {
            "source_file": gguf_path.name,
            "source_sha256": source_sha256 or sha256_file(gguf_path),
            "source_bytes": gguf_path.stat().st_size,
            "gguf_architecture": meta["general.architecture"],
            "gguf_name": meta.get("general.name"),
            "tensor_types": sorted({GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}),
            "stored_dtype": "float32",
            "converter_version": CONVERTER_VERSION,
            "seconds": round(time.perf_counter() - start, 2),
        },
    )
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``trtllm-convert-gguf IN.gguf OUT_DIR``; prints OUT_DIR as the last stdout line."""
    parser = argparse.ArgumentParser(prog="trtllm-convert-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path, help="input .gguf file (general.architecture llama or qwen2)")
    parser.add_argument("out_dir", type=Path, help="output folder (created; must be empty if it exists)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        out = convert_gguf(args.gguf, args.out_dir)
    except ValueError as e:     # a bad input: one line naming it, no traceback
        print(f"trtllm-convert-gguf: error: {e}", file=sys.stderr)
        return 1
    print(out.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
