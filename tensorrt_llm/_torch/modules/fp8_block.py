"""UE8M0 FP8 block quantization and the FP8 (e4m3) block-scaled linear layer (reference path).

UE8M0 scales are powers of two stored as their biased exponent byte (value = 2^(byte - 127)),
as DeepSeek-V3 / DeepGEMM use them on Hopper and Blackwell. A block's scale is its amax / 448
(the e4m3 maximum) rounded UP to a power of two (the PTX `cvt.rp` semantics), so every quantized
value lies in [-448, 448] and no value saturates::

    s = 2^ceil(log2(amax / 448))       byte = log2(s) + 127, clamped to [0, 254] (255 is NaN)
    q = e4m3(x / s)                    round to nearest even; x / s is exact (s a power of two)
    x ~= q * s

`ceil(log2(v))` is taken from frexp (v = m * 2^e, m in [0.5, 1): the exponent is e - 1 when
m == 0.5, i.e. v is a power of two, else e), so it is exact for every float32 v; amax = 0 gives
the scale 1.

`FP8BlockLinear`: weights in 128 x 128 blocks, activations in 1 x 128 groups per token (the
DeepSeek recipe), both UE8M0; this module computes the product from the dequantized operands in
float32, on any device (the numerics of the fp8 GEMM; the fast GEMM is a kernel's job).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_backend.cpp_ops import ops_loaded

_OP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E4M3_MAX = 448.0
UE8M0_BIAS = 127
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class FP8BlockQuantConfig:
    """`quant_config` of a checkpoint's config.json (DeepSeek-V3's keys)."""

    weight_block_size: tuple[int, int] = (128, 128)
    activation_group_size: int = 128

    KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str) -> "FP8BlockQuantConfig":
        """{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic", "scale_fmt": "ue8m0"} (only quant_method is required)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: quant_config must be a mapping, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown quant_config keys {unknown}; known: {list(cls.KEYS)}")
        want = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
        if "quant_method" not in cfg:
            raise ValueError(f"{source}: quant_config needs 'quant_method': 'fp8'")
        for key, value in want.items():
            if key in cfg and cfg[key] != value:
                raise ValueError(f"{source}: quant_config {key!r} must be {value!r}, got {cfg[key]!r}")
        block = cfg.get("weight_block_size", [128, 128])
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{source}: quant_config 'weight_block_size' must be [rows, cols] of ints > 0, "
                             f"got {block!r}")
        return cls(weight_block_size=(block[0], block[1]))


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """amax (>= 0, any shape) -> the UE8M0 scale byte (uint8) of a block with that amax."""
    v = amax.float() / E4M3_MAX
    m, e = torch.frexp(v)
    exp = torch.where(m == 0.5, e - 1, e)
    exp = torch.where(v > 0, exp, torch.zeros_like(exp))
    return (exp + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)


def ue8m0_scale(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> their float32 scales 2^(byte - 127) (exact)."""
    return torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte.to(torch.int32) - UE8M0_BIAS)


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [M, K] -> [ceil(M/rows), rows, ceil(K/cols), cols] float32, zero padded."""
    m, k = x.shape
    pm, pk = -(-m // rows) * rows, -(-k // cols) * cols
    xp = F.pad(x.float(), (0, pk - k, 0, pm - m))
    return xp.view(pm // rows, rows, pk // cols, cols)


def quantize_blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale bytes [ceil(M/rows), ceil(K/cols)] uint8), one UE8M0
    scale per rows x cols block (1 x 128: per-token groups; 128 x 128: weight tiles). Per-token groups
    run the C++ op `trtllm::dspark_quantize_ue8m0` where it is built (bit for bit this reference)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks needs a 2-D tensor, got shape {tuple(x.shape)}")
    if rows == 1 and 1 <= cols <= 1024 and x.dtype in _OP_DTYPES and x.stride(-1) == 1 and ops_loaded():
        return torch.ops.trtllm.dspark_quantize_ue8m0(x, cols)
    return quantize_blocks_reference(x, rows, cols)


def quantize_blocks_reference(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blocks` in torch ops (x 2-D)."""
    b = _blocks(x, rows, cols)
    byte = ue8m0_exponent(b.abs().amax(dim=(1, 3)))                       # [Mb, Kb]
    s = ue8m0_scale(byte)[:, None, :, None]
    q = (b / s).to(FP8_DTYPE)
    m, k = x.shape
    return q.view(b.shape[0] * rows, b.shape[2] * cols)[:m, :k].contiguous(), byte


def dequantize_blocks(q: torch.Tensor, byte: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(q [M, K] fp8, scale bytes [ceil(M/rows), ceil(K/cols)]) -> x [M, K] float32."""
    m, k = q.shape
    if byte.shape != (-(-m // rows), -(-k // cols)):
        raise ValueError(f"scale shape {tuple(byte.shape)} does not tile a [{m}, {k}] tensor in "
                         f"{rows} x {cols} blocks")
    s = ue8m0_scale(byte).repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]
    return q.float() * s


class FP8BlockLinear(nn.Module):
    """y = x W^T (+ b) with W in UE8M0-scaled e4m3 blocks and x quantized per token in 1 x G groups."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: FP8BlockQuantConfig):
        super().__init__()
        rows, cols = cfg.weight_block_size
        q, byte = quantize_blocks(weight.detach(), rows, cols)
        self.register_buffer("weight", q)                 # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", byte)        # [N / rows, K / cols] uint8 (UE8M0)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.block, self.group = (rows, cols), cfg.activation_group_size
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: FP8BlockQuantConfig) -> "FP8BlockLinear":
        return cls(linear.weight, linear.bias, cfg)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale, *self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_blocks(x2, 1, self.group)
        y = dequantize_blocks(xq, xs, 1, self.group) @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
