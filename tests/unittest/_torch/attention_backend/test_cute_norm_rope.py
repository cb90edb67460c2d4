"""The fused RMSNorm + RoPE prep op on the CPU: its torch reference against a row-by-row computation
(with negative controls), every validation message, and (with nvidia-cutlass-dsl installed) that the
CuTe DSL kernel compiles for sm_90a without a GPU. The kernel's numerics on the H200 are
`test_cute_norm_rope_gpu.py`'s."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tensorrt_llm._torch.attention_backend.cute_norm_rope import (check_norm_rope, cute_dsl_unavailable,
                                                                  dsl_import_error, norm_rope, norm_rope_reference)
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding

THETA = 10000.0


def tables(positions: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's full-width signed tables [T, R] (`RotaryEmbedding.cos_sin`)."""
    cos, sin = RotaryEmbedding(rope_dim, THETA, 4096).cos_sin(positions)
    return cos[:, 0], sin[:, 0]


def rowwise(x: torch.Tensor, positions: torch.Tensor, norm_dim: int, rope_dim: int, weight, eps: float,
            apply_rmsnorm: bool) -> torch.Tensor:
    """Straightforward float32 form, one row and one rotation pair at a time, angles from the positions."""
    t_n, heads, width = x.shape
    out = torch.empty(t_n, heads, width, dtype=torch.float32)
    half, start = rope_dim // 2, width - rope_dim
    for t in range(t_n):
        for h in range(heads):
            row = [float(v) for v in x[t, h]]
            if apply_rmsnorm:
                r = 1.0 / math.sqrt(sum(v * v for v in row[:norm_dim]) / norm_dim + eps)
                w = [1.0] * norm_dim if weight is None else [float(v) for v in (weight if weight.dim() == 1
                                                                                 else weight[h])]
                row = [row[c] * r * w[c] for c in range(norm_dim)] + row[norm_dim:]
            for i in range(half):
                ang = float(positions[t]) * THETA ** (-2.0 * i / rope_dim)
                a, b = row[start + i], row[start + half + i]
                row[start + i] = a * math.cos(ang) - b * math.sin(ang)
                row[start + half + i] = b * math.cos(ang) + a * math.sin(ang)
            out[t, h] = torch.tensor(row)
    return out


# (heads, width, norm_dim, rope_dim, apply_rmsnorm, weight kind): GQA q heads, MLA latent rows (all layers'
# norms per head), MLA query rope part, a partial rope tail inside the normed columns
CASES = [(3, 16, 16, 16, True, "shared"), (2, 24, 16, 8, True, "per_head"), (2, 8, 0, 8, False, "none"),
         (1, 20, 12, 6, True, "none")]


def _inputs(heads, width, norm_dim, rope_dim, kind, t_n=3, seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t_n, heads, width, generator=gen) * scale          # rms far from 1: a skipped norm shows
    positions = torch.randint(0, 4000, (t_n,), generator=gen)
    w = None if kind == "none" else 1 + 0.5 * torch.randn((norm_dim,) if kind == "shared" else (heads, norm_dim),
                                                          generator=gen)
    return x, positions, w


@pytest.mark.parametrize("heads,width,norm_dim,rope_dim,apply,kind", CASES)
def test_reference_equals_rowwise_float32(heads, width, norm_dim, rope_dim, apply, kind):
    x, positions, w = _inputs(heads, width, norm_dim, rope_dim, kind)
    cos, sin = tables(positions, rope_dim)
    got = norm_rope_reference(x, cos, sin, norm_dim, w, 1e-6, apply)
    want = rowwise(x, positions, norm_dim, rope_dim, w, 1e-6, apply)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if apply:   # negative control: one column fewer normalised is far outside the tolerance
        wrong = norm_rope_reference(x, cos, sin, norm_dim - 1, None if w is None else w[..., :-1], 1e-6, apply)
        assert (wrong - want).abs().max() > 1.0


def test_reference_bfloat16_rounds_the_normed_value_then_rotates():
    x, positions, w = _inputs(2, 24, 16, 8, "shared")
    cos, sin = tables(positions, 8)
    got = norm_rope_reference(x.bfloat16(), cos, sin, 16, w.bfloat16(), 1e-6, True)
    want = rowwise(x.bfloat16().float(), positions, 16, 8, w.bfloat16().float(), 1e-6, True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_norm_rope_on_cpu_writes_at_the_offset_only():
    x, positions, _ = _inputs(2, 8, 0, 8, "none")
    cos, sin = tables(positions, 8)
    out = torch.full((3, 2, 12), 7.0)
    assert norm_rope(x, cos, sin, out, norm_dim=0, apply_rmsnorm=False, out_offset=4) is out
    want = rowwise(x, positions, 0, 8, None, 1e-6, False)
    torch.testing.assert_close(out[..., 4:], want, rtol=1e-5, atol=1e-4)
    assert bool((out[..., :4] == 7.0).all())
    shifted = torch.full((3, 2, 12), 7.0)     # negative control: one column off
    norm_rope(x, cos, sin, shifted, norm_dim=0, apply_rmsnorm=False, out_offset=3)
    assert (shifted[..., 4:] - want).abs().max() > 1.0


def test_strided_rows_read_in_place():
    x, positions, w = _inputs(2, 16, 16, 16, "shared")
    buf = torch.randn(3, 5, 16)
    buf[:, 1:3] = x                            # heads 1..2 of a wider q|k|v-like buffer
    cos, sin = tables(positions, 16)
    out = torch.empty(3, 2, 16)
    norm_rope(buf[:, 1:3], cos, sin, out, norm_dim=16, weight=w)
    torch.testing.assert_close(out, norm_rope_reference(x, cos, sin, 16, w, 1e-6, True))


def _valid():
    x = torch.randn(3, 2, 24)
    cos, sin = tables(torch.arange(3), 8)
    return dict(x=x, cos=cos, sin=sin, out=torch.empty(3, 2, 24), norm_dim=16, weight=torch.ones(16), eps=1e-6,
                apply_rmsnorm=True, out_offset=0)


BAD = [
    (dict(x=torch.randn(3, 24)), r"x must be \[T, H, W\], got shape \(3, 24\)"),
    (dict(x=torch.randn(3, 2, 24, dtype=torch.float64)), r"x dtype must be one of .*, got torch.float64"),
    (dict(x=torch.randn(3, 24, 2).transpose(1, 2)), r"x must have contiguous columns \(stride 1\), got strides"),
    (dict(norm_dim=25), r"norm_dim must be in \[0, 24\] \(x's width\), got 25"),
    (dict(norm_dim=-1), r"norm_dim must be in \[0, 24\] \(x's width\), got -1"),
    (dict(norm_dim=0, weight=None), r"norm_dim must be >= 1 with apply_rmsnorm"),
    (dict(eps=0.0), r"eps must be > 0, got 0.0"),
    (dict(cos=torch.ones(3, 8, dtype=torch.float64)), r"cos must be \[3, rope_dim\] float32, got \(3, 8\) "
                                                      r"torch.float64"),
    (dict(sin=torch.ones(2, 8)), r"sin must be \[3, rope_dim\] float32, got \(2, 8\)"),
    (dict(cos=torch.ones(8, 3).t()), r"cos must have contiguous columns \(stride 1\)"),
    (dict(sin=torch.ones(3, 6)), r"sin must have cos's shape \(3, 8\), got \(3, 6\)"),
    (dict(cos=torch.ones(3, 7), sin=torch.ones(3, 7)), r"rope_dim \(cos's width\) must be even and in \[2, 24\], "
                                                       r"got 7"),
    (dict(cos=torch.ones(3, 26), sin=torch.ones(3, 26)), r"rope_dim .* must be even and in \[2, 24\], got 26"),
    (dict(weight=torch.ones(15)), r"weight must be a contiguous \[16\] or \[2, 16\] torch.float32, got \(15,\)"),
    (dict(weight=torch.ones(16, dtype=torch.bfloat16)), r"weight must be .* got \(16,\) torch.bfloat16"),
    (dict(weight=torch.ones(16, 2).t()), r"weight must be .* got \(2, 16\) torch.float32 strides \(1, 2\)"),
    (dict(apply_rmsnorm=False), r"weight given with apply_rmsnorm=False"),
    (dict(out=torch.empty(3, 1, 24)), r"out must be \[3, 2, W_out\], got shape \(3, 1, 24\)"),
    (dict(out=torch.empty(3, 2, 24, dtype=torch.bfloat16)), r"out dtype must be x's \(torch.float32\), got "
                                                            r"torch.bfloat16"),
    (dict(out=torch.empty(3, 24, 2).transpose(1, 2)), r"out must have contiguous columns"),
    (dict(out_offset=1), r"out_offset 1 \+ width 24 overflows out's 24 columns"),
    (dict(out_offset=-1), r"out_offset -1 \+ width 24 overflows out's 24 columns"),
    (dict(out=torch.empty(3, 2, 24, device="meta")), r"must be on one device, got \['cpu', 'meta'\]"),
    ("in_place", r"out's columns out_offset .. out_offset \+ W overlap x"),
    (dict(out=torch.empty(3, 1, 24).expand(3, 2, 24)), r"out's \(token, head\) rows overlap: token / head strides "
                                                       r"\(24, 0\) for 24 written columns"),
    (dict(out=torch.empty(3 * 2 * 24 + 8).as_strided((3, 2, 24), (40, 20, 1))), r"out's \(token, head\) rows "
                                                                               r"overlap"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_validation_messages(change, message):
    args = _valid()
    args.update({"out": args["x"]} if change == "in_place" else change)
    with pytest.raises(ValueError, match=message):
        check_norm_rope(**args)
    with pytest.raises(ValueError, match=message):
        norm_rope(**args)


def test_valid_arguments_pass():
    check_norm_rope(**_valid())
    for out, offset in ((torch.empty(2, 3, 24).transpose(0, 1), 0), (torch.empty(3, 2, 30), 6)):
        check_norm_rope(**{**_valid(), "out": out, "out_offset": offset})     # permuted rows; wider rows


def test_support_predicate_refuses_the_cpu():
    assert cute_dsl_unavailable(torch.device("cpu")) == ("the CuTe DSL norm + RoPE kernel needs a CUDA device "
                                                         "(device is cpu)")


# the drafter's signatures (shipped sizes): GQA q / k heads, MLA latents of 5 layers, MLA query rope parts, with
# their chunk width v (16 bytes of bf16: 8; of float32: 4); then the scalar form (v = 1) of two of them
SIGNATURES = [("bfloat16", 16, 64, 64, 64, True, "shared", 8), ("bfloat16", 5, 576, 512, 64, True, "per_head", 8),
              ("bfloat16", 1, 576, 512, 64, True, "shared", 8), ("bfloat16", 16, 64, 0, 64, False, "none", 8),
              ("float32", 4, 24, 16, 8, True, "none", 4), ("bfloat16", 16, 64, 64, 64, True, "shared", 1),
              ("bfloat16", 5, 576, 512, 64, True, "per_head", 1)]
COMPILE = """
import json, os, sys, torch
from tensorrt_llm._torch.attention_backend.cute_norm_rope_kernel import compiled_norm_rope
for s in json.loads(sys.argv[1]):
    f = compiled_norm_rope(getattr(torch, s[0]), *s[1:])
    ptx = f.artifacts.PTX
    ptx = open(ptx).read() if os.path.exists(ptx) else ptx
    print(type(f).__name__, ptx.count("ld.global.v4"), ptx.count("st.global.v4"))
"""


@pytest.fixture
def sm90a_env(tmp_path):
    """The environment of a CPU compile for Hopper: the DSL's target arch (no GPU to ask), a private cache
    folder (the compiled artifacts) and the PTX kept there."""
    if dsl_import_error():
        pytest.skip(f"nvidia-cutlass-dsl is not installed here ({dsl_import_error()}); the 'cutedsl' extra "
                    "installs it")
    (tmp_path / "ptx").mkdir()
    return {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_CACHE_DIR": str(tmp_path),
            "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path / "ptx")}


def test_kernel_compiles_for_sm90a_without_a_gpu_to_128_bit_accesses(sm90a_env):
    """Every signature compiles for sm90a with the TVM FFI convention; with 16-byte chunks every row load and
    store is a 128-bit access (ld / st.global.v4), and the scalar form (v = 1) has none."""
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(SIGNATURES)], env=sm90a_env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert [r[0] for r in rows] == ["TVMFFIJitCompiledFunctionWithKwargs"] * len(SIGNATURES), run.stdout
    for sig, (_, loads, stores) in zip(SIGNATURES, rows):
        if sig[-1] > 1:
            assert int(loads) > 0 and int(stores) > 0, (sig, loads, stores)
        else:
            assert int(loads) == int(stores) == 0, (sig, loads, stores)


def test_chunk_width_and_lanes_follow_alignment_and_boundaries():
    """v: 16 bytes of elements where every pointer, stride and column boundary allows it, halved otherwise
    (a pointer 2 bytes off, an odd stride, an odd boundary); L: the largest power of two <= 32 dividing the
    chunks and the inner boundaries."""
    if dsl_import_error():
        pytest.skip(f"nvidia-cutlass-dsl is not installed here ({dsl_import_error()})")
    from tensorrt_llm._torch.attention_backend.cute_norm_rope_kernel import lanes_per_row, vector_width
    x = torch.empty(4, 16, 72, dtype=torch.bfloat16)
    tab = torch.empty(4, 64)
    assert vector_width(2, (x[:, :, 8:], tab), (64, 32)) == 8               # 16-byte offset: full width
    assert vector_width(2, (x[:, :, 4:68], tab), (64, 32)) == 4             # 8 bytes off
    assert vector_width(2, (x[:, :, 1:65], tab), (64, 32)) == 1             # 2 bytes off: scalar
    assert vector_width(2, (x[:, :, 8:], tab), (64, 32, 511)) == 1          # an odd column boundary
    assert vector_width(2, (torch.empty(4, 66, dtype=torch.bfloat16)[:, :64], tab), (64,)) == 2  # stride 66
    assert vector_width(4, (torch.empty(4, 64), tab[:, 4:]), (64,)) == 4    # float32: 4 per 16 bytes
    assert vector_width(2, (x, tab[:, 2:]), (64,)) == 2                     # the table 8 bytes off: 2 floats
    assert lanes_per_row(8, (8,)) == 8 and lanes_per_row(72, (64,)) == 8 and lanes_per_row(64, ()) == 32
    assert lanes_per_row(6, (4,)) == 2 and lanes_per_row(576, (511,)) == 1
