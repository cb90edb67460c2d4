"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the vocabulary (``tokens``), the BPE
``merges``, a per-token ``token_type`` and the special ids as metadata, plus a ``pre`` name that
selects the regex llama.cpp splits text with before BPE. This module turns those back into a
``tokenizers.Tokenizer`` and the matching ``tokenizer_config.json`` / ``generation_config.json``
dictionaries.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``, used by SmolLM, Llama-3, Qwen2, ...) is
supported; any other model, or an unknown ``pre`` name, raises ``ValueError`` instead of silently
guessing a pre-tokenizer (a wrong split regex gives plausible but different token ids).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# llama.cpp's llama_token_type values (gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> how llama.cpp splits text (see llama-vocab.cpp):
#   "gpt2":   the GPT-2 regex alone (what ByteLevel(use_regex=True) does);
#   "digits": every digit isolated ("\p{N}"), then the GPT-2 regex;
#   otherwise a custom regex followed by a regex-free ByteLevel.
_PRE_TOKENIZER_KIND: dict[str, str] = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "command-r": "digits",
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("\u00a1"), ord("\u00ac") + 1))
    printable += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


_BYTE_ALPHABET: dict[int, str] = _bytes_to_unicode()
_ALPHABET_CHARS: frozenset[str] = frozenset(_BYTE_ALPHABET.values())


def _byte_level_spelling(token: str) -> str:
    """A token as the byte-level vocabulary spells it (already-spelled tokens are unchanged)."""
    if set(token) <= _ALPHABET_CHARS:
        return token
    return "".join(_BYTE_ALPHABET[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer reproducing llama.cpp's split for ``tokenizer.ggml.pre == pre``."""
    if pre not in _PRE_TOKENIZER_KIND:
        raise ValueError(
            f"GGUF key tokenizer.ggml.pre = {pre!r} is not supported; known: {sorted(_PRE_TOKENIZER_KIND)}"
        )
    kind = _PRE_TOKENIZER_KIND[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if kind == "gpt2":
        return byte_level
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(kind), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return meta[key]


def _token_at(tokens: list[str], key: str, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"GGUF key {key} = {token_id} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def special_token_ids(meta: Mapping[str, Any]) -> dict[str, int | None]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"}`` from the GGUF (None if absent)."""
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
    }


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """Build the byte-level BPE ``Tokenizer`` a GGUF describes.

    Args:
        meta: GGUF metadata as ``{key: python value}``; needs ``tokenizer.ggml.model`` ("gpt2"),
            ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``; ``token_type``, ``pre``,
            ``add_bos_token``/``add_eos_token`` and the special ids are optional.

    Control tokens (type 3) become special added tokens and user-defined tokens (type 4) plain
    added tokens, so both are matched whole in raw text, as llama.cpp does.
    """
    model_kind = _require(meta, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(
            f"GGUF key tokenizer.ggml.model = {model_kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    tokens: list[str] = list(_require(meta, "tokenizer.ggml.tokens"))
    merges_raw: list[str] = list(_require(meta, "tokenizer.ggml.merges"))
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(
            f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries but tokenizer.ggml.tokens has {len(tokens)}"
        )

    # Added tokens keep their raw text (so they match in input text); every other token is spelled
    # in the byte alphabet. An added token whose raw text is outside the alphabet is unreachable by
    # merges anyway, so keeping its raw spelling in the BPE vocab changes nothing else.
    is_added = [t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) for t in token_types]
    vocab: dict[str, int] = {}
    duplicates = 0
    for index, (token, added) in enumerate(zip(tokens, is_added)):
        spelled = token if added else _byte_level_spelling(token)
        if spelled in vocab:
            duplicates += 1
            continue
        vocab[spelled] = index
    if duplicates:
        logger.warning("GGUF vocabulary has %d duplicate tokens; each keeps its first id", duplicates)

    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(merges_raw):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not of the form 'left right'")
        merges.append((parts[0], parts[1]))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()

    specials = [AddedToken(tok, special=True, normalized=False) for tok, t in zip(tokens, token_types) if t == 3]
    user = [AddedToken(tok, special=False, normalized=False) for tok, t in zip(tokens, token_types) if t == 4]
    if specials:
        tokenizer.add_special_tokens(specials)
    if user:
        tokenizer.add_tokens(user)
    tokenizer.post_processor = _post_processor(meta, tokens)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise ValueError(
            f"tokenizer grew from {len(vocab)} to {tokenizer.get_vocab_size(with_added_tokens=True)} tokens "
            "while adding GGUF control/user-defined tokens; their ids would not match the model"
        )
    return tokenizer


def _post_processor(meta: Mapping[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS/EOS insertion when the GGUF asks for it."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return byte_level
    ids = special_token_ids(meta)
    specials: list[tuple[str, int]] = []
    single, pair = ["$A"], ["$A", "$B"]
    if add_bos:
        bos = _token_at(tokens, "tokenizer.ggml.bos_token_id", ids["bos_token_id"])
        if bos is None:
            raise ValueError("GGUF sets tokenizer.ggml.add_bos_token but has no tokenizer.ggml.bos_token_id")
        single, pair = [bos, *single], [bos, "$A", bos, "$B"]
        specials.append((bos, int(ids["bos_token_id"])))
    if add_eos:
        eos = _token_at(tokens, "tokenizer.ggml.eos_token_id", ids["eos_token_id"])
        if eos is None:
            raise ValueError("GGUF sets tokenizer.ggml.add_eos_token but has no tokenizer.ggml.eos_token_id")
        single = [*single, eos]
        pair = [*pair[:2], eos, *pair[2:], eos] if add_bos else ["$A", eos, "$B", eos]
        if all(name != eos for name, _ in specials):
            specials.append((eos, int(ids["eos_token_id"])))
    template = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)
    return processors.Sequence([byte_level, template])


def tokenizer_config(meta: Mapping[str, Any], max_length: int | None) -> dict[str, Any]:
    """``tokenizer_config.json`` contents: special tokens, BOS/EOS flags, chat template."""
    tokens: list[str] = list(_require(meta, "tokenizer.ggml.tokens"))
    ids = special_token_ids(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name in ("bos", "eos", "pad", "unk"):
        token = _token_at(tokens, f"{name}_token_id", ids[f"{name}_token_id"])
        if token is not None:
            config[f"{name}_token"] = token
    if max_length is not None:
        config["model_max_length"] = max_length
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` contents: the BOS/EOS/PAD ids the GGUF declares."""
    ids = special_token_ids(meta)
    config: dict[str, Any] = {"_from_model_config": False}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if ids[key] is not None:
            config[key] = int(ids[key])
    return config
