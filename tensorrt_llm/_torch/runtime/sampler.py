"""Token sampling: greedy, temperature / top-k / top-p, seeded per request.

Plain (non-speculative) sampling is batched: every sampled row of a step is drawn in one pass with
the exponential race (token = argmax p / E, E ~ Exp(1)), whose noise is a counter-based hash of
(request seed, draw index, vocab id). A request's tokens therefore depend only on its own seed and
how many tokens it has drawn, never on which other requests share the step, and the step needs no
device sync per request. DSpark drafting draws its proposals the same way from a separate
"draft" stream of the same seed; the "batched" rejection sampler takes its noise from a "verify"
stream, while the "torch" and "flashinfer" ones keep a torch.Generator per request
(`Sampler.generator`).
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from ...sampling_params import SamplingParams
from ..attention_backend.interface import host_ints


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] float32 -> probabilities after temperature, top-k and top-p ([N, V]).

    Greedy params give a one-hot distribution on the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop = cum - sp > params.top_p          # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B         # < 2**31: products of 32-bit values stay inside int64


def mix32(x):
    """32-bit integer hash (xorshift-multiply); works on Python ints and int64 tensors in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


SamplingStream = Literal["token", "draft", "verify"]
_STREAM_SALT = {"token": 0, "draft": 0x27D4EB2F, "verify": 0x165667B1}


def draw_key(seed: int, draw: int, stream: SamplingStream = "token") -> int:
    """The noise key of a request's `draw`-th draw in `stream` (a bijection of draw for a fixed
    seed and stream); "token" draws commit tokens, "draft" draws propose speculative drafts,
    "verify" draws decide speculative acceptance (the "batched" rejection sampler)."""
    base = mix32(mix32(seed & _M32) ^ mix32((seed >> 32) & _M32 ^ 0x632BE5AB))
    if _STREAM_SALT[stream]:
        base = mix32(base ^ _STREAM_SALT[stream])
    return mix32((base + draw * 0x9E3779B1) & _M32)


def processed_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] with one SamplingParams per row -> probabilities [N, V] float32 (rows sharing
    temperature / top-k / top-p are processed together)."""
    n = logits.shape[0]
    probs = torch.empty_like(logits, dtype=torch.float32)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    for members in groups.values():
        idx = members if len(members) < n else slice(None)
        probs[idx] = processed_probs(logits[idx].float(), params[members[0]])
    return probs


def race_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """keys [N] int64, vocab_hash [V] int64 -> Exp(1) noise [N, V] float32, strictly > 0.

    The uniforms are 23-bit, u = (m + 0.5) / 2**23 for m < 2**23, so every u is exact in float32
    and lies in [2**-24, 1 - 2**-24]: never 1.0, so E = -log u > 0 and a zero-probability token
    scores p / E = 0, below every token of positive probability (24-bit uniforms round their
    largest value to 1.0, E = 0, and 0 / 0 = NaN wins argmax).
    """
    h = mix32(keys[:, None] ^ vocab_hash[None, :])
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(u)


class Sampler:
    """Per-request sampling state: draw counters (batched path) and torch.Generators (speculative)."""

    def __init__(self, default_seed: int, device: torch.device):
        self.default_seed = default_seed
        self.device = device
        self._gens: dict[int, torch.Generator] = {}
        self._draws: dict[tuple[int, str], int] = {}
        self._vocab_hash: Optional[torch.Tensor] = None

    def _seed(self, request_id: int, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self.default_seed * 1_000_003 + request_id

    def generator(self, request_id: int, params: SamplingParams) -> torch.Generator:
        g = self._gens.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(self._seed(request_id, params))
            self._gens[request_id] = g
        return g

    def release(self, request_id: int) -> None:
        self._gens.pop(request_id, None)
        for stream in _STREAM_SALT:
            self._draws.pop((request_id, stream), None)

    def choose(self, logits: torch.Tensor, rows: Sequence[int], request_ids: Sequence[int],
               params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits [N, V] -> ids [N] on logits' device: the argmax of every row, with rows[i] (of a
        sampling request request_ids[i], params[i]) overwritten by its draw. No sync."""
        ids = logits.argmax(-1)
        if rows:
            at = host_ints(rows, logits.device)
            ids[at] = self.sample_rows(logits[at], request_ids, params)
        return ids

    def sample_rows(self, logits: torch.Tensor, request_ids: Sequence[int],
                    params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits [N, V] of non-greedy requests -> sampled ids [N] int64 on logits' device (no sync);
        each request's "token" draw counter advances by one."""
        return self.draw(processed_rows(logits, params), request_ids, params)

    def draw(self, probs: torch.Tensor, request_ids: Sequence[int], params: Sequence[SamplingParams],
             stream: SamplingStream = "token") -> torch.Tensor:
        """probs [N, V] (rows sum to 1) -> ids [N] int64, row i an exact draw from probs[i] keyed by
        request i's seed, `stream` and its draw count in that stream (which advances by one)."""
        keys = self.stream_keys(request_ids, params, stream, probs.device)
        noise = race_noise(keys, self.vocab_hash(probs.shape[1], probs.device))
        return (probs / noise).argmax(-1)

    def stream_keys(self, request_ids: Sequence[int], params: Sequence[SamplingParams], stream: SamplingStream,
                    device: torch.device) -> torch.Tensor:
        """[N] int64 noise keys on `device`: request i's next draw in `stream` (its counter advances)."""
        keys = []
        for rid, p in zip(request_ids, params):
            k = self._draws.get((rid, stream), 0)
            self._draws[(rid, stream)] = k + 1
            keys.append(draw_key(self._seed(rid, p), k, stream))
        return host_ints(keys, device)

    def vocab_hash(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] int64 per-token hashes that race noise mixes with a draw's key (cached)."""
        if self._vocab_hash is None or self._vocab_hash.numel() != vocab or self._vocab_hash.device != device:
            self._vocab_hash = mix32(torch.arange(vocab, dtype=torch.int64, device=device) * 0x9E3779B1 & _M32)
        return self._vocab_hash
