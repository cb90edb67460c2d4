"""The drafter's context write for all layers at once (`write_context` over a pool whose layers are one
tensor: `gqa_context_kv` / `mla_context_latents`, `stacked_layers`, `write_slots_layers`) against the
per-layer write (each layer's own region call and write, the path for caches that are separate
tensors). CPU, float32: bitwise equal (the stacked GEMM's columns are the layers' own GEMMs'); the
inductor regions within 1e-4; a weight changed in place after loading is seen; -1 slots are skipped.
Control: a layer's k_norm / kv_a_layernorm weight x3 changes that layer's entries by > 1e-2."""
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
