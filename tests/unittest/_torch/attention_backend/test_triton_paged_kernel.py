"""Plan-free paged attention (Triton, lengths read on the device) against the VANILLA reference
(`paged_sdpa`, host metadata): GQA causal (verify rows), GQA non-causal (a draft block) and
absorbed MLA, over shuffled pages and uneven lengths; MLA's output through W_UV in one launch
after it. Negative controls: a length off by one page, another request's table row and W_UV with its
heads rolled land far outside the tolerance; bad shapes raise.

Runs on the GPU (bf16; marked `gpu` there) and, without one, in Triton's interpreter on the CPU
(float32); skipped where triton is not installed.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported
pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_paged_kernel import paged_attention  # noqa: E402
from tensorrt_llm._torch.attention_backend.vanilla import paged_sdpa  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# on a GPU every test here is a GPU test (the device procedure selects `-m gpu`); on a CPU they run
# in Triton's interpreter
pytestmark = [pytest.mark.gpu] if DEV.type == "cuda" else []
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
NEG_MIN = 0.1
P = 16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _case(mla: bool, qps: int, lens: list[int], seed: int = 0):
    """A cache with random pages (shuffled ids) and queries for len(lens) requests."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, width = (4, 1, 48) if mla else (6, 2, 32)
    planes = 1 if mla else 2
    widths = [-(-n // P) for n in lens]
    perm = torch.randperm(sum(widths) + 3, generator=g)
    table = torch.full((len(lens), max(widths) + 2), BAD_PAGE_INDEX, dtype=torch.int32)
    o = 0
    for b, w in enumerate(widths):
        table[b, :w] = perm[o:o + w].to(torch.int32)
        o += w
    cache = torch.randn(len(perm), planes, hkv, P, width, generator=g).to(DTYPE)
    q = torch.randn(len(lens) * qps, hq, width, generator=g).to(DTYPE)
    return q.to(DEV), cache.to(DEV), table.to(DEV)


def _reference(q, cache, table, lens, qps, causal, v_dim, mla):
    md = AttentionMetadata(seq_lens=[qps] * len(lens), num_cached=[n - qps for n in lens], block_tables=table,
                           slot_mapping=torch.zeros(0, dtype=torch.long, device=DEV), tokens_per_block=P,
                           causal=causal)
    v = None if mla else cache[:, 1]
    return paged_sdpa(q.float(), cache[:, 0].float(), None if v is None else v.float(), md, 0.3,
                      v_dim=v_dim if mla else None)


@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("mla,causal,qps", [(False, True, 5), (False, False, 8), (True, False, 8), (True, True, 3)])
def test_paged_attention_matches_reference(mla, causal, qps, splits):
    """Also with the KV split over 4 and 16 page ranges (16 > the pages of most requests: empty
    splits merge with weight 0)."""
    lens = [qps + 1, 37, 16, 70]
    q, cache, table = _case(mla, qps, lens)
    v_dim = 32 if mla else cache.shape[-1]
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got = paged_attention(q, cache, table, kv_lens, 0.3, causal, v_dim, mla, num_splits=splits)
    want = _reference(q, cache, table, lens, qps, causal, v_dim, mla)
    assert got.shape == want.shape == (q.shape[0], q.shape[1], v_dim) and got.dtype == q.dtype
    assert rel(got, want) < TOL
    # negative controls: one page less of context; request 1 reading request 3's pages
    short = paged_attention(q, cache, table, kv_lens - P, 0.3, causal, v_dim, mla, num_splits=splits)
    rows = slice(qps, 2 * qps)
    assert rel(short[rows], want[rows]) > NEG_MIN
    swapped = table.clone()
    swapped[1] = table[3]
    wrong = paged_attention(q, cache, swapped, kv_lens, 0.3, causal, v_dim, mla, num_splits=splits)
    assert rel(wrong[rows], want[rows]) > NEG_MIN


@pytest.mark.parametrize("splits", [1, 4])
def test_q_read_through_its_strides(splits):
    """q as the view of a layer's q|k|v buffer [T, Hq + 2 Hkv, D] (token stride (Hq + 2 Hkv) D, no
    copy) gives bitwise the contiguous q's output. Control: the view one head further (k's heads
    in q's place) is far off."""
    qps, lens = 5, [6, 37, 16, 70]
    q, cache, table = _case(False, qps, lens)
    t, hq, d = q.shape
    buf = torch.randn(t, hq + 4, d, generator=torch.Generator().manual_seed(9)).to(device=DEV, dtype=DTYPE)
    buf[:, :hq] = q
    view = buf[:, :hq]
    assert view.stride(0) == (hq + 4) * d and not view.is_contiguous()
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = paged_attention(q, cache, table, kv_lens, 0.3, True, d, False, num_splits=splits)
    assert torch.equal(paged_attention(view, cache, table, kv_lens, 0.3, True, d, False, num_splits=splits), want)
    shifted = paged_attention(buf[:, 1:hq + 1], cache, table, kv_lens, 0.3, True, d, False, num_splits=splits)
    assert rel(shifted, want) > NEG_MIN


def test_split_count_is_checked_and_sized_by_the_grid():
    from tensorrt_llm._torch.attention_backend.triton_paged_kernel import MAX_SPLITS, default_num_splits
    q, cache, table = _case(False, 2, [5, 9])
    for bad in (0, 3, 2 * MAX_SPLITS):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention(q, cache, table, torch.tensor([5, 9], device=DEV), 0.3, True, 32, False,
                            num_splits=bad)
    assert default_num_splits(4, torch.device("cpu")) == 1
    if DEV.type == "cuda":
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        assert default_num_splits(sms, DEV) == 1                         # a full GPU is not split
        few = default_num_splits(3, DEV)
        assert 1 < few <= MAX_SPLITS and 3 * few * 2 > sms or few == MAX_SPLITS


def test_page_walk_stages_fit_the_shared_memory_budget():
    """Three stages for GQA heads and, within an H200's budget, for the 576-wide bf16 MLA latent on
    32-token pages; fewer where the tiles would not fit."""
    from tensorrt_llm._torch.attention_backend.triton_paged_kernel import _num_stages
    h200 = int(0.85 * 232448)
    assert _num_stages(32, 64, 64, 2, h200) == _num_stages(128, 64, 64, 2, h200) == 3     # GQA heads
    assert _num_stages(32, 576, 64, 2, h200) == 3                                        # MLA latent, 64 rows
    assert _num_stages(64, 576, 16, 2, h200) == 2 and _num_stages(64, 576, 64, 2, h200) == 1
    assert _num_stages(32, 576, 64, 2, 100 * 1024) == 1                                  # a smaller GPU


def test_launch_config_by_rows_and_grid():
    """16-row blocks for up to 16 rows (decode, GQA draft blocks); more rows take 64-row blocks
    while the programs still reach half the SMs, smaller blocks for a small batch."""
    from tensorrt_llm._torch.attention_backend import triton_paged_kernel as k
    cpu = torch.device("cpu")
    assert k.launch_config(192, 3, 32, 64, 2, False, cpu).block_m == 16
    assert k.launch_config(1, 27, 32, 64, 2, False, cpu) == k.LaunchConfig(64, 4, 3)
    assert k.launch_config(64, 128, 32, 576, 2, True, cpu) == k.LaunchConfig(64, 8, 2)
    assert k.launch_config(64, 128, 32, 576, 4, True, cpu).block_m == 32    # float32 latent: 64 rows do not fit
    if DEV.type == "cuda":
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        assert k.launch_config(sms, 27, 32, 64, 2, False, DEV).block_m == 64          # a full batch
        assert k.launch_config(1, 27, 32, 64, 2, False, DEV).block_m == 16            # one request
        assert k.launch_config((sms - 1) // 4, 128, 32, 576, 2, True, DEV).block_m == 32


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_every_query_block_matches_the_reference(mla):
    """block_m 16 / 32 / 64 (a 5-row verify of a 3-head group: 15 rows; MLA: 4 heads x 5 rows),
    any warps and stages: the same attention; control: a request's table row swapped."""
    from tensorrt_llm._torch.attention_backend.triton_paged_kernel import LaunchConfig
    lens, qps = [40, 7, 66], 5
    q, cache, table = _case(mla, qps, lens, seed=3)
    v_dim = 32 if mla else cache.shape[-1]
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = _reference(q, cache, table, lens, qps, True, v_dim, mla)
    for cfg in (LaunchConfig(16, 4, 1), LaunchConfig(32, 8, 2), LaunchConfig(64, 4, 3)):
        got = paged_attention(q, cache, table, kv_lens, 0.3, True, v_dim, mla, config=cfg)
        assert rel(got, want) < TOL, cfg
    swapped = table.clone()
    swapped[0] = table[2]
    bad = paged_attention(q, cache, swapped, kv_lens, 0.3, True, v_dim, mla, config=LaunchConfig(64, 4, 3))
    assert rel(bad[:qps], want[:qps]) > NEG_MIN
    for cfg in (LaunchConfig(8, 4, 1), LaunchConfig(48, 4, 1), LaunchConfig(16, 0, 1)):
        with pytest.raises(ValueError, match="config needs"):
            paged_attention(q, cache, table, kv_lens, 0.3, True, v_dim, mla, config=cfg)


def test_paged_attention_rejects_bad_shapes():
    q, cache, table = _case(False, 4, [20, 20])
    lens = torch.tensor([20, 20], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="split evenly"):
        paged_attention(q[:7], cache, table, lens, 0.3, True, 32, False)
    with pytest.raises(ValueError, match="GQA needs"):
        paged_attention(q, cache, table, lens, 0.3, True, 16, False)
    with pytest.raises(ValueError, match="MLA needs"):
        paged_attention(q, cache, table, lens, 0.3, True, 16, True)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :5], cache, table, lens, 0.3, True, 32, False)


def test_shape_support_names_what_the_kernel_cannot_run():
    from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
    assert TritonAttention.shape_support(64, 0, 32) == ""          # the GQA drafter
    assert TritonAttention.shape_support(512, 64, 32) == ""        # the MLA drafter's latent
    assert "rope width 8" in TritonAttention.shape_support(32, 8, 16)
    assert "value width 48 is not a power of two" in TritonAttention.shape_support(48, 0, 16)
    assert "page size 8" in TritonAttention.shape_support(64, 0, 8)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("mla", [False, True])
def test_ragged_queries_match_reference(mla, splits):
    """Prompt chunks: a different number of query rows per request (qo_indptr), causal."""
    q_lens, lens = [7, 1, 20, 4], [7, 33, 52, 16]
    q, cache, table = _case(mla, 1, lens)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(q_lens), q.shape[1], q.shape[2], generator=g).to(DTYPE).to(DEV)
    v_dim = 32 if mla else cache.shape[-1]
    indptr = torch.tensor([0, 7, 8, 28, 32], dtype=torch.int32, device=DEV)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got = paged_attention(q, cache, table, kv_lens, 0.3, True, v_dim, mla, qo_indptr=indptr, max_q=20,
                          num_splits=splits)
    md = AttentionMetadata(seq_lens=q_lens, num_cached=[n - s for n, s in zip(lens, q_lens)], block_tables=table,
                           slot_mapping=torch.zeros(0, dtype=torch.long, device=DEV), tokens_per_block=P, causal=True)
    want = paged_sdpa(q.float(), cache[:, 0].float(), None if mla else cache[:, 1].float(), md, 0.3,
                      v_dim=v_dim if mla else None)
    assert rel(got, want) < TOL
    # negative control: request 2 (rows 8..27) with one page less of context
    short = kv_lens - torch.tensor([0, 0, P, 0], dtype=torch.int32, device=DEV)
    off = paged_attention(q, cache, table, short, 0.3, True, v_dim, mla, qo_indptr=indptr, max_q=20,
                          num_splits=splits)
    assert rel(off[8:28], want[8:28]) > NEG_MIN and rel(off[:8], want[:8]) < TOL
    with pytest.raises(ValueError, match="qo_indptr"):
        paged_attention(q, cache, table, kv_lens, 0.3, True, v_dim, mla, qo_indptr=indptr[:3], max_q=20)


def test_unallocated_pages_are_never_read():
    """A table entry of BAD_PAGE_INDEX inside the length (its writes were skipped) adds nothing."""
    q, cache, table = _case(False, 4, [40, 40])
    kv_lens = torch.tensor([40, 40], dtype=torch.int32, device=DEV)
    bad = table.clone()
    bad[1, 2] = BAD_PAGE_INDEX                    # request 1's third page (positions 32..39)
    got = paged_attention(q, cache, bad, kv_lens, 0.3, False, 32, False)
    assert torch.isfinite(got.float()).all()
    want = _reference(q, cache, table, [40, 32], 4, False, 32, False)   # request 1 without those keys
    assert rel(got[4:], want[4:]) < TOL and rel(got[:4], want[:4]) < TOL


@pytest.mark.parametrize("v", [16, 64])
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("causal,qps", [(False, 8), (True, 3)])
def test_mla_output_through_w_uv(causal, qps, splits, v):
    """MLA with v_proj (W_UV [H, v, R]): each head's latent-space output through its W_UV (one launch after
    the attention, also where the KV is split) equals the attention's output then the per-head product,
    within the tolerance. Control: W_UV with its heads rolled lands far outside."""
    lens = [qps + 1, 37, 16, 70]
    q, cache, table = _case(True, qps, lens)
    v_dim = 32
    w_uv = (torch.randn(q.shape[1], v, v_dim, generator=torch.Generator().manual_seed(5)) / 4).to(DEV, DTYPE)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    lat = _reference(q, cache, table, lens, qps, causal, v_dim, True).to(DTYPE)
    want = torch.einsum("thr,hvr->thv", lat.float(), w_uv.float())
    got = paged_attention(q, cache, table, kv_lens, 0.3, causal, v_dim, True, num_splits=splits, v_proj=w_uv)
    assert got.shape == (q.shape[0], q.shape[1], v) and got.dtype == q.dtype
    assert rel(got, want) < TOL
    rolled = paged_attention(q, cache, table, kv_lens, 0.3, causal, v_dim, True, num_splits=splits,
                             v_proj=torch.roll(w_uv, 1, 0).contiguous())
    assert rel(rolled, want) > NEG_MIN


def test_w_uv_is_checked():
    """v_proj must be MLA's W_UV: the message names it; a GQA cache refuses it."""
    q, cache, table = _case(True, 8, [9, 37])
    lens = torch.tensor([9, 37], dtype=torch.int32, device=DEV)
    for bad in (torch.zeros(q.shape[1] + 1, 16, 32), torch.zeros(q.shape[1], 12, 32), torch.zeros(q.shape[1], 32, 16),
                torch.zeros(q.shape[1], 16, 32, dtype=torch.float64)):
        with pytest.raises(ValueError, match="v_proj must be MLA's W_UV"):
            paged_attention(q, cache, table, lens, 0.3, False, 32, True, v_proj=bad.to(DEV))
    gq, gcache, gtable = _case(False, 2, [5, 9])
    with pytest.raises(ValueError, match="on a GQA cache"):
        paged_attention(gq, gcache, gtable, torch.tensor([5, 9], device=DEV), 0.3, True, 32, False,
                        v_proj=torch.zeros(gq.shape[1], 16, 32, dtype=DTYPE, device=DEV))
