"""Fused RMSNorm + RoPE preparation of attention rows: a CuTe DSL kernel (nvidia-cutlass-dsl, sm90+)
and its torch reference (the CPU path, and what the tests compare against).

Row (t, h) of x [T, H, W] (W = width) becomes::

    y[:norm_dim]   = rms_norm(x[:norm_dim]) * weight        (apply_rmsnorm; else x[:norm_dim] as is)
    y[norm_dim:]   = x[norm_dim:]                           (passed through raw)
    y[W - R:]      = rope(y[W - R:], cos[t], sin[t])        (R = rope_dim, the last R columns)
    out[t, h, out_offset : out_offset + W] = y

so a GQA q / k head is `norm_dim = R = W = head_dim` (normed, then rotated), an MLA latent row is
`W = 576, norm_dim = 512, R = 64` (the latent normed, the rope tail raw and then rotated), and an
absorbed MLA query's rope part is `norm_dim = 0, apply_rmsnorm = False, R = W = 64` written at
`out_offset = 512` of the [T, H, 576] query. Numerics (float32 inside): the statistic
rsqrt(mean(x^2) + eps) over the first norm_dim columns; the normed value rounded to x's dtype, times
the weight, rounded again (`modules.rms_norm`'s order and the TRITON append's); the half rotation with
the full-width signed tables of `RotaryEmbedding.cos_sin` (y * cos + [y2 | y1] * sin), rounded to
out's dtype.

    x [T, H, W]              any token / head strides, contiguous columns; bfloat16, float16, float32
    cos / sin [T, R]         float32, any token stride, contiguous columns (a token's row serves its H rows)
    weight [norm_dim] or [H, norm_dim]   x's dtype, contiguous (one per head: e.g. every layer's norm)
    out [T, H, W_out]        x's dtype, any token / head strides, contiguous columns; out_offset + W <= W_out

The kernel: a row's columns in chunks of V elements held in registers (V = 16 bytes where pointers,
strides and column boundaries allow: 128-bit loads and stores), L lanes per row, the statistic a
butterfly sum over those lanes, a rope chunk loads its partner chunk itself (so out must not overlap x).
It lives in `cute_norm_rope_kernel` (imported only where the DSL is), compiled once per (dtype, H, W,
norm_dim, R, apply_rmsnorm, weight kind, V) with the TVM FFI convention (torch tensors in, torch's
current stream) and cached; token count, strides and pointers are runtime values. The GPU arch is the
device's (the DSL asks the driver). `cute_dsl_unavailable` is the
support predicate, checked before any numeric work: on CUDA without it `norm_rope` raises.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

MIN_SM = 90
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def dsl_import_error() -> str:
    """'' when the CuTe DSL (`cutlass.cute`, nvidia-cutlass-dsl) and its TVM FFI launcher (`tvm_ffi`,
    apache-tvm-ffi) import, else the import error."""
    try:
        importlib.import_module("cutlass.cute")
        importlib.import_module("tvm_ffi")
    except Exception as e:  # ImportError or a broken install (missing native libraries)
        return f"{type(e).__name__}: {e}"
    return ""


def cute_dsl_unavailable(device: torch.device) -> str:
    """The support predicate of the kernel on `device`: '' when it can run there, else why not (a CUDA
    device of sm90+, importable nvidia-cutlass-dsl and apache-tvm-ffi)."""
    if device.type != "cuda":
        return f"the CuTe DSL norm + RoPE kernel needs a CUDA device (device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major * 10 + minor < MIN_SM:
        return f"the CuTe DSL norm + RoPE kernel needs sm{MIN_SM}+ (Hopper), device is sm{major}{minor}"
    err = dsl_import_error()
    if err:
        return f"nvidia-cutlass-dsl / apache-tvm-ffi is not importable ({err}); install the 'cutedsl' extra"
    return ""


def check_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, norm_dim: int,
                    weight: Optional[torch.Tensor], eps: float, apply_rmsnorm: bool, out_offset: int) -> None:
    """Raise ValueError naming the argument and its value when `norm_rope` cannot take these inputs."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, W], got shape {tuple(x.shape)}")
    t_n, heads, width = x.shape
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {x.dtype}")
    if width < 1 or (x.numel() and x.stride(2) != 1):
        raise ValueError(f"x must have contiguous columns (stride 1), got strides {x.stride()}")
    if not 0 <= norm_dim <= width:
        raise ValueError(f"norm_dim must be in [0, {width}] (x's width), got {norm_dim}")
    if apply_rmsnorm and norm_dim == 0:
        raise ValueError("norm_dim must be >= 1 with apply_rmsnorm (0 columns to normalise)")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[0] != t_n or tab.dtype != torch.float32:
            raise ValueError(f"{name} must be [{t_n}, rope_dim] float32, got {tuple(tab.shape)} {tab.dtype}")
        if tab.numel() and tab.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous columns (stride 1), got strides {tab.stride()}")
    rope_dim = cos.shape[1]
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if rope_dim < 2 or rope_dim % 2 or rope_dim > width:
        raise ValueError(f"rope_dim (cos's width) must be even and in [2, {width}], got {rope_dim}")
    if weight is not None:
        if weight.shape not in ((norm_dim,), (heads, norm_dim)) or weight.dtype != x.dtype or \
                not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{norm_dim}] or [{heads}, {norm_dim}] {x.dtype}, got "
                             f"{tuple(weight.shape)} {weight.dtype} strides {weight.stride()}")
        if not apply_rmsnorm:
            raise ValueError("weight given with apply_rmsnorm=False (it would be ignored)")
    if out.dim() != 3 or out.shape[:2] != (t_n, heads):
        raise ValueError(f"out must be [{t_n}, {heads}, W_out], got shape {tuple(out.shape)}")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype must be x's ({x.dtype}), got {out.dtype}")
    if out.numel() and out.stride(2) != 1:
        raise ValueError(f"out must have contiguous columns (stride 1), got strides {out.stride()}")
    if out_offset < 0 or out_offset + width > out.shape[2]:
        raise ValueError(f"out_offset {out_offset} + width {width} overflows out's {out.shape[2]} columns")
    if not _rows_disjoint(out, width):
        raise ValueError(f"out's (token, head) rows overlap: token / head strides {out.stride()[:2]} for {width} "
                         "written columns (each row needs its own columns)")
    devices = {a.device for a in (x, cos, sin, out) + (() if weight is None else (weight,))}
    if len(devices) != 1:
        raise ValueError(f"x, cos, sin, weight and out must be on one device, got {sorted(map(str, devices))}")
    (x0, x1), (o0, o1) = _span(x), _span(out[:, :, out_offset:out_offset + width])
    if x0 < o1 and o0 < x1:
        raise ValueError("out's columns out_offset .. out_offset + W overlap x (a row's rope columns read their "
                         "partner columns while the row is written)")


def _rows_disjoint(out: torch.Tensor, width: int) -> bool:
    """No two (token, head) rows of `width` columns share an element: over the token and head modes of
    more than one row, in increasing stride, each stride clears the extent of the modes below it."""
    extent = width
    for stride, size in sorted((out.stride(d), out.shape[d]) for d in (0, 1) if out.shape[d] > 1):
        if stride < extent:
            return False
        extent = stride * size
    return True


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [first, last + 1) that t's elements occupy (empty for no elements)."""
    if t.numel() == 0 or t.device.type == "meta":
        return 0, 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def norm_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_dim: int,
                        weight: Optional[torch.Tensor], eps: float, apply_rmsnorm: bool) -> torch.Tensor:
    """The torch form of the kernel (module doc): x [T, H, W] -> y [T, H, W] in x's dtype."""
    width, rope_dim = x.shape[2], cos.shape[1]
    y = x.float()
    if apply_rmsnorm:
        head = y[..., :norm_dim]
        head = (head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
        if weight is not None:
            head = (head * weight.float()).to(x.dtype).float()
        y = torch.cat((head, y[..., norm_dim:]), dim=-1)
    tail, half = y[..., width - rope_dim:], rope_dim // 2
    rot = tail * cos[:, None, :] + torch.cat((tail[..., half:], tail[..., :half]), dim=-1) * sin[:, None, :]
    return torch.cat((y[..., :width - rope_dim], rot), dim=-1).to(x.dtype)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, norm_dim: int,
              weight: Optional[torch.Tensor] = None, eps: float = 1e-6, apply_rmsnorm: bool = True,
              out_offset: int = 0) -> torch.Tensor:
    """Write the prepared rows of x [T, H, W] into out[:, :, out_offset : out_offset + W] (module doc) and
    return out. CUDA: the CuTe DSL kernel (ValueError where `cute_dsl_unavailable`, never a silent
    fallback); CPU: the torch reference."""
    check_norm_rope(x, cos, sin, out, norm_dim, weight, eps, apply_rmsnorm, out_offset)
    width = x.shape[2]
    dst = out[:, :, out_offset:out_offset + width]
    if x.device.type != "cuda":
        dst.copy_(norm_rope_reference(x, cos, sin, norm_dim, weight, eps, apply_rmsnorm))
        return out
    why = cute_dsl_unavailable(x.device)
    if why:
        raise ValueError(why)
    if x.shape[0] == 0:
        return out
    from .cute_norm_rope_kernel import launch_norm_rope
    kind = "none" if weight is None else ("shared" if weight.dim() == 1 else "per_head")
    w = x[0, :1, :] if weight is None else (weight[None, :] if weight.dim() == 1 else weight)
    launch_norm_rope(x, w, cos, sin, dst, eps, norm_dim, apply_rmsnorm, kind)
    return out
