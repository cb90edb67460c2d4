"""CUTEDSL: the TRITON paged attention with the drafter's norm + RoPE preparation as the CuTe DSL kernel
(`cute_norm_rope`, sm90+; a DSpark drafter's explicit choice, `speculative_config.attention_backend`).

Per layer of a draft block (inputs unrotated, as a model with layer regions hands them to a backend
with `fused_rope_append`)::

    GQA : q [T, Hq, D], k [T, Hkv, D] -> per-head q_norm / k_norm and RoPE (one kernel each)
          -> the page-bounded K/V append -> TRITON paged attention
    MLA : q_pe [T, H, r] -> RoPE written at column R of q [T, H, R + r] (q_lat copied into columns 0..R-1);
          the raw latent [T, R + r] -> kv_a_layernorm over R columns, RoPE of the tail (one kernel)
          -> the append -> TRITON absorbed-MLA paged attention

An MLA drafter's context latents of all layers (the stacked pool) go through the same kernel with the
layers' norm weights per row (`MLADSparkForCausalLM`). The append, its refusal counter, the device
lengths and the graph support are TRITON's (this class is a `TritonAttention`). The TRITON backend
does the norms and rotations inside its append launch instead (`triton_rope_append`): one launch per layer
where this backend makes three (GQA: q, k, the append) or four (MLA: the q_lat copy, q's rope part, the
latent, the append); AUTO keeps TRITON / FLASHINFER (`resolver`).
"""
from __future__ import annotations

import dataclasses

import torch

from .cute_norm_rope import cute_dsl_unavailable, norm_rope
from .triton_backend import TritonAttention


class CuteDslAttention(TritonAttention):
    """TRITON attention whose `forward_rope` / `forward_mla_rope` prepare q and K (latent) with the CuTe
    DSL norm + RoPE kernel."""

    name = "CUTEDSL"
    capabilities = dataclasses.replace(TritonAttention.capabilities, cute_norm_rope=True)

    @classmethod
    def availability(cls, device: torch.device) -> tuple[bool, str]:
        ok, why = super().availability(device)
        if ok:
            why = cute_dsl_unavailable(device)
        return not why, why

    def forward_rope(self, q, k, v, cos, sin, kv_cache, metadata, scale, head_norms=None):
        """Unrotated q [T, Hq, D], k / v [T, Hkv, D] (any token stride), cos / sin [T, 1, D]: q and k
        normed per head (head_norms) and rotated by the kernel, then TRITON's append and attention."""
        c, s = cos[:, 0], sin[:, 0]
        normed = head_norms is not None

        def prep(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            return norm_rope(x, c, s, y, norm_dim=x.shape[-1] if normed else 0, weight=weight,
                             eps=head_norms.eps if normed else 1e-6, apply_rmsnorm=normed)
        q_w, k_w = (head_norms.q_weight, head_norms.k_weight) if normed else (None, None)
        return self.forward(prep(q, q_w), prep(k, k_w), v, kv_cache, metadata, scale)

    def forward_mla_rope(self, q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, metadata, scale, v_dim):
        """q_lat [T, H, R], unrotated q_pe [T, H, r], the raw latent kv [T, R + r]: q = [q_lat | rope(q_pe)]
        and the latent [rms_norm(c_kv) | rope(k_pe)] by the kernel, then TRITON's append and attention."""
        c, s = cos[:, 0], sin[:, 0]
        t_n, heads, rank = q_lat.shape
        q = torch.empty(t_n, heads, rank + q_pe.shape[-1], dtype=q_lat.dtype, device=q_lat.device)
        q[..., :rank].copy_(q_lat)
        norm_rope(q_pe, c, s, q, norm_dim=0, apply_rmsnorm=False, out_offset=rank)
        latent = torch.empty(t_n, 1, kv.shape[-1], dtype=kv.dtype, device=kv.device)
        norm_rope(kv[:, None, :], c, s, latent, norm_dim=rank, weight=norm_weight, eps=eps)
        return self.forward_mla(q, latent[:, 0], kv_cache, metadata, scale, v_dim)
