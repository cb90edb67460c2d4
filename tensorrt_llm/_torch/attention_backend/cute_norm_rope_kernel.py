"""The CuTe DSL kernel of `cute_norm_rope` and the row preparation it shares with `cute_rope_append_kernel`
(imports nvidia-cutlass-dsl and apache-tvm-ffi: import this module only where
`cute_norm_rope.dsl_import_error()` is empty). What they compute, and their numerics, are that module's doc.

Layout of the work: a row of W columns is cut into chunks of V contiguous elements (V = 16 bytes' worth
where every pointer, stride and column boundary allows it: one 128-bit load or store per chunk; else
smaller, down to 1); L lanes (a power of two dividing the chunk count and the norm / rope boundaries)
share a row, lane `sub` holding chunks sub, sub + L, ... in registers, so the statistic is a butterfly
sum over L lanes and the chunk's place (normed? rotated?) is known at trace time. A rotated chunk loads
its half-rotation partner chunk itself (normed again where it is in the normed columns): no shared memory,
no barrier. A CTA is 128 threads, 128 / L rows; every lane of a warp runs every shuffle (rows past the
end are clamped to the last row and not stored), so rows of one CTA may belong to different tokens.

Compiled once per signature with the TVM FFI calling convention (`--enable-tvm-ffi`): the compiled
function takes the torch tensors themselves and launches on torch's current stream (a CUDA graph's capture
stream while one is captured), so a call costs a few microseconds of host time. Token counts, strides and
pointers are runtime values; V, L and the widths are compile-time.
"""
import functools
from typing import Optional, Sequence

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_tensor
from cutlass.runtime import make_fake_stream

THREADS = 128
VECTOR_BYTES = 16
F32 = cutlass.Float32
_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
           torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}


def vector_width(elem_bytes: int, tensors: Sequence[torch.Tensor], columns: Sequence[int]) -> int:
    """The chunk width V (elements) of a launch: 16 bytes' worth, halved until every tensor's data pointer
    is V-element aligned, each of its strides but the last (which is 1) is a multiple of V, and V divides
    every column count and boundary in `columns` (0 entries ignored). Tensors of another element size
    (the float32 rope tables) need the same alignment in their own bytes."""
    v = VECTOR_BYTES // elem_bytes
    while v > 1:
        if all(c % v == 0 for c in columns) and all(
                t.data_ptr() % (v * t.element_size()) == 0 and all(s % v == 0 for s in t.stride()[:-1])
                for t in tensors):
            return v
        v //= 2
    return 1


def lanes_per_row(chunks: int, boundaries: Sequence[int]) -> int:
    """L: the largest power of two <= 32 dividing the chunk count and each boundary (in chunks) strictly
    inside the row, so lane `sub`'s i-th chunk sub + i L is on a known side of every boundary."""
    lanes = 32
    while lanes > 1 and (chunks % lanes or any(0 < b < chunks and b % lanes for b in boundaries)):
        lanes //= 2
    return lanes


def fake(dtype: torch.dtype, shape: tuple, v: int, static_strides: Optional[tuple] = None):
    """A compile-time tensor of `shape` (None = a runtime extent) with unit last stride: the other strides are
    runtime values divisible by v (or the given static ones), the base pointer v elements aligned."""
    shape = tuple(cute.sym_int() if s is None else s for s in shape)
    strides = static_strides or tuple(cute.sym_int64(divisibility=v) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(_DTYPES[dtype], shape, strides, assumed_align=v * dtype.itemsize)


def compile_tvm(launch, *args):
    """`cute.compile` of a launcher for the TVM FFI convention (torch tensors in, torch's current stream)."""
    return cute.compile(launch, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


@cute.jit
def clamp_row(row: cutlass.Int32, rows: cutlass.Int32):
    """(row, valid): a row past the last is clamped to the last (computed again, not stored)."""
    valid = row < rows
    if row > rows - 1:
        row = rows - 1
    return row, valid


@cute.jit
def _normed(x, scale: F32, w: cute.Tensor, c: cutlass.Int32, dt: cutlass.Constexpr, v: cutlass.Constexpr,
            weighted: cutlass.Constexpr[bool]):
    """A chunk's RMSNorm: x * scale rounded to dt, times the weight chunk c, rounded again (float32 out)."""
    y = (x * scale).to(dt).to(F32)
    if cutlass.const_expr(weighted):
        y = (y * cute.zipped_divide(w, (v,))[(None, c)].load().to(F32)).to(dt).to(F32)
    return y


@cute.jit
def prep_chunks(src: cute.Tensor, w: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, eps: F32, sub: cutlass.Int32,
                v: cutlass.Constexpr[int], lanes: cutlass.Constexpr[int], width: cutlass.Constexpr[int],
                norm_dim: cutlass.Constexpr[int], rope_dim: cutlass.Constexpr[int], apply: cutlass.Constexpr[bool],
                weighted: cutlass.Constexpr[bool]) -> list:
    """Lane `sub`'s prepared chunks (float32, V each; chunk i is columns (sub + i L) V ..) of the row src
    [width] (`cute_norm_rope`'s numerics): the first norm_dim columns RMSNormed (times w [norm_dim] when
    weighted) when apply, the last rope_dim columns rotated with cos / sin [rope_dim]. Every lane of the
    warp must call it (the statistic is a shuffle over the row's L lanes)."""
    n, nn, rs = width // v, norm_dim // v, (width - rope_dim) // v
    rc = rope_dim // v
    hc = rc // 2
    dt = src.element_type
    rows = cute.zipped_divide(src, (v,))
    xs = []
    ss = F32(0.0)
    for i in cutlass.range_constexpr(n // lanes):
        x = rows[(None, sub + i * lanes)].load().to(F32)
        xs.append(x)
        if cutlass.const_expr(apply and i * lanes < nn):
            ss = ss + (x * x).reduce(cute.ReductionOp.ADD, F32(0.0), 0)
    scale = F32(1.0)
    if cutlass.const_expr(apply):
        ss = cute.arch.warp_reduction_sum(ss, threads_in_group=lanes)
        scale = cute.math.rsqrt(ss / norm_dim + eps)
    out = []
    for i in cutlass.range_constexpr(n // lanes):
        c = sub + i * lanes
        x = xs[i]
        if cutlass.const_expr(apply and i * lanes < nn):
            x = _normed(x, scale, w, c, dt, v, weighted)
        if cutlass.const_expr(i * lanes >= rs):
            j = c - rs
            p = rs + (j + hc) % rc                        # the partner chunk of the half rotation
            xp = rows[(None, p)].load().to(F32)
            if cutlass.const_expr(apply and nn >= n):      # the whole rope tail is normed
                xp = _normed(xp, scale, w, p, dt, v, weighted)
            elif cutlass.const_expr(apply and nn > rs):    # the norm ends inside the rope tail
                inside = cute.full(xp.shape, p < nn, cutlass.Boolean)
                pn = p
                if pn > nn - 1:
                    pn = nn - 1                               # a weight chunk that exists (discarded)
                xp = cute.where(inside, _normed(xp, scale, w, pn, dt, v, weighted), xp)
            cs = cute.zipped_divide(cos, (v,))[(None, j)].load()
            sn = cute.zipped_divide(sin, (v,))[(None, j)].load()
            x = x * cs + xp * sn
        out.append(x)
    return out


@cute.jit
def store_chunks(chunks: list, dst: cute.Tensor, sub: cutlass.Int32, v: cutlass.Constexpr[int],
                 lanes: cutlass.Constexpr[int], first: cutlass.Constexpr[int]):
    """Store lane `sub`'s chunks (from `prep_chunks`) into dst's chunks first + sub + i L, in dst's dtype."""
    rows = cute.zipped_divide(dst, (v,))
    for i in cutlass.range_constexpr(len(chunks)):
        rows[(None, first + sub + i * lanes)].store(chunks[i].to(dst.element_type))


@cute.jit
def copy_chunks(src: cute.Tensor, dst: cute.Tensor, sub: cutlass.Int32, v: cutlass.Constexpr[int],
                lanes: cutlass.Constexpr[int], width: cutlass.Constexpr[int], first: cutlass.Constexpr[int]):
    """dst chunks first + c = src chunks c for lane `sub`'s chunks of a [width] row (no conversion)."""
    s, d = cute.zipped_divide(src, (v,)), cute.zipped_divide(dst, (v,))
    vals = []
    for i in cutlass.range_constexpr(width // v // lanes):
        vals.append(s[(None, sub + i * lanes)].load())
    for i in cutlass.range_constexpr(width // v // lanes):
        d[(None, first + sub + i * lanes)].store(vals[i])


def launch_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                     eps: float, norm_dim: int, apply_rmsnorm: bool, weight_kind: str) -> None:
    """One launch on torch's current stream: x [T, H, W], weight [1 or H, norm_dim] (any 2-d tensor for
    weight_kind "none": not read), cos / sin [T, R], out [T, H, W] (the destination columns), all checked
    by `cute_norm_rope`."""
    width, rope_dim = x.shape[2], cos.shape[1]
    cols = (width, norm_dim if apply_rmsnorm else 0, width - rope_dim, rope_dim // 2)
    v = vector_width(x.element_size(), (x, out, cos, sin) + ((weight,) if weight_kind != "none" else ()), cols)
    fn = compiled_norm_rope(x.dtype, x.shape[1], width, norm_dim, rope_dim, apply_rmsnorm, weight_kind, v)
    fn(x, weight, cos, sin, out, eps)


@functools.lru_cache(maxsize=None)
def compiled_norm_rope(dtype: torch.dtype, heads: int, width: int, norm_dim: int, rope_dim: int,
                       apply_rmsnorm: bool, weight_kind: str, v: int):
    """The kernel compiled for one signature, cached for the process: dtype, H, W, norm_dim, rope_dim,
    apply_rmsnorm, weight_kind ("none" | "shared" [1, norm_dim] | "per_head" [H, norm_dim]) and the chunk
    width v (`vector_width`). Compiled for the GPU's arch as the DSL detects it (its `CUTE_DSL_ARCH` where
    no GPU is present: a CPU test). The result takes (x, weight, cos, sin, out, eps) as torch tensors."""
    nd = norm_dim if apply_rmsnorm else 0
    lanes = lanes_per_row(width // v, (nd // v, (width - rope_dim) // v))
    launch = _build_launch(heads, width, nd, rope_dim, apply_rmsnorm, weight_kind, v, lanes)
    w_rows = heads if weight_kind == "per_head" else 1
    return compile_tvm(launch, fake(dtype, (None, heads, width), v), fake(dtype, (w_rows, nd or width), v),
                       fake(torch.float32, (None, rope_dim), v), fake(torch.float32, (None, rope_dim), v),
                       fake(dtype, (None, heads, width), v), F32(1e-6))


def _build_launch(heads: int, width: int, norm_dim: int, rope_dim: int, apply: bool, weight_kind: str, v: int,
                  lanes: int):
    """The `cute.jit` launcher of one signature (its ints and flags are trace-time constants)."""
    per_head, weighted = weight_kind == "per_head", weight_kind != "none"
    rows_per_cta = THREADS // lanes

    @cute.kernel
    def kernel(mx: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, eps: F32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sub = tidx % lanes
        row, valid = clamp_row(bidx * rows_per_cta + tidx // lanes, mx.shape[0] * heads)
        t = row // heads
        h = row - t * heads
        wh = 0
        if cutlass.const_expr(per_head):
            wh = h
        y = prep_chunks(mx[t, h, None], mw[wh, None], mcos[t, None], msin[t, None], eps, sub, v, lanes, width,
                        norm_dim, rope_dim, apply, weighted)
        if valid:
            store_chunks(y, mo[t, h, None], sub, v, lanes, 0)

    @cute.jit
    def launch(mx: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, eps: F32,
               stream):
        rows = mx.shape[0] * heads
        kernel(mx, mw, mcos, msin, mo, eps).launch(grid=[(rows + rows_per_cta - 1) // rows_per_cta, 1, 1],
                                                   block=[THREADS, 1, 1], stream=stream)

    return launch
