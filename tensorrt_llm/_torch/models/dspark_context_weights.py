"""A DSpark drafter's per-layer context projections stacked into one GEMM's weights (`ContextWeights`), re-made
when a source tensor changes in place (`current`)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class ContextWeights:
    """Every layer's context projection stacked: weight [L * out, H] (GQA: each layer's k|v rows; MLA:
    kv_a), bias [L * out] or None, norm_weight [L, d] (GQA k_norm, MLA kv_a_layernorm), the norm's eps;
    sources: the per-layer tensors they copy, with their version counters at stacking (`current`)."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    norm_weight: torch.Tensor
    eps: float
    sources: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @staticmethod
    def stack(weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
              norms: Sequence[torch.Tensor], eps: float) -> "ContextWeights":
        sources = tuple(weights) + tuple(b for b in biases if b is not None) + tuple(norms)
        return ContextWeights(torch.cat(list(weights)), None if biases[0] is None else torch.cat(list(biases)),
                              torch.stack(list(norms)), eps, sources, tuple(t._version for t in sources))

    def current(self) -> bool:
        """No source was changed in place (or moved) since stacking."""
        return (all(t._version == v for t, v in zip(self.sources, self.versions))
                and self.weight.device == self.sources[0].device and self.weight.dtype == self.sources[0].dtype)
