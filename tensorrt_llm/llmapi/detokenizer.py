"""Incremental detokenization of a growing token list (streamed outputs)."""
from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of a token list that only grows, decoding a short window per update.

    Decoding the whole output on every streamed step costs O(n) per token (O(n^2) per
    request). Instead each update decodes two short windows that start at the last point
    where the text was complete::

        ids:   ...... | prefix ........ | read ........ len(ids)
                        <- context ->    <- new tokens ->
        delta = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

    The context window keeps decoders that treat the first token of a decode specially
    (e.g. a stripped leading space) consistent with a full decode. A delta whose decode
    ends in U+FFFD (an incomplete multi-byte character) is held back until a later token
    completes it, so `text` never ends in a half character. For byte-level BPE (GPT-2,
    Llama-3, SmolLM2, Qwen) `text` equals `decode(ids)` whenever that does not end in U+FFFD.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.text = ""
        self._prefix = 0      # first token of the context window
        self._read = 0        # tokens whose text is in self.text

    def update(self, ids: Sequence[int]) -> str:
        """Text of `ids`, which extends the list of the previous call."""
        if len(ids) < self._read:
            raise ValueError(f"token list shrank from {self._read} to {len(ids)} tokens")
        if len(ids) > self._read:
            prefix_text = self._decode(ids[self._prefix:self._read])
            new_text = self._decode(ids[self._prefix:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
                self.text += new_text[len(prefix_text):]
                self._prefix, self._read = self._read, len(ids)
        return self.text
