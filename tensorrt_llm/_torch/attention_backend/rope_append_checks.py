"""The validation of the fused RoPE + page-bounded append (`forward_rope` / `forward_mla_rope`), shared
word for word by its Triton form (`triton_rope_append`) and its CuTe DSL form (`cute_rope_append`), so both
take the same inputs and refuse the same ones with the same messages. Imports neither triton nor the DSL.
The inputs and the write's bound are `triton_rope_append`'s module doc.
"""
from __future__ import annotations

from typing import Optional

import torch

from .interface import HeadNorms
from .paged_append import check_paged_kv_append


def _heads_contiguous(name: str, x: torch.Tensor, heads: int, dim: int) -> None:
    if x.dim() != 3 or x.shape[1:] != (heads, dim):
        raise ValueError(f"{name} must be [T, {heads}, {dim}], got {tuple(x.shape)}")
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError(f"{name} must have contiguous heads and dims (strides [*, {dim}, 1]), got {x.stride()}")


def _check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, t_n: int, dim: int) -> None:
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dtype != torch.float32 or x.shape != (t_n, 1, dim) or x.stride(2) != 1:
            raise ValueError(f"{name} must be [{t_n}, 1, {dim}] float32 with contiguous dims, got "
                             f"{tuple(x.shape)} {x.dtype}")


def _check_token_split(qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, b_n: int, t_n: int) -> None:
    if qo_indptr is None and (tokens_per_seq < 1 or tokens_per_seq * b_n != t_n):
        raise ValueError(f"tokens_per_seq {tokens_per_seq} does not split {t_n} tokens over {b_n} requests")


def check_rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, refused: torch.Tensor,
                      head_norms: Optional[HeadNorms]) -> None:
    """ValueError naming the argument unless `rope_append` (either form) takes these inputs: q [T, Hq, D],
    k / v [T, Hkv, D] with contiguous heads and dims, cos / sin [T, 1, D] float32, kv_cache [pages, 2,
    Hkv, P, D] contiguous in q's dtype (D and P powers of two), head_norms' weights [D] in q's dtype, and
    the append's own checks (`check_paged_kv_append`: the C++ op's words)."""
    t_n, hq, dim = q.shape if q.dim() == 3 else (0, 0, 0)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    pages, planes, hkv, page_size, width = kv_cache.shape if kv_cache.dim() == 5 else (0,) * 5
    if kv_cache.dim() != 5 or planes != 2 or width != dim:
        raise ValueError(f"kv_cache must be [pages, 2, Hkv, P, {dim}], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous() or kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache must be contiguous in q's dtype ({q.dtype}), got {kv_cache.dtype}")
    if dim % 2 or dim & (dim - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim {dim} and page size {page_size} must be powers of two")
    _heads_contiguous("q", q, hq, dim)
    _heads_contiguous("k", k, hkv, dim)
    _heads_contiguous("v", v, hkv, dim)
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != t_n:
            raise ValueError(f"{name} holds {x.shape[0]} tokens, q {t_n}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} dtype must be q's ({q.dtype}), got {x.dtype}")
    _check_rope_tables(cos, sin, t_n, dim)
    if head_norms is not None:
        if not head_norms.eps > 0:
            raise ValueError(f"head_norms.eps must be > 0, got {head_norms.eps}")
        for name, w in (("q_weight", head_norms.q_weight), ("k_weight", head_norms.k_weight)):
            if w.shape != (dim,) or w.dtype != q.dtype or w.device != q.device or w.stride(0) != 1:
                raise ValueError(f"head_norms.{name} must be [{dim}] contiguous {q.dtype} on {q.device}, got "
                                 f"{tuple(w.shape)} {w.dtype} on {w.device}")
    b_n = block_tables.shape[0]
    _check_token_split(qo_indptr, tokens_per_seq, b_n, t_n)
    # the append's own checks (slots, tables, query offsets, counter, devices, layouts: the C++ op's words)
    check_paged_kv_append(k, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, 0, refused)
    for name, x in (("q", q), ("cos", cos), ("sin", sin)):
        if x.device != k.device:
            raise ValueError(f"{name} must be on {k.device} (k's device), got {x.device}")


def check_mla_rope_append(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor],
                          tokens_per_seq: int, refused: torch.Tensor, w_uk: Optional[torch.Tensor] = None) -> None:
    """ValueError naming the argument unless `mla_rope_append` (either form) takes these inputs: q_lat
    [T, H, R] and q_pe [T, H, r] with contiguous dims, kv [T, R + r] with contiguous dims, kv_cache
    [pages, 1, 1, P, R + r] contiguous, one dtype for all four, R, r and P powers of two >= 2, cos / sin
    [T, 1, r] float32, norm_weight [R], eps > 0, and the append's own checks. With w_uk [H, nope, R]
    (contiguous, the same dtype) q_lat is q_nope [T, H, nope], nope and R powers of two >= 16."""
    t_n, heads, rank = q_lat.shape if q_lat.dim() == 3 else (0, 0, 0)
    name = "q_lat" if w_uk is None else "q_nope"
    if q_lat.dim() != 3 or q_lat.stride(2) != 1:
        raise ValueError(f"{name} must be [T, H, {'R' if w_uk is None else 'nope'}] with contiguous dims, got "
                         f"{tuple(q_lat.shape)} strides {q_lat.stride()}")
    if w_uk is not None:
        nope = rank
        if w_uk.dim() != 3 or w_uk.shape[:2] != (heads, nope) or not w_uk.is_contiguous() or w_uk.dtype != q_lat.dtype:
            raise ValueError(f"w_uk must be [{heads}, {nope}, R] contiguous {q_lat.dtype} (q_nope's heads and width), "
                             f"got {tuple(w_uk.shape)} {w_uk.dtype}")
        rank = w_uk.shape[2]
        for what, n in (("q_nope width", nope), ("kv_lora_rank", rank)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"{what} {n} must be a power of two >= 16 to form q_nope W_UK in the launch")
        if w_uk.device != kv.device:
            raise ValueError(f"w_uk must be on {kv.device} (kv's device), got {w_uk.device}")
    rope_dim = kv.shape[-1] - rank
    if q_pe.dim() != 3 or q_pe.shape != (t_n, heads, rope_dim) or q_pe.stride(2) != 1:
        raise ValueError(f"q_pe must be [{t_n}, {heads}, {rope_dim}] with contiguous dims, got "
                         f"{tuple(q_pe.shape)} strides {q_pe.stride()}")
    if kv.dim() != 2 or kv.shape[0] != t_n or kv.stride(1) != 1:
        raise ValueError(f"kv must be [{t_n}, R + r] with contiguous dims, got {tuple(kv.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1:3] != (1, 1) or kv_cache.shape[4] != rank + rope_dim:
        raise ValueError(f"kv_cache must be [pages, 1, 1, P, {rank + rope_dim}], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous() or len({q_lat.dtype, q_pe.dtype, kv.dtype, kv_cache.dtype}) != 1:
        raise ValueError(f"{name}, q_pe, kv and kv_cache must share one dtype (kv_cache contiguous), got "
                         f"{q_lat.dtype}, {q_pe.dtype}, {kv.dtype}, {kv_cache.dtype}")
    page_size = kv_cache.shape[3]
    for what, n in (("kv_lora_rank", rank), ("rope dim", rope_dim), ("page size", page_size)):
        if n < 2 or n & (n - 1):
            raise ValueError(f"{what} {n} must be a power of two >= 2")
    _check_rope_tables(cos, sin, t_n, rope_dim)
    if (norm_weight.shape != (rank,) or norm_weight.dtype != kv.dtype or norm_weight.device != kv.device
            or norm_weight.stride(0) != 1):
        raise ValueError(f"norm_weight must be [{rank}] contiguous {kv.dtype} on {kv.device}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    _check_token_split(qo_indptr, tokens_per_seq, block_tables.shape[0], t_n)
    check_paged_kv_append(kv[:, None, :], kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, 0, refused)
    for what, x in ((name, q_lat), ("q_pe", q_pe), ("cos", cos), ("sin", sin)):
        if x.device != kv.device:
            raise ValueError(f"{what} must be on {kv.device} (kv's device), got {x.device}")
