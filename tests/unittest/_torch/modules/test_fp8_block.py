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


def _quant_inputs(dev: str) -> list[torch.Tensor]:
    """Rows with amax exactly 448 * 2^k (k = 1, 8, 40), just above (rounded up), 1e3, zero, and a
    random block of wide dynamic range; K = 260 (the last group short)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 260, generator=g) * torch.logspace(-4, 4, 260)
    specials = []
    for k in (1, 8, 40):
        a = torch.tensor(E4M3_MAX * 2.0 ** k)
        specials += [a, torch.nextafter(a, torch.tensor(float("inf")))]
    specials.append(torch.tensor(1e3))
    for i, a in enumerate(specials):
        x[i, :128] = torch.randn(128, generator=g).clamp(-1, 1) * a / 2
        x[i, 7] = -a                                                   # the group's amax, negative
    x[len(specials), :] = 0.0
    return [x.to(dev, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]


def _check_op_equals_reference(ops, dev: str) -> None:
    from tensorrt_llm._torch.modules.fp8_block import quantize_blocks_reference
    for x in _quant_inputs(dev):
        q, s = ops.dspark_quantize_ue8m0(x, 128)
        rq, rs = quantize_blocks_reference(x, 1, 128)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (12, 3)
        assert torch.equal(s, rs), (x.dtype, (s != rs).nonzero()[:4].tolist())
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), x.dtype
        if x.dtype == torch.float32:      # the boundaries: 448 * 2^k keeps k, one ulp above rounds up
            assert s[:7, 0].tolist() == [128, 129, 135, 136, 167, 168, 129]
            assert s[7].tolist() == [127, 127, 127]                    # amax 0 -> scale 1


def test_cpp_quantize_equals_the_reference_bitwise(dspark_ops):
    """trtllm::dspark_quantize_ue8m0 (the C++ CPU kernel) == the torch reference, scale bytes and fp8
    bits, for float32 / bf16 / fp16 input; and `quantize_blocks` takes it for per-token groups.
    Negative control: a reference with scales rounded to nearest disagrees at the boundaries."""
    _check_op_equals_reference(dspark_ops, "cpu")
    x = _quant_inputs("cpu")[0]
    near = torch.round(torch.log2(x[:7, :128].abs().amax(1) / E4M3_MAX)) + 127
    q, s = dspark_ops.dspark_quantize_ue8m0(x, 128)
    assert near.tolist() != s[:7, 0].tolist()
    got_q, got_s = quantize_blocks(x, 1, 128)
    assert torch.equal(got_s, s) and torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
    for bad, msg in ((x[0], "must be [M, K], got 1-D"), (x.int(), "dtype must be one of (BFloat16, Half, Float), got Int"),
                     (x.t(), "must have a contiguous last dimension")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            dspark_ops.dspark_quantize_ue8m0(bad, 128)
    with pytest.raises(ValueError, match=r"group must be in \[1, 1024\], got 0"):
        dspark_ops.dspark_quantize_ue8m0(x, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_quantize_equals_the_reference_bitwise(dspark_ops):
    _check_op_equals_reference(dspark_ops, "cuda")
