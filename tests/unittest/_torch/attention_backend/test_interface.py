"""`interface.joint_kv` / `joint_planes`: one cache write covers the K and the V plane when k and v
are the halves of one buffer (what the layer regions produce), and it writes exactly what two
plane writes do; any other layout is refused (None), so the backends write the planes apart."""
from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.interface import joint_kv, joint_planes, write_kv, write_slots
from tensorrt_llm._torch.modules.compiled_regions import attention_inputs

T, H, D, PAGES, P = 5, 3, 8, 4, 4


def _two_writes(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    cache = torch.zeros(PAGES, 2, H, P, D)
    write_slots(cache[:, 0], k, slots)
    write_slots(cache[:, 1], v, slots)
    return cache


def test_joint_write_equals_two_plane_writes():
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(T, 2 * H, D, generator=g)
    k, v = buf[:, :H], buf[:, H:]
    slots = torch.tensor([0, 5, 6, -1, 13])
    kv = joint_kv(k, v)
    assert kv is not None and kv.shape == (T, 2 * H, D) and torch.equal(kv, buf)
    cache = torch.zeros(PAGES, 2, H, P, D)
    write_slots(joint_planes(cache)[:, 0], kv, slots)
    want = _two_writes(k, v, slots)
    assert torch.equal(cache, want) and want.abs().sum() > 0
    # control: the planes swapped is a different cache
    assert not torch.equal(_two_writes(v, k, slots), want)


def test_other_layouts_are_refused():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    assert joint_kv(k, v) is None                                   # two allocations
    buf = torch.randn(T, 2 * H, D, generator=g)
    assert joint_kv(buf[:, H:], buf[:, :H]) is None                 # v before k
    wide = torch.randn(T, 3 * H, D, generator=g)
    assert joint_kv(wide[:, :H], wide[:, 2 * H:]) is None           # a gap between them
    assert joint_kv(buf[:, :H - 1], buf[:, H:2 * H - 1]) is None    # shapes of H - 1 heads: not adjacent


def test_layer_regions_give_one_qkv_buffer():
    """The target's attention_inputs returns q, k and v as the views of one [T, Hq + 2 Hkv, D] buffer:
    k and v its adjacent halves (`joint_kv`), q ahead of them with the buffer's token stride."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, hidden = 4, 2, 8, 16
    h = torch.randn(T, hidden, generator=g)
    qkv_w = torch.randn((hq + 2 * hkv) * d, hidden, generator=g)
    cos, sin = torch.ones(T, 1, d), torch.zeros(T, 1, d)
    q, k, v = attention_inputs(h, torch.ones(hidden), 1e-6, qkv_w, None, cos, sin, hq, hkv, d)
    assert joint_kv(k, v) is not None
    assert q.stride() == k.stride() == ((hq + 2 * hkv) * d, d, 1) and not q.is_contiguous()
    assert k.data_ptr() == q.data_ptr() + hq * d * q.element_size()
    ref = torch.nn.functional.linear(torch.nn.functional.rms_norm(h, (hidden,), torch.ones(hidden), 1e-6), qkv_w)
    assert torch.equal(q.reshape(T, -1), ref[:, :hq * d])                 # cos 1, sin 0: RoPE is the identity
    assert torch.allclose(v.reshape(T, -1), ref[:, (hq + hkv) * d:], atol=1e-5)
    assert not torch.equal(q.reshape(T, -1), ref[:, hq * d:2 * hq * d])   # control: q's columns, not k's


def test_write_kv_one_call_for_joint_halves_two_otherwise():
    """`write_kv` (what every backend's K/V write goes through): one backend write for one buffer's
    halves, one per plane otherwise; both give the two-plane-write cache."""
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 5, 6, -1, 13])
    buf = torch.randn(T, 2 * H, D, generator=g)
    for k, v, calls_wanted in ((buf[:, :H], buf[:, H:], 1), (buf[:, :H].clone(), buf[:, H:].clone(), 2)):
        cache, calls = torch.zeros(PAGES, 2, H, P, D), []

        def write(c: torch.Tensor, plane: int, x: torch.Tensor) -> None:
            calls.append(plane)
            write_slots(c[:, plane], x, slots)
        write_kv(cache, k, v, write)
        assert len(calls) == calls_wanted and torch.equal(cache, _two_writes(k, v, slots))
