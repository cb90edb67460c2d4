"""VANILLA paged attention vs a dense float64 reference on fresh random inputs.

Pages are assigned in a random order, every slot a request does not own (and every slot it
owns but has not filled) holds large garbage, and tables are padded with BAD_PAGE_INDEX, so
reading the wrong page, the sentinel, or an unmasked slot shows up as a large error.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import (BAD_PAGE_INDEX, AttentionMetadata,
                                                             write_slots)
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention

TOL = 1e-5


@dataclass
class Case:
    md: AttentionMetadata
    cache: torch.Tensor                 # [num_pages, planes, Hkv, P, D]
    q: torch.Tensor                     # [T, Hq, D]
    k_new: torch.Tensor                 # [T, Hkv, D]
    v_new: torch.Tensor
    keys: list[torch.Tensor]            # per request [L, Hkv, D] (cached + new)
    values: list[torch.Tensor]
    pages: list[list[int]]


def make_case(seed: int, cached: list[int], new: list[int], causal: bool, p: int = 4, hq: int = 4,
              hkv: int = 2, d: int = 8, num_pages: int = 24, planes: int = 2,
              sliding_window: int | None = None) -> Case:
    g = torch.Generator().manual_seed(seed)
    kv_lens = [c + n for c, n in zip(cached, new)]
    free = torch.randperm(num_pages, generator=g).tolist()
    pages = []
    for n in kv_lens:
        pages.append([free.pop() for _ in range(-(-n // p))])
    width = max(len(x) for x in pages) + 1          # always at least one sentinel column
    bt = torch.full((len(cached), width), BAD_PAGE_INDEX, dtype=torch.int32)
    for b, pg in enumerate(pages):
        bt[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
    cache = 100.0 * torch.randn(num_pages, planes, hkv, p, d, generator=g)
    keys = [torch.randn(n, hkv, d, generator=g) for n in kv_lens]
    values = [torch.randn(n, hkv, d, generator=g) for n in kv_lens]
    slots = []
    for b, (c, n) in enumerate(zip(cached, new)):
        for pos in range(c + n):
            slot = pages[b][pos // p] * p + pos % p
            if pos < c:                              # prefix already in the pages
                cache[slot // p, 0, :, slot % p] = keys[b][pos]
                if planes == 2:
                    cache[slot // p, 1, :, slot % p] = values[b][pos]
            else:
                slots.append(slot)
    q = torch.randn(sum(new), hq, d, generator=g)
    k_new = torch.cat([k[c:] for k, c in zip(keys, cached)])
    v_new = torch.cat([v[c:] for v, c in zip(values, cached)])
    md = AttentionMetadata(seq_lens=list(new), num_cached=list(cached), block_tables=bt,
                           slot_mapping=torch.tensor(slots, dtype=torch.long), tokens_per_block=p,
                           causal=causal, sliding_window=sliding_window)
    return Case(md, cache, q, k_new, v_new, keys, values, pages)


def dense_reference(case: Case, scale: float, v_dim: int | None = None) -> torch.Tensor:
    """Per request, explicit float64 softmax(q k^T) v with the documented mask."""
    md, outs, t0 = case.md, [], 0
    for b, (c, n) in enumerate(zip(md.num_cached, md.seq_lens)):
        q = case.q[t0:t0 + n].double()                       # [n, Hq, D]
        k = case.keys[b].double()                            # [L, Hkv, D]
        v = k[..., :v_dim] if v_dim is not None else case.values[b].double()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(c, c + n)[:, None]
        kpos = torch.arange(c + n)[None, :]
        allowed = (kpos <= qpos) if md.causal else torch.ones(n, c + n, dtype=torch.bool)
        if md.sliding_window is not None:
            allowed = allowed & (kpos > qpos - md.sliding_window)
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        t0 += n
    return torch.cat(outs).float()


CASES = {
    "prefill+chunk+decode": ([0, 5, 19], [7, 1, 4]),
    "decode-uniform": ([3, 8, 12, 0], [1, 1, 1, 1]),
    "prefill-uniform": ([0, 4], [6, 6]),
    "one-long": ([13], [9]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_matches_dense(name, causal, seed):
    cached, new = CASES[name]
    case = make_case(seed, cached, new, causal)
    before = case.cache.clone()
    scale = 8 ** -0.5
    out = VanillaAttention().forward(case.q, case.k_new, case.v_new, case.cache, case.md, scale)
    ref = dense_reference(case, scale)
    assert out.shape == ref.shape
    err = float((out - ref).abs().max())
    assert err < TOL, f"max abs error {err:.2e}"
    # new K/V landed exactly in their slots and nowhere else
    sm = case.md.slot_mapping
    p = case.md.tokens_per_block
    written = case.cache[sm // p, :, :, sm % p]              # [T, 2, Hkv, D]
    assert torch.equal(written[:, 0], case.k_new) and torch.equal(written[:, 1], case.v_new)
    untouched = torch.ones(case.cache.shape[0], case.cache.shape[3], dtype=torch.bool)
    untouched[sm // p, sm % p] = False
    assert torch.equal(case.cache.permute(0, 3, 1, 2, 4)[untouched], before.permute(0, 3, 1, 2, 4)[untouched])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("how", ["swap-across-requests", "reverse-within-request"])
def test_negative_control_permuted_block_table(causal, how):
    # kv_lens 11 and 14: the last page of each is partial, so even the non-causal case (which
    # is blind to the order of full pages) reads garbage slots when pages are reordered.
    case = make_case(3, [5, 11], [6, 3], causal)
    scale = 8 ** -0.5
    ref = dense_reference(case, scale)
    bt = case.md.block_tables
    if how == "swap-across-requests":
        bt[0, 0], bt[1, 0] = int(bt[1, 0]), int(bt[0, 0])
    else:
        n = len(case.pages[1])
        bt[1, :n] = bt[1, :n].flip(0)
    out = VanillaAttention().forward(case.q, case.k_new, case.v_new, case.cache, case.md, scale)
    assert float((out - ref).abs().max()) > 0.1


def test_negative_control_causal_flag_matters():
    case = make_case(4, [2], [6], causal=True)
    scale = 8 ** -0.5
    ref = dense_reference(case, scale)
    case.md.causal = False
    out = VanillaAttention().forward(case.q, case.k_new, case.v_new, case.cache, case.md, scale)
    assert float((out - ref).abs().max()) > 0.1


def test_sliding_window_matches_dense():
    case = make_case(5, [10, 0], [3, 9], causal=True, sliding_window=4)
    scale = 8 ** -0.5
    out = VanillaAttention().forward(case.q, case.k_new, case.v_new, case.cache, case.md, scale)
    assert float((out - dense_reference(case, scale)).abs().max()) < TOL


def test_mla_paged_matches_dense():
    """Absorbed MLA: one latent plane, MQA with value = latent[..., :v_dim]."""
    dl, v_dim = 12, 8
    case = make_case(6, [7, 0, 3], [2, 5, 1], causal=True, hq=4, hkv=1, d=dl, planes=1)
    scale = dl ** -0.5
    out = VanillaAttention().forward_mla(case.q, case.k_new[:, 0], case.cache, case.md, scale, v_dim)
    ref = dense_reference(case, scale, v_dim=v_dim)
    assert out.shape == (case.q.shape[0], 4, v_dim)
    assert float((out - ref).abs().max()) < TOL


def test_write_slots_skips_sentinel():
    plane = torch.zeros(3, 1, 4, 2)
    vals = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    write_slots(plane, vals, torch.tensor([5, -1, 0]))
    assert torch.equal(plane[1, 0, 1], vals[0, 0]) and torch.equal(plane[0, 0, 0], vals[2, 0])
    assert int((plane != 0).sum()) == 4


def test_validate_rejects_out_of_range_pages_and_slots():
    def md(bt, sm):
        return AttentionMetadata(seq_lens=[1], num_cached=[0], block_tables=torch.tensor([bt], dtype=torch.int32),
                                 slot_mapping=torch.tensor(sm), tokens_per_block=4)
    md([0, 3, BAD_PAGE_INDEX], [0, 15, -1]).validate(num_pages=4)      # in range + sentinels: fine
    for bt in ([4, BAD_PAGE_INDEX], [0, -2]):
        with pytest.raises(ValueError, match="block table"):
            md(bt, [0]).validate(num_pages=4)
    for sm in ([16], [-5]):
        with pytest.raises(ValueError, match="slot_mapping"):
            md([0], sm).validate(num_pages=4)
