"""Token sampling: greedy, temperature / top-k / top-p with per-request seeded generators."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...sampling_params import SamplingParams


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


class Sampler:
    """Holds one torch.Generator per sampling request (seeded per request)."""

    def __init__(self, default_seed: int, device: torch.device):
        self.default_seed = default_seed
        self.device = device
        self._gens: dict[int, torch.Generator] = {}

    def generator(self, request_id: int, params: SamplingParams) -> torch.Generator:
        g = self._gens.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else self.default_seed * 1_000_003 + request_id
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._gens[request_id] = g
        return g

    def release(self, request_id: int) -> None:
        self._gens.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[int],
               params: Sequence[SamplingParams]) -> list[int]:
        """logits [N, V] float32, one row per request -> N token ids."""
        out = logits.argmax(-1).tolist()
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.greedy:
                out[i] = self.sample_row(logits[i], rid, p)
        return out

    def sample_row(self, logits: torch.Tensor, request_id: int, params: SamplingParams,
                   probs: Optional[torch.Tensor] = None) -> int:
        """logits [V] -> one sampled id (from `probs` [V] when given)."""
        if probs is None:
            probs = processed_probs(logits[None], params)[0]
        return int(torch.multinomial(probs, 1, generator=self.generator(request_id, params)).item())
