"""The position-wise halves of a decoder layer as pure functions, optionally compiled by inductor.

A decoder layer is attention between two position-wise regions::

    attention_inputs: rms_norm -> q|k|v GEMM -> RoPE of q and k (one rotation)   -> q, k, v
    output          : o_proj GEMM + residual -> rms_norm -> gate|up GEMM -> silu * up -> down + residual

Between two attentions a model runs one layer's output and the next layer's attention inputs as
one region (`output_then_inputs`), so the residual add and the next RMSNorm fuse as well.

Eagerly each region is a dozen small kernels (the casts, the rotation's slices and products,
the residual adds); `torch.compile` (inductor, no CUDA graphs of its own; `inductor_passes`) fuses
the pointwise work between the GEMMs into a few Triton kernels, and the engine's CUDA graphs
(whole-step, piecewise, draft) capture the compiled code like any other. The functions take every weight as
an argument, so one compiled graph serves all layers (dynamo guards on shapes and dtypes, not
on modules); token counts are dynamic (one trace for T = 1, one for any other T).

`LayerRegions.eager()` runs the same functions uncompiled: what a loaded target runs by default
(set with its fused projections), and the reference of the compiled one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .rms_norm import rms_norm
from .rotary_embedding import rope_halves


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, Hq + 2 Hkv, D] -> views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (token stride
    (Hq + 2 Hkv) D). One buffer: compiled, one pointwise kernel writes all three; k and v are its
    adjacent halves, so one cache write covers both (`attention_backend.interface.joint_kv`); every
    backend reads q through its strides or copies it itself."""
    q, k, v = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    return q, k, v


def attention_inputs(h: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                     qkv_b: Optional[torch.Tensor], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                     num_heads: int, num_kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, H] residual stream -> roped q [T, Hq, D], roped k [T, Hkv, D], v [T, Hkv, D], the views
    of one [T, Hq + 2 Hkv, D] buffer (`split_qkv`).

    qkv_w [(Hq + 2 Hkv) D, H] the fused projection; cos / sin [T, 1, D] from `RotaryEmbedding.cos_sin`
    (half-rotation tables), or both None: q and k are returned unrotated, views of the GEMM's
    output, for a backend that rotates them in its KV append (`fused_rope_append`)."""
    t = h.shape[0]
    qkv = F.linear(rms_norm(h, norm_w, eps), qkv_w, qkv_b)
    if cos is None:
        return split_qkv(qkv.view(t, num_heads + 2 * num_kv_heads, head_dim), num_heads, num_kv_heads)
    nqk = (num_heads + num_kv_heads) * head_dim
    qk = rope_halves(qkv[:, :nqk].view(t, num_heads + num_kv_heads, head_dim).float(), cos, sin).to(h.dtype)
    return split_qkv(torch.cat((qk, qkv[:, nqk:].view(t, num_kv_heads, head_dim)), dim=1), num_heads, num_kv_heads)


def layer_output(h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                 gate_up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """h [T, H] residual stream, o [T, Hq D] attention output -> the layer's output [T, H]
    (o_proj + residual, then the SwiGLU MLP + residual; gate_up_w [2I, H] the fused gate|up)."""
    h = h + F.linear(o, o_w)
    g, u = F.linear(rms_norm(h, norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return h + F.linear(F.silu(g) * u, down_w)


def output_then_inputs(h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                       gate_up_w: torch.Tensor, down_w: torch.Tensor, next_norm_w: torch.Tensor, next_eps: float,
                       qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                       sin: Optional[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's `layer_output`, then the next layer's `attention_inputs`, as one region: compiled,
    the last residual add and the next layer's RMSNorm are one kernel. Returns the layer's output
    h [T, H] and the next layer's q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (`split_qkv` views; roped
    unless cos / sin are None, as in `attention_inputs`)."""
    h = layer_output(h, o, o_w, norm_w, eps, gate_up_w, down_w)
    q, k, v = attention_inputs(h, next_norm_w, next_eps, qkv_w, qkv_b, cos, sin, num_heads, num_kv_heads, head_dim)
    return h, q, k, v


@dataclass(frozen=True)
class LayerRegions:
    """The region functions decoder layers call (eager, or compiled): a layer's two halves, and a
    layer's output joined to the next layer's attention inputs (the span between two attentions)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    output: Callable[..., torch.Tensor]
    output_then_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    compiled: bool

    @staticmethod
    def eager() -> "LayerRegions":
        return LayerRegions(attention_inputs, layer_output, output_then_inputs, compiled=False)

    @staticmethod
    def inductor() -> "LayerRegions":
        """Both regions compiled by inductor (dynamic token count). Compiled once per process: every
        model and engine shares the traces (their guards are shapes and dtypes)."""
        return _inductor_regions()


@functools.cache
def _inductor_regions() -> LayerRegions:
    from .inductor_passes import compile_region
    return LayerRegions(compile_region(attention_inputs), compile_region(layer_output),
                        compile_region(output_then_inputs), compiled=True)
