"""GQA attention layer over the paged KV cache through an attention backend."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_backend.interface import AttentionBackend, AttentionMetadata, HeadNorms
from .rms_norm import RMSNorm
from .rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, bias: bool = False, qk_norm: bool = False,
                 rms_norm_eps: float = 1e-6):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self._qkv: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v (its k|v rows serve `project_kv`); the parameters become views of
        the fused weight."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight.data for p in projs], 0)
        b = torch.cat([p.bias.data for p in projs], 0) if self.q_proj.bias is not None else None
        o = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight.data = w[o:o + n]
            if b is not None:
                p.bias.data = b[o:o + n]
            o += n
        self._qkv = (w, b)

    def kv_weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The k|v rows of the fused projection (`fuse_projections`): weight [2 Hkv D, hidden], bias."""
        if self._qkv is None:
            raise ValueError("kv_weights needs the fused q|k|v projection (fuse_projections)")
        w, b = self._qkv
        nq = self.num_heads * self.head_dim
        return w[nq:], None if b is None else b[nq:]

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> roped k [T, Hkv, D], v [T, Hkv, D]."""
        t = x.shape[0]
        if self._qkv is not None:
            kv_w, kv_b = self.kv_weights()
            kv = F.linear(x, kv_w, kv_b)
            k, v = kv.view(t, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, dim=1)
        else:
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self.rotary(k, positions), v

    def qkv(self, x: torch.Tensor, positions: torch.Tensor,
            rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> roped q [T, Hq, D] (contiguous), roped k [T, Hkv, D], v [T, Hkv, D].

        rope: (cos, sin) from `rotary.cos_sin(positions)`, gathered once per model forward.
        """
        t = x.shape[0]
        if self._qkv is not None:
            nq, nk, hq = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_heads
            qkv = F.linear(x, *self._qkv)
            cs = rope if rope is not None else self.rotary.cos_sin(positions)
            qk = qkv[:, :nq + nk].view(t, hq + self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:      # per-head norms, before the rotation
                qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
            # q and k share positions: one RoPE call over [T, Hq + Hkv, D]
            qk = self.rotary.apply(qk, *cs)
            v = qkv[:, nq + nk:].view(t, self.num_kv_heads, self.head_dim)
            return qk[:, :hq].contiguous(), qk[:, hq:], v
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self.project_kv(x, positions)
        return self.rotary(q, positions), k, v

    def head_norms(self) -> Optional[HeadNorms]:
        """This layer's per-head q / k RMSNorms as a fused RoPE append applies them (None without)."""
        if self.q_norm is None:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             metadata: AttentionMetadata, backend: AttentionBackend,
             rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
             head_norms: Optional[HeadNorms] = None) -> torch.Tensor:
        """New k / v written, paged attention of q: -> [T, Hq * D] (before o_proj).

        rope: (cos, sin) when q and k come unrotated: the backend rotates them in its KV append
        (`forward_rope`, a backend with `capabilities.fused_rope_append`), after this layer's per-head
        q / k norms when head_norms is given (q and k then come unnormed too)."""
        if rope is not None:
            return backend.forward_rope(q, k, v, *rope, kv_cache, metadata, self.scale,
                                        head_norms).reshape(q.shape[0], -1)
        if head_norms is not None:
            raise ValueError("head_norms go with rope: only a fused RoPE append applies them")
        return backend.forward(q, k, v, kv_cache, metadata, self.scale).reshape(q.shape[0], -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, backend: AttentionBackend,
                kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. kv_cache: [num_pages, 2, Hkv, P, D].

        kv: precomputed (roped k, v) [T, Hkv, D] each (the drafter's context rows)."""
        if kv is None:
            q, k, v = self.qkv(x, positions, rope)
        else:
            t = x.shape[0]
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            if self.q_norm is not None:
                q = self.q_norm(q)
            q, (k, v) = self.rotary(q, positions), kv
        return self.o_proj(self.core(q, k, v, kv_cache, metadata, backend))
