"""SwiGLU MLP: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

        self._gate_up: Optional[torch.Tensor] = None

    def fuse_projections(self) -> None:
        """One [2I, H] GEMM for gate and up; the parameters become views of it (no copy kept)."""
        if self.gate_proj.bias is not None:
            return
        w = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data], 0)
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = w[:n], w[n:]
        self._gate_up = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if self._gate_up is not None:
            g, u = F.linear(x, self._gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
