"""The CuTe DSL norm + RoPE kernel on the GPU (H200, sm90; nvidia-cutlass-dsl importable there) against its
torch reference (`norm_rope_reference`, itself checked row by row on the CPU in `test_cute_norm_rope.py`).

Shapes: GQA query / key heads (64 wide, normed and rotated whole, rows read in place from a q|k|v buffer),
MLA latent rows (576 = 512 normed latent + 64 raw-then-rotated rope tail; one norm weight per layer for the
context rows of every layer), MLA query rope parts (64 wide, no norm, written at column 512 of the [T, H, 576]
query), with and without a weight, apply_rmsnorm False, strided input and output rows, at 1 and 64 tokens.
Tolerance (bf16 / fp16 outputs): |got - ref| <= 2^-7 (|ref| + max |ref|), i.e. within one rounding step of
the value (the kernel's rsqrt.approx and summation order can move a value across a rounding boundary, before
or after the rotation), and >= 99% of the elements bitwise equal; float32 within 1e-5 relative. Negative
controls (a norm_dim one short, the output one column off) land beyond 0.1 max |ref|. The kernel captured
in a CUDA graph replays new inputs; a new token count reuses the compiled kernel.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.attention_backend.cute_norm_rope import norm_rope, norm_rope_reference
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _tables(t_n: int, rope_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 8000, (t_n,), generator=gen)
    cos, sin = RotaryEmbedding(rope_dim, 10000.0, 8192).cos_sin(positions)
    return cos[:, 0].to(DEV), sin[:, 0].to(DEV)


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    g, r = got.float(), ref.float()
    if ref.dtype == torch.float32:
        assert float((g - r).abs().max()) <= 1e-5 * float(r.abs().max())
        return
    bound = 2.0 ** -7 * (r.abs() + r.abs().max())
    assert bool(((g - r).abs() <= bound).all()), float(((g - r).abs() - bound).max())
    assert float((got == ref).float().mean()) >= 0.99


def _far(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert float((got.float() - ref.float()).abs().max()) > 0.1 * float(ref.float().abs().max())


# name: (heads, width, norm_dim, rope_dim, apply_rmsnorm, weight: None | "shared" | "per_head",
#        input heads in the buffer (strided rows), output width, out_offset)
CASES = {
    "gqa_q_heads": (16, 64, 64, 64, True, "shared", 48, 64, 0),
    "gqa_k_heads_no_weight": (16, 64, 64, 64, True, None, 48, 64, 0),
    "mla_latent": (1, 576, 512, 64, True, "shared", 1, 576, 0),
    "mla_context_all_layers": (5, 576, 512, 64, True, "per_head", 5, 576, 0),
    "mla_q_rope_at_512": (16, 64, 0, 64, False, None, 32, 576, 512),
    "strided_out_rows": (4, 576, 512, 64, True, "shared", 6, 600, 17),
}


def _make(case: str, t_n: int, dtype: torch.dtype, seed: int = 0):
    heads, width, norm_dim, rope_dim, apply, wkind, buf_heads, out_w, off = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(t_n, buf_heads, width, generator=gen) * 4).to(DEV, dtype)   # rms 4: a skipped norm shows
    x = buf[:, buf_heads - heads:]                                                # rows read in place
    w = None if wkind is None else (1 + 0.5 * torch.randn((norm_dim,) if wkind == "shared" else (heads, norm_dim),
                                                          generator=gen)).to(DEV, dtype)
    cos, sin = _tables(t_n, rope_dim, gen)
    out = torch.full((t_n, heads, out_w), 3.0, device=DEV, dtype=dtype)
    return x, cos, sin, w, out, dict(norm_dim=norm_dim, apply_rmsnorm=apply, out_offset=off)


@pytest.mark.parametrize("t_n", [1, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_reference_bf16(case, t_n):
    x, cos, sin, w, out, kw = _make(case, t_n, torch.bfloat16)
    norm_rope(x, cos, sin, out, weight=w, eps=1e-6, **kw)
    off, width = kw["out_offset"], x.shape[2]
    ref = norm_rope_reference(x, cos, sin, kw["norm_dim"], w, 1e-6, kw["apply_rmsnorm"])
    _check(out[..., off:off + width], ref)
    untouched = torch.cat((out[..., :off], out[..., off + width:]), dim=-1)
    assert bool((untouched == 3.0).all())                # nothing written outside the row's columns


def test_a_parameter_weight_and_inputs_that_require_grad():
    """A layer's norm weight is an nn.Parameter (requires grad), which DLPack refuses to export: the
    kernel takes it (and inputs that require grad) as they come."""
    x, cos, sin, w, out, kw = _make("mla_latent", 8, torch.bfloat16, seed=2)
    w = torch.nn.Parameter(w)
    x = x.detach().clone().requires_grad_(True)
    with torch.no_grad():
        norm_rope(x, cos, sin, out, weight=w, eps=1e-6, **kw)
    _check(out, norm_rope_reference(x.detach(), cos, sin, kw["norm_dim"], w.detach(), 1e-6, kw["apply_rmsnorm"]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["gqa_q_heads", "mla_context_all_layers"])
def test_kernel_equals_reference_other_dtypes(case, dtype):
    x, cos, sin, w, out, kw = _make(case, 64, dtype, seed=1)
    norm_rope(x, cos, sin, out, weight=w, eps=1e-6, **kw)
    _check(out, norm_rope_reference(x, cos, sin, kw["norm_dim"], w, 1e-6, kw["apply_rmsnorm"]))


@pytest.mark.parametrize("case", ["gqa_q_heads", "mla_latent", "mla_context_all_layers"])
def test_negative_control_wrong_norm_dim(case):
    x, cos, sin, w, out, kw = _make(case, 64, torch.bfloat16, seed=2)
    nd = kw.pop("norm_dim")
    norm_rope(x, cos, sin, out, norm_dim=nd - 1, weight=None if w is None else w[..., :-1].contiguous(), **kw)
    _far(out, norm_rope_reference(x, cos, sin, nd, w, 1e-6, True))


@pytest.mark.parametrize("case", ["mla_q_rope_at_512", "strided_out_rows"])
def test_negative_control_off_by_one_offset(case):
    x, cos, sin, w, out, kw = _make(case, 64, torch.bfloat16, seed=3)
    off, width = kw["out_offset"], x.shape[2]
    norm_rope(x, cos, sin, out, weight=w, **{**kw, "out_offset": off - 1})
    _far(out[..., off:off + width], norm_rope_reference(x, cos, sin, kw["norm_dim"], w, 1e-6, kw["apply_rmsnorm"]))


def test_captured_in_a_cuda_graph_and_compiled_once_per_signature():
    from tensorrt_llm._torch.attention_backend.cute_norm_rope_kernel import compiled_norm_rope
    x, cos, sin, w, out, kw = _make("mla_latent", 64, torch.bfloat16, seed=4)
    norm_rope(x[:1], cos[:1], sin[:1], out[:1], weight=w, **kw)           # compiled here (1 token)
    misses = compiled_norm_rope.cache_info().misses
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        norm_rope(x, cos, sin, out, weight=w, **kw)                        # 64 tokens: the same kernel
    torch.cuda.current_stream().wait_stream(side)
    assert compiled_norm_rope.cache_info().misses == misses
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm_rope(x, cos, sin, out, weight=w, **kw)
    x2, cos2, sin2, _, _, _ = _make("mla_latent", 64, torch.bfloat16, seed=5)
    x.copy_(x2)
    cos.copy_(cos2)
    sin.copy_(sin2)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, norm_rope_reference(x, cos, sin, kw["norm_dim"], w, 1e-6, True))
