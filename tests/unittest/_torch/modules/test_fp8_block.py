"""UE8M0 FP8 block quantization (the torch reference) and FP8BlockLinear.

Scale bytes are checked bit for bit at the boundaries the seed names (amax = 448 * 2^k for k = 1,
8, 40, and 1e3), just above them (rounded up, never down), at 0 and at the byte range's ends.
Round trips and the linear layer have tolerances with negative controls (a scale one exponent
off) far outside them; quantized values never saturate.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.fp8_block import (E4M3_MAX, FP8BlockLinear, FP8BlockQuantConfig, dequantize_blocks,
                                                   quantize_blocks, ue8m0_exponent, ue8m0_scale)


@pytest.mark.parametrize("k", [1, 8, 40])
def test_ue8m0_exact_powers_keep_their_exponent(k):
    amax = torch.tensor([E4M3_MAX * 2.0 ** k], dtype=torch.float32)
    assert ue8m0_exponent(amax).item() == 127 + k
    above = torch.nextafter(amax, torch.tensor([float("inf")]))
    assert ue8m0_exponent(above).item() == 128 + k            # rounded up, not to nearest
    below = torch.nextafter(amax, torch.tensor([0.0]))
    assert ue8m0_exponent(below).item() == 127 + k


def test_ue8m0_other_boundaries():
    byte = ue8m0_exponent(torch.tensor([1e3, 0.0, 448.0, 1.0, 448.0 * 2.0 ** -130, 3e38]))
    assert byte.dtype == torch.uint8
    # 1e3/448 = 2.23 -> 4; 1/448 -> 2^-8; 2^-130 clamps to byte 0; 3e38/448 = 6.7e35 -> 2^120
    assert byte.tolist() == [129, 127, 127, 119, 0, 247]
    assert ue8m0_scale(torch.tensor([129, 127, 0], dtype=torch.uint8)).tolist() == [4.0, 1.0, 2.0 ** -127]


def test_quantize_round_trip_never_saturates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 260, generator=g) * torch.logspace(-3, 3, 260)      # columns of very different size
    for rows, cols in ((1, 128), (128, 128)):
        q, byte = quantize_blocks(x, rows, cols)
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
        assert byte.shape == (-(-300 // rows), 3)
        assert torch.isfinite(q.float()).all() and q.float().abs().max() <= E4M3_MAX
        back = dequantize_blocks(q, byte, rows, cols)
        err = ((back - x).norm() / x.norm()).item()
        assert err < 0.04, (rows, cols, err)
        off = dequantize_blocks(q, byte + 1, rows, cols)                      # negative control: x2
        assert ((off - x).norm() / x.norm()).item() > 0.5
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_blocks(q, byte[:, :2], 128, 128)


def test_fp8_block_linear_matches_float_linear():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(384, 200, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 384, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(200, generator=g))
    fp8 = FP8BlockLinear.from_linear(lin, FP8BlockQuantConfig())
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (2, 3)
    x = torch.randn(7, 5, 384, generator=g)
    want = lin(x)
    got = fp8(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert ((got - want).norm() / want.norm()).item() < 0.05
    fp8.weight_scale += 1                                                     # negative control
    assert ((fp8(x) - want).norm() / want.norm()).item() > 0.5


def test_quant_config_validation():
    ok = FP8BlockQuantConfig.from_dict({"quant_method": "fp8", "weight_block_size": [128, 64],
                                        "scale_fmt": "ue8m0"}, "cfg")
    assert ok.weight_block_size == (128, 64)
    for bad, msg in (({"quant_method": "fp8", "bits": 8}, "unknown quant_config keys"),
                     ({"fmt": "e4m3"}, "needs 'quant_method'"),
                     ({"quant_method": "int8"}, "'quant_method' must be 'fp8'"),
                     ({"quant_method": "fp8", "scale_fmt": "fp32"}, "'scale_fmt' must be 'ue8m0'"),
                     ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size")):
        with pytest.raises(ValueError, match=msg):
            FP8BlockQuantConfig.from_dict(bad, "cfg")
