"""`inductor_passes.ResidualMatmulPass`: the compiled layer regions keep their residual adds out of
the GEMMs (no addmm with a full [T, N] input, whose ATen CUDA kernel copies that input first).

CPU: inductor alone folds both residual adds of `layer_output` and `output_then_inputs` into addmm
(the control); with the pass the adds whose sums feed the next RMSNorm are plain mm + add (none left
in `output_then_inputs`; `layer_output` keeps the one that is only its output), and the regions'
updates to the residual stream equal the eager ones within 1e-5 (relative; a perturbed weight lands
beyond 1e-2); a linear's broadcast bias keeps its addmm.
GPU (bf16, 9 tokens): the compiled `output_then_inputs` runs no `Memcpy DtoD` (plain inductor: one
per residual add) and stays within 2e-2 of the eager region.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from tensorrt_llm._torch.modules.compiled_regions import layer_output, output_then_inputs
from tensorrt_llm._torch.modules.inductor_passes import compile_region

H, I, HQ, HKV, D = 64, 128, 4, 2, 16


def _weights(dev: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"o": (H, HQ * D), "norm": (H,), "gu": (2 * I, H), "down": (H, I), "qkv": ((HQ + 2 * HKV) * D, H)}
    return {n: (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(dev, dtype) for n, s in shapes.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _code(fn, *args) -> tuple[torch.Tensor, str]:
    torch._dynamo.reset()
    with torch.inference_mode():
        out, code = run_and_get_code(fn, *args)
    return out, "\n".join(code)


@pytest.mark.parametrize("t", [1, 7])
def test_residual_adds_stay_out_of_the_gemms(t):
    w = _weights(torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(t)
    h, o = torch.randn(t, H, generator=g), torch.randn(t, HQ * D, generator=g)
    ang = torch.randn(t, 1, D // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    out_args = (h, o, w["o"], w["norm"], 1e-6, w["gu"], w["down"])
    args = out_args + (w["norm"], 1e-6, w["qkv"], None, cos, sin, HQ, HKV, D)
    addmm, mm = "extern_kernels.addmm(", "extern_kernels.mm("
    # layer_output: the o_proj sum feeds the RMSNorm (unfused), the down_proj sum is only the output (kept)
    assert _code(torch.compile(layer_output, dynamic=True), *out_args)[1].count(addmm) == 2   # control
    got, code = _code(compile_region(layer_output), *out_args)
    assert code.count(addmm) == 1 and code.count(mm) == 2
    want = layer_output(*out_args)
    assert _rel(got - h, want - h) < 1e-5                             # the layer's update to the residual
    # output_then_inputs: both sums feed an RMSNorm
    assert _code(torch.compile(output_then_inputs, dynamic=True), *args)[1].count(addmm) == 2
    got, code = _code(compile_region(output_then_inputs), *args)
    assert code.count(addmm) == 0 and code.count(mm) == 4
    ref = output_then_inputs(*args)
    assert _rel(got[0] - h, ref[0] - h) < 1e-5 and all(_rel(x, y) < 1e-5 for x, y in zip(got[1:], ref[1:]))
    bad = layer_output(h, o, w["o"] * 1.5, w["norm"], 1e-6, w["gu"], w["down"])
    assert _rel(bad - h, want - h) > 1e-2
    # a bias row is no residual (cuBLASLt adds it in the GEMM's epilogue): its addmm stays, also when
    # the sum feeds more work
    _, biased = _code(compile_region(lambda x, wt, b: F.linear(x, wt, b).softmax(-1)), o, w["o"], w["norm"])
    assert biased.count(addmm) == 1
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_copies_for_residual_adds_on_gpu():
    dev, t = torch.device("cuda"), 9
    w = _weights(dev, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    h, o = (torch.randn(t, n, generator=g).to(dev, torch.bfloat16) for n in (H, HQ * D))
    ang = torch.randn(t, 1, D // 2, generator=g)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dev, torch.bfloat16) for f in (torch.cos, torch.sin))
    args = (h, o, w["o"], w["norm"], 1e-6, w["gu"], w["down"], w["norm"], 1e-6, w["qkv"], None, cos, sin, HQ, HKV, D)

    def device_copies(fn) -> tuple[int, tuple[torch.Tensor, ...]]:
        torch._dynamo.reset()
        with torch.inference_mode():
            fn(*args)                                                # compile outside the profile
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = fn(*args)
                torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.key.startswith("Memcpy DtoD")), out

    plain, _ = device_copies(torch.compile(output_then_inputs, dynamic=True))
    assert plain >= 2                                                # control: addmm copies its residual
    copies, got = device_copies(compile_region(output_then_inputs))
    assert copies == 0
    with torch.inference_mode():
        want = output_then_inputs(*args)
    assert all(_rel(a, b) < 2e-2 for a, b in zip(got, want))
    torch._dynamo.reset()
