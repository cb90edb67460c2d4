"""The drafter's draft context of every layer written in one Triton launch (CUDA; Triton's
interpreter on a CPU test): GQA's K/V (`write_gqa_context`), MLA's latents (`write_mla_context`:
the same per (row, layer) program, kv_a_layernorm over the latent's first R columns and the
rotation of its rope tail).

After the one GEMM over the layers' stacked k|v rows (`ContextWeights`), row t of layer l holds that
layer's k heads, then its v heads. One program per (row, layer): k RMSNormed per head with layer l's
k_norm weight (float32 statistic, times the weight, rounded once to kv's dtype: the order of
`dspark_regions.gqa_context_kv`), rotated by the half rotation at table row positions[t], and written
with v into the pool at slot_mapping[t]; a -1 slot is skipped in the kernel (no host sync).

This replaces the compiled norm + RoPE region and the scatter: inductor compiles that region to one
pointwise kernel that recomputes the norm statistic for every element (108 us for 576 rows at batch
64 on an H200, 7.5 us for 9 rows), and the scatter is a kernel of its own.

    kv [T, L * 2 * Hkv * D]          the GEMM's output, contiguous rows
    norm_weight [L, D]               the layers' k_norm weights (kv's dtype)
    positions [T] int64              absolute positions (rows of the tables)
    cos_t / sin_t [N, D] float32     `RotaryEmbedding.tables` (half rotation: full-width signed)
    pool [L, pages, 2, Hkv, P, D]    the draft pool (`stacked_layers`), each layer contiguous
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _context_kv_kernel(kv_ptr, stride_kvt, norm_ptr, eps, pos_ptr, cos_ptr, sin_ptr, stride_tab, pool_ptr,
                       stride_pl, stride_pp, stride_pplane, slots_ptr, HKV: tl.constexpr, HKV_P: tl.constexpr,
                       D: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0)
    layer = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        d = tl.arange(0, D)
        dsw = (d + D // 2) % D
        p = tl.load(pos_ptr + t)
        cos = tl.load(cos_ptr + p * stride_tab + d)
        sin = tl.load(sin_ptr + p * stride_tab + d)
        h = tl.arange(0, HKV_P)
        ok = h[:, None] < HKV
        row = kv_ptr + t.to(tl.int64) * stride_kvt + layer * (2 * HKV * D)
        x = tl.load(row + h[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        xs = tl.load(row + h[:, None] * D + dsw[None, :], mask=ok, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(norm_ptr + layer * D + d).to(tl.float32)
        ws = tl.load(norm_ptr + layer * D + dsw).to(tl.float32)
        kt = kv_ptr.dtype.element_ty
        xn = (x * r[:, None] * w[None, :]).to(kt).to(tl.float32)
        xsn = (xs * r[:, None] * ws[None, :]).to(kt).to(tl.float32)
        k = (xn * cos[None, :] + xsn * sin[None, :]).to(kt)
        dt = pool_ptr.dtype.element_ty
        # int64 offsets: the stacked pool of the engine's layers passes 2**31 elements (e.g. 5 layers x
        # 8,192 pages x 2 x 16 heads x 32 x 64), where an int32 layer * stride_pl wraps
        cell = (pool_ptr + layer.to(tl.int64) * stride_pl + (slot // PAGE) * stride_pp + h[:, None] * (PAGE * D)
                + (slot % PAGE) * D + d[None, :])
        tl.store(cell, k.to(dt), mask=ok)
        v = tl.load(row + HKV * D + h[:, None] * D + d[None, :], mask=ok, other=0.0)
        tl.store(cell + stride_pplane, v.to(dt), mask=ok)


def write_gqa_context(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                      cos_t: torch.Tensor, sin_t: torch.Tensor, pool: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write every layer's context K/V of rows kv into the pool (module doc). Nothing here reads the
    device: positions must be rows of the tables and slots within the pool (the engine's are)."""
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(f"pool must be [L, pages, 2, Hkv, P, D], got {tuple(pool.shape)}")
    layers, _, _, hkv, page, dim = pool.shape
    if pool.stride()[3:] != (page * dim, dim, 1) or pool.stride(2) != hkv * page * dim:
        raise ValueError(f"pool layers must be contiguous [pages, 2, Hkv, P, D], got strides {pool.stride()}")
    if dim % 2 or dim & (dim - 1) or page & (page - 1):
        raise ValueError(f"head_dim {dim} and page size {page} must be powers of two")
    t = kv.shape[0]
    if kv.dim() != 2 or kv.shape[1] != layers * 2 * hkv * dim or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {layers * 2 * hkv * dim}] with contiguous rows, got {tuple(kv.shape)}")
    if norm_weight.shape != (layers, dim) or not norm_weight.is_contiguous() or norm_weight.dtype != kv.dtype:
        raise ValueError(f"norm_weight must be a contiguous [{layers}, {dim}] {kv.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    _check_common(kv, norm_weight, eps, positions, cos_t, sin_t, pool, slot_mapping, dim)
    if t == 0:
        return
    _context_kv_kernel[(t, layers)](
        kv, kv.stride(0), norm_weight, float(eps), positions, cos_t, sin_t, cos_t.stride(0), pool, pool.stride(0),
        pool.stride(1), pool.stride(2), slot_mapping, HKV=hkv, HKV_P=triton.next_power_of_2(hkv), D=dim, PAGE=page,
        num_warps=2)


def _check_common(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  cos_t: torch.Tensor, sin_t: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
                  rot_dim: int) -> None:
    """The checks both forms share: eps, the tables' width (rot_dim), the rows' int64 positions and
    slots, one device."""
    t = kv.shape[0]
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    for name, x in (("cos_t", cos_t), ("sin_t", sin_t)):
        if x.dim() != 2 or x.shape[1] != rot_dim or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [N, {rot_dim}] float32 table, got {tuple(x.shape)} "
                             f"{x.dtype}")
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape != (t,) or x.dtype != torch.int64:
            raise ValueError(f"{name} must be [{t}] int64, got {tuple(x.shape)} {x.dtype}")
    devices = {x.device for x in (kv, norm_weight, positions, cos_t, sin_t, pool, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"every argument must be on one device, got {sorted(map(str, devices))}")


@triton.jit
def _context_latent_kernel(kv_ptr, stride_kvt, norm_ptr, eps, pos_ptr, cos_ptr, sin_ptr, stride_tab, pool_ptr,
                           stride_pl, stride_pp, slots_ptr, R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0)
    layer = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        r = tl.arange(0, R)
        d = tl.arange(0, DR)
        dsw = (d + DR // 2) % DR
        row = kv_ptr + t.to(tl.int64) * stride_kvt + layer * (R + DR)
        kt = kv_ptr.dtype.element_ty
        c = tl.load(row + r).to(tl.float32)
        w = tl.load(norm_ptr + layer * R + r).to(tl.float32)
        c = (c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps) * w).to(kt)
        p = tl.load(pos_ptr + t)
        cos = tl.load(cos_ptr + p * stride_tab + d)
        sin = tl.load(sin_ptr + p * stride_tab + d)
        k = (tl.load(row + R + d).to(tl.float32) * cos + tl.load(row + R + dsw).to(tl.float32) * sin).to(kt)
        dt = pool_ptr.dtype.element_ty
        cell = pool_ptr + layer.to(tl.int64) * stride_pl + (slot // PAGE) * stride_pp + (slot % PAGE) * (R + DR)
        tl.store(cell + r, c.to(dt))
        tl.store(cell + R + d, k.to(dt))


def write_mla_context(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                      cos_t: torch.Tensor, sin_t: torch.Tensor, pool: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The MLA drafter's form: kv [T, L * (R + r)] (the stacked kv_a GEMM's output, layer l's [c_kv |
    k_pe] at columns l (R + r)..), norm_weight [L, R] (the layers' kv_a_layernorm weights) -> each
    layer's latent [rms_norm(c_kv) | rope(k_pe)] (`dspark_regions.mla_context_latents`' rounding: the
    norm's float32 product times the weight, rounded once) into pool [L, pages, 1, 1, P, R + r] at
    slot_mapping (-1 skipped in the kernel). Checks as `write_gqa_context`."""
    if pool.dim() != 6 or pool.shape[2:4] != (1, 1):
        raise ValueError(f"pool must be [L, pages, 1, 1, P, R + r], got {tuple(pool.shape)}")
    layers, _, _, _, page, width = pool.shape
    if pool.stride()[2:] != (page * width,) * 2 + (width, 1):
        raise ValueError(f"pool layers must be contiguous [pages, 1, 1, P, R + r], got strides {pool.stride()}")
    rank = norm_weight.shape[-1]
    rope = width - rank
    for name, n in (("kv_lora_rank", rank), ("rope dim", rope), ("page size", page)):
        if n < 2 or n & (n - 1):
            raise ValueError(f"{name} {n} must be a power of two >= 2")
    t = kv.shape[0]
    if kv.dim() != 2 or kv.shape[1] != layers * width or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {layers * width}] with contiguous rows, got {tuple(kv.shape)}")
    if norm_weight.shape != (layers, rank) or not norm_weight.is_contiguous() or norm_weight.dtype != kv.dtype:
        raise ValueError(f"norm_weight must be a contiguous [{layers}, R] {kv.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    _check_common(kv, norm_weight, eps, positions, cos_t, sin_t, pool, slot_mapping, rope)
    if t == 0:
        return
    _context_latent_kernel[(t, layers)](
        kv, kv.stride(0), norm_weight, float(eps), positions, cos_t, sin_t, cos_t.stride(0), pool, pool.stride(0),
        pool.stride(1), slot_mapping, R=rank, DR=rope, PAGE=page, num_warps=4)
