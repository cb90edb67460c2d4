"""RotaryEmbedding: interleaved vs half-rotation layouts, YaRN frequencies and mscale.

The YaRN reference below is written out from the YaRN paper / DeepSeek-V2 reference code
with plain Python floats, independently of rotary_embedding.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding, rope_inv_freq, yarn_get_mscale

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}


def half_to_interleaved_perm(d: int) -> torch.Tensor:
    """Index map: interleaved[2i] = half[i], interleaved[2i+1] = half[i + d/2]."""
    return torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=1).flatten()


def ref_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 1.0 + 0.1 * m * math.log(scale)


def ref_yarn_inv_freq(dim: int, base: float, factor: float, orig: int, beta_fast: float,
                      beta_slow: float) -> list[float]:
    """Per-dimension-pair YaRN frequency: extrapolate above `high` wavelengths, interpolate below."""
    def dims_for_rotations(n_rot: float) -> float:
        # the pair index whose wavelength fits n_rot times into the original context
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(dims_for_rotations(beta_fast)), 0)
    hi = min(math.ceil(dims_for_rotations(beta_slow)), dim - 1)
    span = (hi - lo) if hi != lo else 0.001
    out = []
    for i in range(dim // 2):
        theta_i = base ** (-2.0 * i / dim)
        interp = min(max((i - lo) / span, 0.0), 1.0)          # 0: keep theta_i, 1: theta_i / factor
        out.append(theta_i * (1.0 - interp) + (theta_i / factor) * interp)
    return out


def ref_rope_half(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, amp: float) -> torch.Tensor:
    """x [T, H, D] float64 reference rotation, pairs (i, i + D/2), cos/sin scaled by amp."""
    ang = pos.double()[:, None] * inv.double()[None, :]
    cos, sin = (ang.cos() * amp)[:, None], (ang.sin() * amp)[:, None]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].double(), x[..., h:].double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_yarn_get_mscale_formula():
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(1.3688879454113936, rel=1e-12)
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(1 + 0.0707 * math.log(40.0), rel=1e-12)
    assert yarn_get_mscale(1.0, 3.0) == 1.0 and yarn_get_mscale(0.5, 3.0) == 1.0
    # control: the unscaled value is far from the YaRN one
    assert abs(yarn_get_mscale(40.0, 1.0) - 1.0) > 0.3


@pytest.mark.parametrize("dim", [8, 64])
def test_yarn_inv_freq_and_attention_factor(dim):
    c = YARN
    inv, amp = rope_inv_freq(dim, 10000.0, c)
    ref = torch.tensor(ref_yarn_inv_freq(dim, 10000.0, c["factor"], c["original_max_position_embeddings"],
                                         c["beta_fast"], c["beta_slow"]), dtype=torch.float64)
    torch.testing.assert_close(inv, ref, rtol=1e-12, atol=0)
    want_amp = ref_mscale(c["factor"], c["mscale"]) / ref_mscale(c["factor"], c["mscale_all_dim"])
    assert amp == pytest.approx(want_amp, rel=1e-12)
    # control: plain RoPE frequencies differ from YaRN's somewhere by a lot (the low-freq end)
    plain = torch.tensor([10000.0 ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    assert float(((inv - plain).abs() / plain).max()) > 0.5


def test_yarn_rotation_matches_reference():
    g = torch.Generator().manual_seed(11)
    dim = 16
    rot = RotaryEmbedding(dim, 10000.0, 512, YARN)
    x = torch.randn(20, 3, dim, generator=g)
    pos = torch.randint(0, 512, (20,), generator=g)
    ref_inv = torch.tensor(ref_yarn_inv_freq(dim, 10000.0, 40.0, 64, 32, 1))
    amp = ref_mscale(40.0, 1.0) / ref_mscale(40.0, 0.5)
    got = rot(x, pos).double()
    want = ref_rope_half(x, pos, ref_inv, amp)
    assert float((got - want).abs().max()) < 1e-4
    # control: no scaling (plain frequencies, amplitude 1)
    plain = ref_rope_half(x, pos, 10000.0 ** (-torch.arange(0, dim, 2).double() / dim), 1.0)
    assert float((got - plain).abs().max()) > 1e-2


@pytest.mark.parametrize("scaling", [None, YARN])
def test_interleaved_equals_half_under_weight_permutation(scaling):
    g = torch.Generator().manual_seed(5)
    t, h, d, hidden = 12, 2, 16, 32
    half = RotaryEmbedding(d, 10000.0, 256, scaling, interleaved=False)
    inter = RotaryEmbedding(d, 10000.0, 256, scaling, interleaved=True)
    perm = half_to_interleaved_perm(d)
    wq = torch.randn(h, d, hidden, generator=g) / hidden ** 0.5       # per-head projection rows
    wk = torch.randn(h, d, hidden, generator=g) / hidden ** 0.5
    x = torch.randn(t, hidden, generator=g)
    pos = torch.randint(0, 256, (t,), generator=g)

    def scores(rope, wq_, wk_):
        q = rope(torch.einsum("hdi,ti->thd", wq_, x), pos)
        k = rope(torch.einsum("hdi,ti->thd", wk_, x), pos)
        return torch.einsum("qhd,khd->hqk", q, k), q

    s_half, q_half = scores(half, wq, wk)
    s_int, q_int = scores(inter, wq[:, perm], wk[:, perm])
    assert float((q_int - q_half[..., perm]).abs().max()) < 1e-5
    assert float((s_int - s_half).abs().max()) < 1e-4
    # control: same weights without the permutation give different attention scores
    s_wrong, _ = scores(inter, wq, wk)
    assert float((s_wrong - s_half).abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_rotation_matches_reference_and_stacks_heads(dtype):
    """The 5-kernel half rotation equals the float64 reference; q and k stacked on H in one call
    equal two separate calls exactly (what the fused attention path does)."""
    d, theta = 64, 10000.0
    rope = RotaryEmbedding(d, theta, 512)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 512, (7,), generator=g)
    q = torch.randn(7, 9, d, generator=g).to(dtype)
    k = torch.randn(7, 3, d, generator=g).to(dtype)
    inv, amp = rope_inv_freq(d, theta, None)
    ref = ref_rope_half(q.double(), pos, inv, amp)
    got = rope(q, pos)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((got.double() - ref).norm() / ref.norm()) < tol
    bad = ref_rope_half(q.double(), pos + 1, inv, amp)            # negative control: positions off by one
    assert float((got.double() - bad).norm() / bad.norm()) > 10 * tol
    cs = rope.cos_sin(pos)
    both = rope.apply(torch.cat((q, k), dim=1), *cs)
    assert torch.equal(both[:, :9], rope.apply(q, *cs)) and torch.equal(both[:, 9:], rope.apply(k, *cs))
