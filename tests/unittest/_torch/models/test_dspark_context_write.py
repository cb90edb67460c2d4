"""The drafter's context write for all layers at once (`write_context` over a pool whose layers are one
tensor: `gqa_context_kv` / `mla_context_latents`, `stacked_layers`, `write_slots_layers`) against the
per-layer write (each layer's own region call and write, the path for caches that are separate
tensors). CPU, float32: bitwise equal (the stacked GEMM's columns are the layers' own GEMMs'); the
inductor regions within 1e-4; a weight changed in place after loading is seen; -1 slots are skipped.
Control: a layer's k_norm / kv_a_layernorm weight x3 changes that layer's entries by > 1e-2.
A drafter with `triton_context` (CUDA engines; Triton's interpreter here), GQA or MLA, writes the same
pool in one launch after the stacked GEMM: within 1e-6 in float32 (bf16 within two ulps of the values'
scale), nothing at the -1 slot, the perturbed norm weight seen; its validation names the argument."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import stacked_layers
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.dspark_regions import DrafterRegions
from tensorrt_llm._torch.speculative.dspark_worker import draft_kv_cache_spec

from tests.unittest._torch.models.test_dspark_regions import CPU, P, _drafter, _rel

PAGES = 5
SLOTS = torch.tensor([3, 4, 5, 20, 21, 22, 40, -1, 66])      # one -1: skipped


def _write(d, stacked: bool, compiled: bool = False) -> torch.Tensor:
    """The draft pool [L, pages, planes, H, P, D] after one context write of 9 tokens, from layer
    views of one pool (stacked) or from separate per-layer tensors."""
    spec = draft_kv_cache_spec(d, torch.float32)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(SLOTS.numel(), d.config.fc_in_features, generator=g)
    pos = torch.arange(2, 2 + SLOTS.numel())
    pool = torch.zeros((spec.num_layers,) + spec.layer_shape(PAGES, P))
    caches = list(pool.unbind(0)) if stacked else [torch.zeros(spec.layer_shape(PAGES, P))
                                                   for _ in range(spec.num_layers)]
    assert (stacked_layers(caches) is not None) == stacked
    with torch.inference_mode():
        feats = d.context_features(hidden, compiled=compiled)
        d.write_context(feats, pos, SLOTS, caches, VanillaAttention(), compiled=compiled)
    return pool if stacked else torch.stack(caches)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_one_write_for_all_layers_equals_the_per_layer_write(kind):
    d = _drafter(kind, CPU, torch.float32)
    calls = {"all": 0}
    fn = d.regions.gqa_context_kv if kind == "gqa" else d.regions.mla_context_latents

    def counted(*args):
        calls["all"] += 1
        return fn(*args)
    field = "gqa_context_kv" if kind == "gqa" else "mla_context_latents"
    d.use_regions(dataclasses.replace(d.regions, **{field: counted}))
    want = _write(d, stacked=False)
    assert calls["all"] == 0
    got = _write(d, stacked=True)
    assert calls["all"] == 1                                  # one region call for every layer
    assert torch.equal(got, want) and bool((got != 0).all(dim=-1).any())
    page, off = SLOTS[SLOTS >= 0] // P, SLOTS[SLOTS >= 0] % P
    written = torch.zeros(PAGES, P, dtype=torch.bool)
    written[page, off] = True
    assert not bool(got.permute(1, 4, 0, 2, 3, 5)[~written].any())   # nothing else (the -1 slot) written
    # control: layer 1's norm weight x3 moves layer 1's entries only
    norm = d.layers[1].self_attn.k_norm if kind == "gqa" else d.layers[1].self_attn.kv_a_layernorm
    with torch.no_grad():
        norm.weight.mul_(3.0)
    bad = _write(d, stacked=True)                             # seen although stacked at loading
    assert _rel(bad[1], want[1]) > 1e-2 and torch.equal(bad[0], want[0])
    assert torch.equal(bad, _write(d, stacked=False))


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_inductor_context_write_for_all_layers(kind):
    d = _drafter(kind, CPU, torch.float32)
    want = _write(d, stacked=False)
    d.use_regions(DrafterRegions.inductor())
    assert _rel(_write(d, stacked=True, compiled=True), want) < 1e-4


def test_stacked_layers_only_for_equally_spaced_views():
    pool = torch.zeros(3, 4, 2, 5)
    view = stacked_layers(list(pool.unbind(0)))
    assert view is not None and view.shape == pool.shape and view.data_ptr() == pool.data_ptr()
    assert stacked_layers([pool[0], pool[2]]) is not None                      # a constant step is fine
    assert stacked_layers([pool[0], pool[2], pool[1]]) is None                 # out of order
    assert stacked_layers([torch.zeros(4, 2, 5) for _ in range(3)]) is None    # separate tensors
    assert stacked_layers([pool[0], pool[1, :2]]) is None                      # shapes differ


def _regions_then_triton(kind: str):
    """(drafter, the stacked pool written by its regions, the same written with `triton_context`)."""
    pytest.importorskip("triton")
    d = _drafter(kind, CPU, torch.float32)
    want = _write(d, stacked=True)
    d.use_regions(DrafterRegions.eager(triton_context=True))
    assert d.regions_summary() == "eager (context write: Triton)"
    return d, want, _write(d, stacked=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_context_write_equals_the_regions(dtype):
    d, want, got = _regions_then_triton("gqa")
    assert _rel(got, want) < 1e-6
    assert torch.equal(got == 0, want == 0)                   # the same cells written, the -1 slot not
    if dtype == torch.bfloat16:           # the kernel itself in bf16 against the region in bf16
        from tensorrt_llm._torch.models.dspark_context_kernel import write_gqa_context
        from tensorrt_llm._torch.models.dspark_regions import gqa_context_kv
        from tensorrt_llm._torch.attention_backend.interface import write_slots_layers
        g = torch.Generator().manual_seed(9)
        cw, a = d._context_weights, d.layers[0].self_attn
        feats = torch.randn(SLOTS.numel(), cw.weight.shape[1], generator=g).to(dtype)
        w, b, nw = cw.weight.to(dtype), None if cw.bias is None else cw.bias.to(dtype), cw.norm_weight.to(dtype)
        pos = torch.arange(7, 7 + SLOTS.numel())
        spec = draft_kv_cache_spec(d, dtype)
        ref, out = (torch.zeros((spec.num_layers,) + spec.layer_shape(PAGES, P), dtype=dtype) for _ in range(2))
        cos_t, sin_t = d.rotary.tables(CPU)
        vals = gqa_context_kv(feats, w, b, nw, cw.eps, pos, cos_t, sin_t, False, a.num_kv_heads, a.head_dim)
        write_slots_layers(ref, vals.view(vals.shape[0], vals.shape[1], 2, a.num_kv_heads, a.head_dim), SLOTS)
        write_gqa_context(torch.nn.functional.linear(feats, w, b), nw, cw.eps, pos, cos_t, sin_t, out, SLOTS)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)
    norm = d.layers[1].self_attn.k_norm                       # control: the stacked weight re-read
    with torch.no_grad():
        norm.weight.mul_(3.0)
    bad = _write(d, stacked=True)
    assert _rel(bad[1], want[1]) > 1e-2 and _rel(bad[0], want[0]) < 1e-6


def test_triton_context_write_names_bad_arguments():
    pytest.importorskip("triton")
    from tensorrt_llm._torch.models.dspark_context_kernel import write_gqa_context
    layers, hkv, d_ = 2, 2, 16
    pool = torch.zeros(layers, PAGES, 2, hkv, P, d_)
    kv, nw = torch.zeros(3, layers * 2 * hkv * d_), torch.ones(layers, d_)
    pos, slots, tab = torch.arange(3), torch.tensor([0, 1, -1]), torch.zeros(8, d_)
    ok = dict(kv=kv, norm_weight=nw, eps=1e-5, positions=pos, cos_t=tab, sin_t=tab, pool=pool, slot_mapping=slots)
    write_gqa_context(**ok)
    for change, message in ((dict(pool=pool[:, :, :1]), "pool must be"), (dict(kv=kv[:, :-1]), "kv must be"),
                            (dict(norm_weight=nw[:1]), "norm_weight must be"), (dict(eps=0.0), "eps must be"),
                            (dict(cos_t=tab.double()), "cos_t must be"), (dict(positions=pos.int()), "positions must"),
                            (dict(slot_mapping=slots[:2]), "slot_mapping must be"),
                            (dict(pool=pool.transpose(3, 4)), "pool layers must be contiguous")):
        with pytest.raises(ValueError, match=message):
            write_gqa_context(**{**ok, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_context_write_on_gpu():
    """bf16 on the H200 at the shipped GQA drafter's widths (5 layers, 16 KV heads x 64, pages of 32):
    the kernel's pool equals the region + scatter within two bf16 ulps of the values' scale."""
    from tensorrt_llm._torch.attention_backend.interface import write_slots_layers
    from tensorrt_llm._torch.models.dspark_context_kernel import write_gqa_context
    from tensorrt_llm._torch.models.dspark_regions import gqa_context_kv
    from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding
    dev, dt, layers, hkv, d_, page, t = torch.device("cuda"), torch.bfloat16, 5, 16, 64, 32, 576
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(t, 576, generator=g).to(dev, dt)
    w = (torch.randn(layers * 2 * hkv * d_, 576, generator=g) * 576 ** -0.5).to(dev, dt)
    nw = (1 + 0.3 * torch.randn(layers, d_, generator=g)).to(dev, dt)
    pos = torch.randint(0, 4000, (t,), generator=g).to(dev)
    slots = torch.randperm(64 * page, generator=g)[:t].to(dev)
    slots[5] = -1
    cos_t, sin_t = RotaryEmbedding(d_, 10000.0, 4096).tables(dev)
    ref, out = (torch.zeros(layers, 64, 2, hkv, page, d_, dtype=dt, device=dev) for _ in range(2))
    vals = gqa_context_kv(feats, w, None, nw, 1e-5, pos, cos_t, sin_t, False, hkv, d_)
    write_slots_layers(ref, vals.view(t, layers, 2, hkv, d_), slots)
    write_gqa_context(torch.nn.functional.linear(feats, w), nw, 1e-5, pos, cos_t, sin_t, out, slots)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)
    wrong = nw.clone()
    wrong[2] *= 3                                      # control: another norm weight for layer 2
    bad = torch.zeros_like(out)
    write_gqa_context(torch.nn.functional.linear(feats, w), wrong, 1e-5, pos, cos_t, sin_t, bad, slots)
    assert (bad[2].float() - ref[2].float()).abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_context_write_past_2_31_pool_elements():
    """The engine's stacked draft pool (5 layers x 8,192 pages x 2 x 16 heads x 32 x 64: 5.4e9
    elements) written in its last layer's last page: offsets are int64 (an int32 layer * layer
    stride wraps past 2**31 and writes outside the pool)."""
    from tensorrt_llm._torch.models.dspark_context_kernel import write_gqa_context
    from tensorrt_llm._torch.models.dspark_regions import gqa_context_kv
    from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding
    dev, dt, layers, hkv, d_, page, pages, t = torch.device("cuda"), torch.bfloat16, 5, 16, 64, 32, 8192, 8
    pool = torch.zeros(layers, pages, 2, hkv, page, d_, dtype=dt, device=dev)
    assert pool.numel() > 2 ** 31
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(t, 576, generator=g).to(dev, dt)
    w = (torch.randn(layers * 2 * hkv * d_, 576, generator=g) * 576 ** -0.5).to(dev, dt)
    nw = torch.ones(layers, d_, dtype=dt, device=dev)
    pos = torch.arange(t, device=dev) + 100
    slots = (pages - 1) * page + torch.arange(t, device=dev)
    cos_t, sin_t = RotaryEmbedding(d_, 10000.0, 4096).tables(dev)
    vals = gqa_context_kv(feats, w, None, nw, 1e-5, pos, cos_t, sin_t, False, hkv, d_).view(t, layers, 2, hkv, d_)
    write_gqa_context(torch.nn.functional.linear(feats, w), nw, 1e-5, pos, cos_t, sin_t, pool, slots)
    torch.cuda.synchronize()
    got = pool[:, pages - 1, :, :, :t].permute(3, 0, 1, 2, 4)          # [t, layers, 2, hkv, d]
    torch.testing.assert_close(got.float(), vals.float(), rtol=2 ** -6, atol=2 ** -6)
    assert torch.count_nonzero(pool[:, :pages - 1]).item() == 0   # nothing landed outside the last page
    assert (got[:, 4].float() - vals[:, 3].float()).abs().max() > 0.1          # control: layers differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_context_write_equals_the_regions(dtype):
    """An MLA drafter with `triton_context`: the latents of every layer in one launch after the stacked
    kv_a GEMM equal the regions' write (float32 within 1e-6, nothing at the -1 slot; the kernel in bf16
    against `mla_context_latents` in bf16 within two ulps of the values' scale). Control: layer 1's
    kv_a_layernorm weight x3 moves layer 1's latents only."""
    d, want, got = _regions_then_triton("mla")
    assert _rel(got, want) < 1e-6 and torch.equal(got == 0, want == 0)
    if dtype == torch.bfloat16:
        from tensorrt_llm._torch.attention_backend.interface import write_slots_layers
        from tensorrt_llm._torch.models.dspark_context_kernel import write_mla_context
        from tensorrt_llm._torch.models.dspark_regions import mla_context_latents
        g = torch.Generator().manual_seed(9)
        cw = d._context_weights
        feats = torch.randn(SLOTS.numel(), cw.weight.shape[1], generator=g).to(dtype)
        w, nw = cw.weight.to(dtype), cw.norm_weight.to(dtype)
        pos = torch.arange(7, 7 + SLOTS.numel())
        spec = draft_kv_cache_spec(d, dtype)
        ref, out = (torch.zeros((spec.num_layers,) + spec.layer_shape(PAGES, P), dtype=dtype) for _ in range(2))
        cos_t, sin_t = d.rotary.tables(CPU)
        lat = mla_context_latents(feats, w, nw, cw.eps, pos, cos_t, sin_t, False, d.config.kv_lora_rank)
        write_slots_layers(ref, lat[:, :, None, None, :], SLOTS)
        write_mla_context(torch.nn.functional.linear(feats, w), nw, cw.eps, pos, cos_t, sin_t, out, SLOTS)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)
    with torch.no_grad():
        d.layers[1].self_attn.kv_a_layernorm.weight.mul_(3.0)
    bad = _write(d, stacked=True)
    assert _rel(bad[1], want[1]) > 1e-2 and _rel(bad[0], want[0]) < 1e-6


def test_triton_mla_context_write_names_bad_arguments():
    pytest.importorskip("triton")
    from tensorrt_llm._torch.models.dspark_context_kernel import write_mla_context
    layers, rank, rope = 2, 16, 8
    pool = torch.zeros(layers, PAGES, 1, 1, P, rank + rope)
    kv, nw = torch.zeros(3, layers * (rank + rope)), torch.ones(layers, rank)
    pos, slots, tab = torch.arange(3), torch.tensor([0, 1, -1]), torch.zeros(8, rope)
    ok = dict(kv=kv, norm_weight=nw, eps=1e-5, positions=pos, cos_t=tab, sin_t=tab, pool=pool, slot_mapping=slots)
    write_mla_context(**ok)
    for change, message in ((dict(pool=pool.expand(layers, PAGES, 2, 1, P, rank + rope)), "pool must be"),
                            (dict(kv=kv[:, :-1]), "kv must be"), (dict(norm_weight=nw[:1]), "norm_weight must be"),
                            (dict(norm_weight=torch.ones(layers, 12)), "kv_lora_rank 12 must be a power of two"),
                            (dict(eps=0.0), "eps must be"), (dict(cos_t=tab[:, :4]), "cos_t must be"),
                            (dict(slot_mapping=slots.int()), "slot_mapping must be"),
                            (dict(pool=pool.transpose(4, 5)), "pool layers must be contiguous")):
        with pytest.raises(ValueError, match=message):
            write_mla_context(**{**ok, **change})
