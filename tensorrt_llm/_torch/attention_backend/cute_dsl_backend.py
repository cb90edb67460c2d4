"""CUTEDSL: the TRITON paged attention with the drafter's norm + RoPE prep and the page-bounded K/V (latent)
append as ONE CuTe DSL launch per layer (`cute_rope_append`, sm90+; a DSpark drafter's explicit choice,
`speculative_config.attention_backend`).

Per layer of a draft block (inputs unrotated, as a model with layer regions hands them to a backend
with `fused_rope_append`)::

    GQA : q [T, Hq, D], k / v [T, Hkv, D] -> one launch: per-head q_norm / k_norm and RoPE of q (the
          query tensor) and of k, K and V written at slot_mapping within each request's pages
          -> TRITON paged attention
    MLA : q_lat [T, H, R], q_pe [T, H, r], the raw latent [T, R + r] -> one launch: q = [q_lat | rope(q_pe)],
          the latent [kv_a_layernorm(c_kv) | rope(k_pe)] written at slot_mapping -> TRITON absorbed-MLA attention

so a layer makes as many launches as on TRITON (whose `triton_rope_append` does the same work in one
Triton launch): the same inputs, validation, page bound and refusal counter (this class is a
`TritonAttention`: `refused_writes`, device lengths and graph support are TRITON's). An MLA drafter's
context latents of all layers (the stacked pool) go through the CuTe DSL norm + RoPE kernel
(`cute_norm_rope`) with the layers' norm weights per row (`MLADSparkForCausalLM`). A drafter on AUTO with
CUDA graphs takes this backend where its support predicate holds (`DSparkWorker._auto_graph_backend`).
"""
from __future__ import annotations

import dataclasses

import torch

from .cute_norm_rope import cute_dsl_unavailable
from .cute_rope_append import cute_mla_rope_append, cute_rope_append
from .triton_backend import TritonAttention


class CuteDslAttention(TritonAttention):
    """TRITON attention whose `forward_rope` / `forward_mla_rope` prepare q and K (latent) and append K/V
    in one CuTe DSL launch."""

    name = "CUTEDSL"
    capabilities = dataclasses.replace(TritonAttention.capabilities, cute_norm_rope=True)

    @classmethod
    def availability(cls, device: torch.device) -> tuple[bool, str]:
        ok, why = super().availability(device)
        if ok:
            why = cute_dsl_unavailable(device)
        return not why, why

    def forward_rope(self, q, k, v, cos, sin, kv_cache, metadata, scale, head_norms=None):
        """Unrotated q [T, Hq, D], k / v [T, Hkv, D] (heads and dims contiguous, any token stride), cos /
        sin [T, 1, D]: one launch norms (head_norms) and rotates q and k and appends K/V within each
        request's pages (refusals into `refused_writes`' counter), then TRITON's attention."""
        md = metadata
        q = cute_rope_append(q, k, v, cos, sin, kv_cache, md.slot_mapping, md.block_tables, *self._token_owners(md),
                             self._counter(q.device), head_norms)
        return self._attend(q, kv_cache, md, scale, q.shape[-1], mla=False)

    def forward_mla_rope(self, q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, metadata, scale, v_dim,
                         w_uk=None, w_uv=None):
        """q_lat [T, H, R] (or q_nope [T, H, nope] with w_uk: q_lat = q_nope W_UK first, a batched GEMM),
        unrotated q_pe [T, H, r], the raw latent kv [T, R + r]: one launch builds q = [q_lat | rope(q_pe)]
        and appends [rms_norm(c_kv) | rope(k_pe)] within each request's pages, then TRITON's absorbed-MLA
        attention (through W_UV given w_uv, as TRITON's)."""
        md = metadata
        if w_uk is not None:
            q_lat = torch.einsum("thn,hnr->thr", q_lat, w_uk)
        q = cute_mla_rope_append(q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, md.slot_mapping,
                                 md.block_tables, *self._token_owners(md), self._counter(q_lat.device))
        return self._attend(q, kv_cache, md, scale, v_dim, mla=True, w_uv=w_uv)
