"""The CuTe DSL kernel of `cute_norm_rope` (imports nvidia-cutlass-dsl: import this module only where
`cute_norm_rope.dsl_import_error()` is empty). What it computes, and its numerics, are that module's doc.

One warp per row (t, h) of x [T, H, W], `ROWS_PER_CTA` rows per CTA. Lanes stride the columns (32
consecutive elements per load: coalesced); the statistic is a warp butterfly reduction; a rope column
loads its half-rotation partner column itself (normed again where it lies in the first norm_dim
columns), so no shared memory and no barrier. Compiled once per signature (`compiled_norm_rope`).
"""
import contextlib
import functools

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver
from cutlass.cute.runtime import from_dlpack

ROWS_PER_CTA = 4
F32 = cutlass.Float32


def cute_tensor(t: torch.Tensor) -> cute.Tensor:
    """t as a CuTe tensor with a dynamic layout (shapes and strides runtime values) and unit last stride:
    the compiled kernel's argument form, the same at compile time and at every call. Detached first: DLPack
    refuses a tensor that requires grad (a layer's norm weight is a Parameter)."""
    t = t.detach()
    return from_dlpack(t, assumed_align=t.element_size()).mark_layout_dynamic(leading_dim=t.dim() - 1)


def launch_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                     eps: float, norm_dim: int, apply_rmsnorm: bool, weight_kind: str) -> None:
    """One launch on torch's current stream of x's device (a CUDA graph's capture stream while one is
    captured): x [T, H, W], weight [1 or H, norm_dim] (any 2-d tensor for weight_kind "none": not read),
    cos / sin [T, R], out [T, H, W] (the destination columns), all checked by `cute_norm_rope`."""
    fn = compiled_norm_rope(str(x.device), x.dtype, x.shape[1], x.shape[2], norm_dim, cos.shape[1], apply_rmsnorm,
                            weight_kind)
    with torch.cuda.device(x.device):      # the DSL launches into the current device's context
        fn(*(cute_tensor(a) for a in (x, weight, cos, sin, out)), F32(eps),
           driver.CUstream(torch.cuda.current_stream(x.device).cuda_stream))


@functools.lru_cache(maxsize=None)
def compiled_norm_rope(device: str, dtype: torch.dtype, heads: int, width: int, norm_dim: int, rope_dim: int,
                       apply_rmsnorm: bool, weight_kind: str):
    """The kernel compiled for one signature, cached for the process: device ("cuda:N"; "cpu" for a compile
    check without a GPU: the tensors' address space differs), dtype, H, W, norm_dim, rope_dim,
    apply_rmsnorm and weight_kind ("none" | "shared" [1, norm_dim] | "per_head" [H, norm_dim]). Compiled
    for the device's arch as the DSL detects it (its `CUTE_DSL_ARCH` where no GPU is present: a CPU
    test). The result takes (x, weight, cos, sin, out as `cute_tensor`s, eps, stream); token count,
    strides and pointers are runtime values (the example tensors below only carry dtypes, ranks and the
    address space)."""
    launch = _build_launch(heads, width, norm_dim, rope_dim, apply_rmsnorm, weight_kind)
    dev = torch.device(device)
    x = torch.empty(2, heads, width, dtype=dtype, device=dev)
    w = torch.empty(heads if weight_kind == "per_head" else 1, norm_dim if weight_kind != "none" else width,
                    dtype=dtype, device=dev)
    tab = torch.empty(2, rope_dim, dtype=torch.float32, device=dev)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return cute.compile(launch, *(cute_tensor(a) for a in (x, w, tab, tab.clone(), x.clone())), F32(1e-6),
                            driver.CUstream(0))


def _build_launch(heads: int, width: int, norm_dim: int, rope_dim: int, apply_rmsnorm: bool, weight_kind: str):
    """The `cute.jit` launcher of one signature (its ints and flags are trace-time constants)."""
    half = rope_dim // 2
    rope_start = width - rope_dim
    weighted, per_head = weight_kind != "none", weight_kind == "per_head"

    @cute.kernel
    def kernel(mx: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, eps: F32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < mx.shape[0] * heads:
            t = row // heads
            h = row - t * heads
            wh = 0
            if cutlass.const_expr(per_head):
                wh = h
            scale = F32(1.0)
            if cutlass.const_expr(apply_rmsnorm):
                ss = F32(0.0)
                for c in cutlass.range(lane, norm_dim, 32):
                    v = mx[t, h, c].to(F32)
                    ss = ss + v * v
                ss = cute.arch.warp_reduction_sum(ss)
                scale = cute.math.rsqrt(ss / norm_dim + eps)
            for c in cutlass.range(lane, width, 32):
                v = mx[t, h, c].to(F32)
                if cutlass.const_expr(apply_rmsnorm):
                    if c < norm_dim:
                        v = (v * scale).to(mx.element_type).to(F32)
                        if cutlass.const_expr(weighted):
                            v = (v * mw[wh, c].to(F32)).to(mx.element_type).to(F32)
                if c >= rope_start:
                    j = c - rope_start
                    p = rope_start + (j + half) % rope_dim          # the partner column of the half rotation
                    vp = mx[t, h, p].to(F32)
                    if cutlass.const_expr(apply_rmsnorm):
                        if p < norm_dim:
                            vp = (vp * scale).to(mx.element_type).to(F32)
                            if cutlass.const_expr(weighted):
                                vp = (vp * mw[wh, p].to(F32)).to(mx.element_type).to(F32)
                    v = v * mcos[t, j] + vp * msin[t, j]
                mo[t, h, c] = v.to(mo.element_type)

    @cute.jit
    def launch(mx: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, eps: F32,
               stream: driver.CUstream):
        rows = mx.shape[0] * heads
        kernel(mx, mw, mcos, msin, mo, eps).launch(grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1],
                                                   block=[ROWS_PER_CTA * 32, 1, 1], stream=stream)

    return launch
