"""RMSNorm computed in float32 (matches HF Llama)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> same shape and dtype (float32 accumulation)."""
    if x.dtype == torch.float32 or x.is_cuda:
        # one fused op (fp32 accumulation inside); equals the float32 formula below
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)
