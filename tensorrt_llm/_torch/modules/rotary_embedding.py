"""Rotary position embedding with HF `rope_scaling` types: default, linear, llama3, yarn.

Two layouts: half-rotation (HF Llama: pairs (i, i + d/2)) and interleaved (adjacent
pairs (2i, 2i+1), llama.cpp / some MLA checkpoints). They are the same function under
a fixed permutation of the rotated dims (tested).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention-temperature factor: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(dim: int, theta: float, rope_scaling: Optional[dict[str, Any]]
                  ) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [dim/2] float64, cos/sin attention factor) for a rope_scaling dict."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not rope_scaling:
        return base, 1.0
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return base, 1.0
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return base / factor, 1.0
    orig = int(rope_scaling["original_max_position_embeddings"])
    if kind == "llama3":
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        wavelen = 2 * math.pi / base
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, base / factor, base)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(mid, (1 - smooth) * base / factor + smooth * base, scaled), 1.0
    # yarn
    beta_fast = float(rope_scaling.get("beta_fast", 32.0))
    beta_slow = float(rope_scaling.get("beta_slow", 1.0))
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, theta, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, theta, orig)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrap_weight = 1.0 - ramp
    inv = (base / factor) * (1 - extrap_weight) + base * extrap_weight
    mscale, mscale_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if rope_scaling.get("attention_factor") is not None:
        attn = float(rope_scaling["attention_factor"])
    elif mscale is not None and mscale_all is not None:
        attn = yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all))
    else:
        attn = yarn_get_mscale(factor)
    return inv, attn


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation RoPE of x [T, H, d] (float32) with the full-width signed tables of
    `RotaryEmbedding.cos_sin`: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), float32 out."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of x [T, H, d] (float32) in either layout, with the tables of `RotaryEmbedding.cos_sin`
    (interleaved: half-width [T, 1, d/2]; halves: the full-width signed ones); float32 out."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return rope_halves(x, cos, sin)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to [T, H, rot_dim] tensors at absolute positions [T]."""

    def __init__(self, rot_dim: int, theta: float, max_positions: int,
                 rope_scaling: Optional[dict[str, Any]] = None, interleaved: bool = False):
        super().__init__()
        if rot_dim % 2:
            raise ValueError(f"rotary dim must be even, got {rot_dim}")
        inv, self.attention_factor = rope_inv_freq(rot_dim, theta, rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv)                                   # [maxpos, d/2]
        # Plain attributes, not buffers: `model.to(bfloat16)` must not round the tables.
        cos, sin = (freqs.cos() * self.attention_factor).float(), (freqs.sin() * self.attention_factor).float()
        if interleaved:    # pairs (x[2i], x[2i+1]): half-width tables
            self._cos, self._sin = cos, sin
        else:              # halves: full-width tables, x * [cos|cos] + [x2|x1] * [-sin|sin]
            self._cos, self._sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        self.rot_dim = rot_dim
        self.interleaved = interleaved
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) float32, gathered once per forward: [T, 1, rot_dim/2]
        (interleaved) or the full-width signed tables [T, 1, rot_dim] (halves)."""
        cos, sin = self.tables(positions.device)
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables on `device` (moved there once), float32: [max_positions,
        rot_dim/2] (interleaved) or the full-width signed [max_positions, rot_dim] (halves). Row p is
        what `cos_sin` gathers for position p."""
        if self._cos.device != device:
            self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, rot_dim]; positions: [T] int -> rotated x (same dtype)."""
        return self.apply(x, *self.cos_sin(positions))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, rot_dim] with (cos, sin) from `cos_sin` -> rotated x (same dtype).

        Several tensors sharing positions (q and k) can go through one call stacked on H.
        """
        return rope_rotate(x.float(), cos, sin, self.interleaved).to(x.dtype)
