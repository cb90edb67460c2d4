"""The CUTEDSL backend's fused prep + append: one CuTe DSL launch per layer (nvidia-cutlass-dsl, sm90+)
that norms and rotates q (written to a new query tensor) and norms and rotates k (GQA) or the MLA latent's
rope tail, and writes the K/V rows (or latents) into the paged pool at `slot_mapping` within each token's
request's pages. The same contract as TRITON's `triton_rope_append` (inputs, validation messages: the
shared `rope_append_checks`; the write's bound; the refusal counter):

    q_out[t, h]                       = rope(norm_q(q[t, h]))
    cache[page, 0, h, off] (owned)    = rope(norm_k(k[t, h])),   cache[page, 1, h, off] = v[t, h]
    MLA: q_out[t, h] = [q_lat[t, h] | rope(q_pe[t, h])],  cache[page, 0, 0, off] = [rms_norm(c_kv[t]) | rope(k_pe[t])]

with page, off = divmod(slot_mapping[t], P). A slot of -1 is skipped (not counted); a slot whose page is not
in its request's block-table row, or is outside the pool, is refused (never written) and counted into
refused [1] int32, once per token (never zeroed: the backend's persistent counter, accumulated by graph
replays). A token's request is t // tokens_per_seq, or (ragged) the request whose qo_indptr rows hold it
(rows past qo_indptr[B] are the last request's). Numerics (float32 inside) are `cute_norm_rope`'s, which
are the Triton kernels': the normed value rounded to x's dtype, times the weight, rounded again; the half
rotation with the full-width signed tables; rounded to the output dtype.

CUDA: the kernels in `cute_rope_append_kernel` (a ValueError where `cute_dsl_unavailable`, never a silent
fallback to torch); CPU: the torch reference (`rope_append_reference`, `mla_rope_append_reference`:
`norm_rope_reference` then `reference_paged_kv_append`), which the tests compare the kernels against.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cute_norm_rope import cute_dsl_unavailable, norm_rope_reference
from .interface import HeadNorms, joint_planes
from .paged_append import reference_paged_kv_append
from .rope_append_checks import check_mla_rope_append, check_rope_append


def rope_append_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                          qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, refused: torch.Tensor,
                          head_norms: Optional[HeadNorms] = None) -> torch.Tensor:
    """The torch form of `cute_rope_append` (inputs already checked): returns q_out, writes kv_cache and
    refused in place."""
    c, s = cos[:, 0], sin[:, 0]
    dim, normed = q.shape[-1], head_norms is not None

    def prep(x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
        return norm_rope_reference(x, c, s, dim if normed else 0, weight, head_norms.eps if normed else 1e-6,
                                   normed)
    q_w, k_w = (head_norms.q_weight, head_norms.k_weight) if normed else (None, None)
    out, k_rot = prep(q, q_w), prep(k, k_w)
    reference_paged_kv_append(torch.cat((k_rot, v), dim=1), joint_planes(kv_cache), slot_mapping, block_tables,
                              qo_indptr, tokens_per_seq, 0, refused)
    return out


def mla_rope_append_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              qo_indptr: Optional[torch.Tensor], tokens_per_seq: int,
                              refused: torch.Tensor) -> torch.Tensor:
    """The torch form of `cute_mla_rope_append` (inputs already checked)."""
    c, s = cos[:, 0], sin[:, 0]
    rank = q_lat.shape[-1]
    out = torch.cat((q_lat, norm_rope_reference(q_pe, c, s, 0, None, 1e-6, False)), dim=-1)
    latent = norm_rope_reference(kv[:, None, :], c, s, rank, norm_weight, eps, True)
    reference_paged_kv_append(latent, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, 0, refused)
    return out


def _kernel_device(x: torch.Tensor) -> bool:
    """True where the kernel runs (CUDA; ValueError where it cannot), False for the CPU reference."""
    if x.device.type != "cuda":
        return False
    why = cute_dsl_unavailable(x.device)
    if why:
        raise ValueError(why)
    return True


def cute_rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, refused: torch.Tensor,
                     head_norms: Optional[HeadNorms] = None) -> torch.Tensor:
    """`triton_rope_append.rope_append` as one CuTe DSL launch: rotated (with head_norms: per-head
    RMSNormed first) q [T, Hq, D] as a new contiguous tensor; rotated k and v written into kv_cache
    [pages, 2, Hkv, P, D] at slot_mapping [T] int64 within each token's request's pages; refusals added
    to refused [1] int32 (module doc). Nothing here reads the device."""
    check_rope_append(q, k, v, cos, sin, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, refused,
                      head_norms)
    if not _kernel_device(q):
        return rope_append_reference(q, k, v, cos, sin, kv_cache, slot_mapping, block_tables, qo_indptr,
                                     tokens_per_seq, refused, head_norms)
    t_n, hq, dim = q.shape
    out = torch.empty(t_n, hq, dim, dtype=q.dtype, device=q.device)
    if t_n == 0:
        return out
    from .cute_rope_append_kernel import launch_rope_append
    normed = head_norms is not None
    q_w, k_w = (head_norms.q_weight[None], head_norms.k_weight[None]) if normed else (q[0, :1], q[0, :1])
    launch_rope_append((q, k, v, q_w, k_w, cos[:, 0], sin[:, 0], out, kv_cache, slot_mapping, block_tables,
                        refused if qo_indptr is None else qo_indptr, refused),
                       float(head_norms.eps) if normed else 1e-6, tokens_per_seq, (hq, k.shape[1]), dim,
                       kv_cache.shape[3], normed, qo_indptr is not None)
    return out


def cute_mla_rope_append(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor],
                         tokens_per_seq: int, refused: torch.Tensor) -> torch.Tensor:
    """`triton_rope_append.mla_rope_append` as one CuTe DSL launch: q [T, H, R + r] = [q_lat | rope(q_pe)]
    (a new tensor); the latent [rms_norm(c_kv) | rope(k_pe)] of kv [T, R + r] written into kv_cache [pages,
    1, 1, P, R + r] at slot_mapping within each token's request's pages; refusals added to refused."""
    check_mla_rope_append(q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, slot_mapping, block_tables,
                          qo_indptr, tokens_per_seq, refused)
    if not _kernel_device(q_lat):
        return mla_rope_append_reference(q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, slot_mapping,
                                         block_tables, qo_indptr, tokens_per_seq, refused)
    t_n, heads, rank = q_lat.shape
    rope_dim = kv.shape[-1] - rank
    out = torch.empty(t_n, heads, rank + rope_dim, dtype=q_lat.dtype, device=q_lat.device)
    if t_n == 0:
        return out
    from .cute_rope_append_kernel import launch_mla_rope_append
    launch_mla_rope_append((q_lat, q_pe, kv, norm_weight[None], cos[:, 0], sin[:, 0], out, kv_cache, slot_mapping,
                            block_tables, refused if qo_indptr is None else qo_indptr, refused),
                           float(eps), tokens_per_seq, heads, rank, rope_dim, kv_cache.shape[3], qo_indptr is not None)
    return out
