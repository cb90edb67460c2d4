"""Tokenizer wrapper over `tokenizers` (tokenizer.json) with the checkpoint's chat template."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import jinja2
from tokenizers import Tokenizer


class TokenizerWrapper:
    def __init__(self, folder: str | Path):
        d = Path(folder)
        if not d.is_dir():
            raise ValueError(f"tokenizer/checkpoint folder not found: {d}")
        f = d / "tokenizer.json"
        if not f.is_file():
            raise ValueError(f"tokenizer folder {d} has no tokenizer.json")
        self.tk = Tokenizer.from_file(str(f))
        cfg_file = d / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: Optional[str] = self.config.get("chat_template")
        gen_file = d / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        eos = gen.get("eos_token_id", self.config.get("eos_token_id"))
        if eos is None and self.config.get("eos_token"):
            eos = self.tk.token_to_id(self._tok_str(self.config["eos_token"]))
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self.bos_token = self._tok_str(self.config.get("bos_token")) or ""
        self.eos_token = self._tok_str(self.config.get("eos_token")) or ""
        self._template: Optional[jinja2.Template] = None   # compiled on first use

    @staticmethod
    def _tok_str(t) -> Optional[str]:
        return t.get("content") if isinstance(t, dict) else t

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of many texts at once (the tokenizer's parallel batch path)."""
        return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template")
        if self._template is None:
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise ValueError(msg)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)
