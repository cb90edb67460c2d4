"""FLASHINFER vs VANILLA on fresh random paged inputs, every path, each with a negative control.

Pages are assigned in a random order out of a larger pool, slots nobody owns (and owned slots
not yet filled) hold large garbage, so reading a wrong page or past kv_len is a large error.
The negative control recomputes the reference with every owned page read as the next page of
the pool (still inside it) and must miss by far more than the tolerance.

CPU tests: the module imports without flashinfer, explicit FLASHINFER on CPU raises, the CSR
page metadata is right, and the backend drives a fake flashinfer (same documented semantics)
to the VANILLA result, which checks the plan/run arguments without a GPU.
"""
from __future__ import annotations

import importlib
import math
import sys
import types
from dataclasses import dataclass, replace

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention

MODULE = "tensorrt_llm._torch.attention_backend.flashinfer_backend"
TOL = 2e-2          # bf16 operands
NEG_MIN = 0.2       # the negative control must be at least this far off



def gpu(test):
    """Mark a GPU test (tests/conftest.py skips `gpu` on CPU; the skipif covers other runners)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@dataclass
class Case:
    md: AttentionMetadata
    cache: torch.Tensor           # [N, 2, Hkv, P, D] or MLA [N, 1, 1, P, Dl]
    q: torch.Tensor               # [T, Hq, D]
    k: torch.Tensor               # [T, Hkv, D] (MLA: latent [T, Dl])
    v: torch.Tensor | None


def make_case(seed: int, cached: list[int], new: list[int], causal: bool, device: str,
              hq: int = 8, hkv: int = 2, d: int = 64, p: int = 16, mla: bool = False,
              dtype: torch.dtype = torch.bfloat16) -> Case:
    g = torch.Generator().manual_seed(seed)
    kv_lens = [c + n for c, n in zip(cached, new)]
    need = sum(-(-n // p) for n in kv_lens)
    free = torch.randperm(need + 7, generator=g).tolist()
    pages = [[free.pop() for _ in range(-(-n // p))] for n in kv_lens]
    bt = torch.full((len(new), max(len(x) for x in pages) + 1), BAD_PAGE_INDEX, dtype=torch.int32)
    for b, pg in enumerate(pages):
        bt[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
    shape = (need + 7, 1, 1, p, d) if mla else (need + 7, 2, hkv, p, d)
    cache = 30.0 * torch.randn(shape, generator=g)                 # garbage everywhere
    for b, c in enumerate(cached):                                 # real cached entries
        for pos in range(c):
            cache[pages[b][pos // p], :, :, pos % p] = torch.randn(shape[1:3] + (d,), generator=g)
    slots = [pages[b][pos // p] * p + pos % p for b, (c, n) in enumerate(zip(cached, new))
             for pos in range(c, c + n)]
    t = sum(new)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, d, generator=g) if mla else torch.randn(t, hkv, d, generator=g)
    v = None if mla else torch.randn(t, hkv, d, generator=g)
    to = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    md = AttentionMetadata(seq_lens=list(new), num_cached=list(cached), block_tables=bt.to(device),
                           slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                           tokens_per_block=p, causal=causal)
    return Case(md, to(cache), to(q), to(k), to(v))


def run(backend, case: Case, md: AttentionMetadata | None = None,
        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the write) on a private copy of the case's cache and fresh extras.

    MLA cases use a 64-wide rope part: v_dim = latent width - 64.
    """
    md = replace(md or case.md, extras={})
    cache = case.cache.clone()
    backend.prepare(md)
    if case.v is None:
        scale = scale or 1.0 / math.sqrt(192)
        out = backend.forward_mla(case.q, case.k, cache, md, scale, case.cache.shape[-1] - 64)
    else:
        out = backend.forward(case.q, case.k, case.v, cache, md, scale or case.q.shape[-1] ** -0.5)
    return out.float(), cache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def rolled(md: AttentionMetadata, num_pages: int) -> AttentionMetadata:
    """Same step, but every owned page is read as the next page of the pool (negative control).
    Unowned entries stay BAD_PAGE_INDEX, so a GPU kernel never reads outside the pool."""
    bt = md.block_tables
    shifted = torch.where(bt == BAD_PAGE_INDEX, bt, (bt + 1) % num_pages)
    return replace(md, block_tables=shifted, extras={})


def check_against_vanilla(fi, case: Case) -> None:
    ref, ref_cache = run(VanillaAttention(), case)
    out, out_cache = run(fi, case)
    assert torch.isfinite(out).all()
    assert torch.equal(out_cache, ref_cache), "new K/V (or latents) written to different slots"
    err = rel(out, ref)
    assert err < TOL, f"flashinfer vs vanilla rel err {err:.2e}"
    wrong, _ = run(VanillaAttention(), case, md=rolled(case.md, case.cache.shape[0]))
    assert rel(out, wrong) > NEG_MIN, "negative control too close: the check is not sensitive"


PATHS = {  # name: (cached, new, causal)
    "prefill_causal": ([0, 21, 64], [37, 16, 5], True),
    "decode": ([1, 15, 16, 17, 100], [1, 1, 1, 1, 1], True),
    "verify_k_plus_1": ([7, 32, 50], [4, 4, 4], True),
    "draft_block_noncausal": ([9, 40, 1], [8, 8, 8], False),
}


# ---- CPU ---------------------------------------------------------------------------------
def test_imports_without_flashinfer_and_cpu_choice_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)        # `import flashinfer` now fails
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    mod = importlib.import_module(MODULE)
    caps = mod.FlashInferAttention.capabilities
    assert mod.FlashInferAttention.name == "FLASHINFER"
    assert caps.paged and caps.mla and caps.non_causal_block and caps.cuda_graphs
    assert caps.devices == ("cuda",) and caps.fp8_kv and not caps.sliding_window
    ok, why = mod.FlashInferAttention.availability(torch.device("cpu"))
    assert not ok and "cpu" in why
    with pytest.raises(ValueError, match="needs flashinfer"):
        mod.import_flashinfer()
    from tensorrt_llm._torch.attention_backend.resolver import Probe, create_backend
    with pytest.raises(ValueError, match=r"FLASHINFER.*CUDA"):
        create_backend("FLASHINFER", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="not importable"):
        create_backend("FLASHINFER", torch.device("cpu"), torch.bfloat16,
                       probe=Probe("cuda", 90, flashinfer_importable=False, flashinfer_error="gone"))


def test_step_pages_csr_metadata():
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import build_step_pages
    case = make_case(0, [0, 21, 64], [37, 16, 5], True, "cpu", p=16)
    pages = build_step_pages(case.md)
    assert pages.qo_indptr.tolist() == [0, 37, 53, 58]
    assert pages.kv_indptr.tolist() == [0, 3, 6, 11]             # ceil(37/16), ceil(37/16), ceil(69/16)
    assert pages.last_page_len.tolist() == [5, 5, 5]
    assert pages.kv_lens.tolist() == [37, 37, 69]
    bt = case.md.block_tables
    expect = bt[0, :3].tolist() + bt[1, :3].tolist() + bt[2, :5].tolist()
    assert pages.kv_indices.tolist() == expect and BAD_PAGE_INDEX not in expect
    assert pages.slots_valid and pages.graph_shape is None
    unowned = replace(case.md, slot_mapping=case.md.slot_mapping.clone().index_fill_(0, torch.tensor([3]), -1))
    assert not build_step_pages(unowned).slots_valid
    short = replace(case.md, block_tables=bt[:, :2])
    with pytest.raises(ValueError, match="block table width"):
        build_step_pages(short)


def _ref_step_pages(md: AttentionMetadata) -> tuple[list[int], ...]:
    """The straightforward per-request CSR construction (slow reference of build_step_pages)."""
    p, qo, kvp, idx, last = md.tokens_per_block, [0], [0], [], []
    for b, (c, n) in enumerate(zip(md.num_cached, md.seq_lens)):
        pages = -(-(c + n) // p)
        qo.append(qo[-1] + n)
        kvp.append(kvp[-1] + pages)
        idx += md.block_tables[b, :pages].tolist()
        last.append(c + n - (pages - 1) * p)
    return qo, kvp, idx, last, md.kv_lens


def test_step_pages_match_reference_on_random_inputs():
    import random
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import build_step_pages
    rng = random.Random(0)
    for trial in range(200):
        p = rng.choice([4, 16, 32])
        b = rng.randrange(1, 20)
        new = [1] * b if trial % 4 == 1 else [rng.randrange(1, 3 * p) for _ in range(b)]
        cached = [rng.randrange(0, 6 * p) for _ in range(b)]
        pages = [-(-(c + n) // p) for c, n in zip(cached, new)]
        width = max(pages) + rng.randrange(0, 4)
        bt = torch.full((b, width), BAD_PAGE_INDEX, dtype=torch.int32)
        for r, n in enumerate(pages):                      # owned pages, then the sentinel
            bt[r, :n] = torch.tensor(rng.sample(range(1000), n), dtype=torch.int32)
        slots = [rng.randrange(1000 * p) if rng.random() > 0.1 else -1 for _ in range(sum(new))]
        graph = trial % 3 == 0
        md = AttentionMetadata(seq_lens=new, num_cached=cached, block_tables=bt,
                               slot_mapping=torch.tensor(slots, dtype=torch.long), tokens_per_block=p,
                               graph_shape=(b, 1, width) if graph else None)
        got = build_step_pages(md)
        qo, kvp, idx, last, kv_lens = _ref_step_pages(md)
        assert BAD_PAGE_INDEX not in idx
        for t in (got.qo_indptr, got.kv_indptr, got.kv_indices, got.last_page_len, got.kv_lens):
            assert t.dtype == torch.int32
        assert got.qo_indptr.tolist() == qo and got.kv_indptr.tolist() == kvp
        assert got.kv_indices.tolist() == idx and got.last_page_len.tolist() == last
        assert got.kv_lens.tolist() == kv_lens and got.page_size == p
        assert got.slots_valid == (graph or -1 not in slots)
        assert got.graph_shape == ((b, 1, width) if graph else None)
        assert got.decode == all(n == 1 for n in new)
    # negative control: the reference sees other page ids when the table changes
    bt[0, 0] += 1
    assert build_step_pages(md).kv_indices.tolist() != idx


def _fake_attention(q, keys, values, causal, scale):
    """q [s, H, Dk], keys [L, Hkv, Dk], values [L, Hkv, Dv] -> [s, H, Dv] (float32 math)."""
    s, h = q.shape[:2]
    L, hkv = keys.shape[:2]
    kk = keys.float().repeat_interleave(h // hkv, 1)
    vv = values.float().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if causal:  # query i sits at position L - s + i
        mask = torch.arange(L)[None, :] <= (L - s + torch.arange(s))[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).to(q.dtype)


def _fake_flashinfer() -> tuple[types.ModuleType, types.ModuleType, list]:
    """A CPU stand-in with flashinfer's documented paged semantics (HND, CSR pages); `fi.dtypes`
    records each GQA plan's (q_data_type, kv_data_type)."""
    calls: list = []
    dtypes: list = []

    class Prefill:
        def __init__(self, ws, kv_layout="NHD", backend="auto", use_cuda_graph=False, **bufs):
            assert kv_layout == "HND"

        def plan(self, qo, kvp, kvi, last, hq, hkv, d, p, causal=False, sm_scale=None,
                 q_data_type=None, kv_data_type=None, **kw):
            calls.append(("gqa", causal, hq, hkv, d, p))
            dtypes.append((q_data_type, kv_data_type))
            self.a = (qo.tolist(), kvp.tolist(), kvi.long(), last.tolist(), p, causal, sm_scale)

        def run(self, q, cache):
            qo, kvp, kvi, last, p, causal, scale = self.a
            k_cache, v_cache = cache.unbind(1)                     # [N, Hkv, P, D]
            outs = []
            for b in range(len(qo) - 1):
                pg = kvi[kvp[b]:kvp[b + 1]]
                n = (len(pg) - 1) * p + last[b]
                kk = k_cache[pg].permute(0, 2, 1, 3).reshape(-1, *k_cache.shape[1::2])[:n]
                vv = v_cache[pg].permute(0, 2, 1, 3).reshape(-1, *v_cache.shape[1::2])[:n]
                outs.append(_fake_attention(q[qo[b]:qo[b + 1]], kk, vv, causal, scale))
            return torch.cat(outs)

    class Decode(Prefill):
        def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, **bufs):
            assert kv_layout == "HND"

        def plan(self, kvp, kvi, last, hq, hkv, d, p, pos_encoding_mode="NONE", sm_scale=None,
                 q_data_type=None, kv_data_type=None):
            assert pos_encoding_mode == "NONE"
            calls.append(("gqa_decode", True, hq, hkv, d, p))
            dtypes.append((q_data_type, kv_data_type))
            self.a = (list(range(len(kvp))), kvp.tolist(), kvi.long(), last.tolist(), p, True, sm_scale)

    class MLAMeta:
        @staticmethod
        def csr(qo, kvp, kvi, kv_len):
            return (qo.tolist(), kvp.tolist(), kvi.long(), kv_len.tolist())

    class MLA:
        def __init__(self, ws, backend="auto", **kw):
            pass

        def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                 q_data_type, kv_data_type, query_layout, kv_cache_layout):
            assert query_layout == kv_cache_layout == "packed"
            calls.append(("mla", causal, num_heads, head_dim_ckv, head_dim_kpe, page_size))
            self.a = (*metadata, page_size, causal, sm_scale, head_dim_ckv)

        def run(self, *, query, kv_cache):
            qo, kvp, kvi, kv_len, p, causal, scale, r = self.a
            outs = []
            for b in range(len(qo) - 1):
                lat = kv_cache[kvi[kvp[b]:kvp[b + 1]]].reshape(-1, kv_cache.shape[-1])[:kv_len[b], None]
                outs.append(_fake_attention(query[qo[b]:qo[b + 1]], lat, lat[..., :r], causal, scale))
            return torch.cat(outs)

    fi = types.ModuleType("flashinfer")
    fi.dtypes = dtypes
    fi.BatchPrefillWithPagedKVCacheWrapper = Prefill
    fi.BatchDecodeWithPagedKVCacheWrapper = Decode
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = MLA, MLAMeta
    fi.mla = mla
    return fi, mla, calls


@pytest.mark.parametrize("path", [*PATHS, "mla_block", "mla_decode"])
def test_backend_contract_with_fake_flashinfer(monkeypatch, path):
    fi_mod, mla_mod, calls = _fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fi_mod)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla_mod)
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    if path.startswith("mla"):
        cached, new, causal = ([30, 5, 70], [4, 4, 4], False) if path == "mla_block" else \
            ([30, 5, 70], [1, 1, 1], True)
        case = make_case(1, cached, new, causal, "cpu", hq=4, d=96, mla=True)
        check_against_vanilla(FlashInferAttention(mla_kernel="fa3"), case)
        assert calls[-1] == ("mla", causal, 4, 32, 64, 16)
    else:
        cached, new, causal = PATHS[path]
        fi = FlashInferAttention()
        check_against_vanilla(fi, make_case(2, cached, new, causal, "cpu"))
        # one new token per request: the decode kernel; anything else: the prefill kernel
        assert calls[-1][:2] == (("gqa_decode", True) if path == "decode" else ("gqa", causal))
        case = make_case(4, cached, new, causal, "cpu")      # a write beyond owned pages is skipped
        case.md.slot_mapping[-1] = -1
        check_against_vanilla(fi, case)
        # one plan per step: several layers with the same metadata reuse it
        md = replace(make_case(3, cached, new, causal, "cpu").md, extras={})
        case = make_case(3, cached, new, causal, "cpu")
        fi.prepare(md)
        n = len(calls)
        for _ in range(3):
            fi.forward(case.q, case.k, case.v, case.cache.clone(), md, 0.125)
        assert len(calls) == n + 1


def fp8_case(case: Case, dtype: torch.dtype = torch.float8_e4m3fn) -> Case:
    """The same step over an fp8 pool: cached entries (garbage included) cast to fp8."""
    return replace(case, cache=case.cache.clamp(-440, 440).to(dtype))


@pytest.mark.parametrize("path", ["prefill_causal", "decode", "verify_k_plus_1"])
def test_fp8_gqa_pool_with_fake_flashinfer(monkeypatch, path):
    """An fp8 GQA pool: plans ask for bf16 queries over fp8 KV, new K/V land as fp8 bytes in the same
    slots VANILLA writes, and the output equals VANILLA over the same fp8 pool (both read the fp8
    values; tolerance as bf16). Negative control: rolled tables. MLA latents must stay bf16."""
    fi_mod, mla_mod, _ = _fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fi_mod)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla_mod)
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    cached, new, causal = PATHS[path]
    case = fp8_case(make_case(5, cached, new, causal, "cpu"))
    check_against_vanilla(FlashInferAttention(), case)
    assert fi_mod.dtypes[-1] == (torch.bfloat16, torch.float8_e4m3fn)
    mla = make_case(1, [30, 5], [4, 4], False, "cpu", hq=4, d=96, mla=True)
    with pytest.raises(ValueError, match="MLA KV cache in the query dtype"):
        run(FlashInferAttention(), fp8_case(mla))


# ---- GPU ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fi_backend():
    pytest.importorskip("flashinfer")
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    return FlashInferAttention()


@gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("seed", [10, 11])
def test_gqa_paths_match_vanilla(fi_backend, path, seed):
    cached, new, causal = PATHS[path]
    check_against_vanilla(fi_backend, make_case(seed, cached, new, causal, "cuda", hq=9, hkv=3))


@gpu
@pytest.mark.parametrize("causal,new", [(False, [4, 4, 4]), (True, [1, 1, 1])], ids=["block", "decode"])
def test_mla_absorbed_matches_vanilla(fi_backend, causal, new):
    case = make_case(20, [30, 5, 70], new, causal, "cuda", hq=16, d=576, p=16, mla=True)
    check_against_vanilla(fi_backend, case)


@gpu
@pytest.mark.parametrize("q", [3, 1], ids=["verify", "decode"])
def test_gqa_cuda_graph_replay_matches_vanilla(fi_backend, q):
    """Capture backend.forward once for (bucket 4, q); replay on fresh metadata each time (q = 1:
    the decode kernel's graph wrapper)."""
    bucket, p, max_pages = 4, 16, 12
    cases = [make_case(30 + i, cached, [q] * bucket, True, "cuda", hq=9, hkv=3, p=p)
             for i, cached in enumerate([[5, 40, 17, 60], [0, 3, 90, 33], [120, 1, 44, 8]])]
    n_pages = max(c.cache.shape[0] for c in cases)
    static_cache = torch.zeros((n_pages,) + cases[0].cache.shape[1:], dtype=torch.bfloat16, device="cuda")
    sq, sk, sv = (torch.zeros_like(x) for x in (cases[0].q, cases[0].k, cases[0].v))
    md = AttentionMetadata([q] * bucket, [0] * bucket,
                           torch.full((bucket, max_pages), BAD_PAGE_INDEX, dtype=torch.int32, device="cuda"),
                           torch.zeros(bucket * q, dtype=torch.long, device="cuda"), p, True)

    def load(case: Case) -> None:
        n = case.cache.shape[0]
        static_cache.zero_()
        static_cache[:n] = case.cache
        for dst, src in ((sq, case.q), (sk, case.k), (sv, case.v)):
            dst.copy_(src)
        md.block_tables.fill_(BAD_PAGE_INDEX)
        md.block_tables[:, :case.md.block_tables.shape[1]] = case.md.block_tables
        md.slot_mapping.copy_(case.md.slot_mapping)
        md.num_cached = list(case.md.num_cached)
        md.graph_shape = (bucket, q, max_pages)
        fi_backend.prepare(md)

    load(cases[0])
    fi_backend.forward(sq, sk, sv, static_cache, md, 0.125)        # warm-up: plans the graph wrapper
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi_backend.forward(sq, sk, sv, static_cache, md, 0.125)
    for case in cases[1:] + cases[:1]:
        load(case)
        graph.replay()
        ref, ref_cache = run(VanillaAttention(), case, scale=0.125)
        n = case.cache.shape[0]
        assert torch.equal(static_cache[:n], ref_cache)
        assert rel(out, ref) < TOL, f"graph replay vs vanilla rel err {rel(out, ref):.2e}"
        wrong, _ = run(VanillaAttention(), case, md=rolled(case.md, case.cache.shape[0]), scale=0.125)
        assert rel(out, wrong) > NEG_MIN


@pytest.mark.parametrize("planes,heads", [(2, 3), (2, 16), (1, 1)])
def test_precomputed_write_rows_equal_slot_writes(planes, heads):
    """The per-step rows (`cache_write_rows` + `scatter_rows`, one indexed copy per layer) write
    exactly what the per-slot reference (`write_slots`) writes, on every plane; rows of the other
    plane (the control) write elsewhere."""
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import cache_write_rows, scatter_rows
    from tensorrt_llm._torch.attention_backend.interface import write_slots
    g = torch.Generator().manual_seed(planes * 100 + heads)
    pages, p, d, t = 7, 4, 8, 11
    slots = torch.randperm(pages * p, generator=g)[:t]
    for plane in range(planes):
        values = torch.randn(t, heads, d, generator=g)
        ref = torch.randn(pages, planes, heads, p, d, generator=g)
        got = ref.clone()
        write_slots(ref[:, plane], values, slots)
        scatter_rows(got, cache_write_rows(slots, planes, heads, p, plane), values)
        assert torch.equal(got, ref)
        if planes > 1:
            wrong = ref.clone()
            scatter_rows(wrong, cache_write_rows(slots, planes, heads, p, 1 - plane), values + 1)
            assert not torch.equal(wrong[:, 1 - plane], ref[:, 1 - plane])
            assert torch.equal(wrong[:, plane], ref[:, plane])


@gpu
@pytest.mark.parametrize("path", ["prefill_causal", "decode", "verify_k_plus_1"])
def test_fp8_pool_matches_vanilla_and_stays_near_bf16(fi_backend, path):
    """FLASHINFER over an fp8 (e4m3) GQA pool: equal to VANILLA over the same fp8 pool (bf16
    tolerance), and within 0.1 (relative) of FLASHINFER over the bf16 pool it was cast from (e4m3
    keeps 3 mantissa bits); the rolled-table control lands beyond 0.2."""
    cached, new, causal = PATHS[path]
    base = make_case(12, cached, new, causal, "cuda")
    case = fp8_case(base)
    check_against_vanilla(fi_backend, case)
    out8, _ = run(fi_backend, case)
    out16, _ = run(fi_backend, base)
    assert rel(out8, out16) < 0.1
    wrong, _ = run(fi_backend, case, md=rolled(case.md, case.cache.shape[0]))
    assert rel(wrong, out16) > NEG_MIN


@gpu
def test_fp8_target_pool_logits_near_bf16_and_capacity_report(llama64_dir):
    """`kv_cache_config.dtype: fp8` on the GPU (AUTO -> FLASHINFER): the target pool is e4m3 at half
    the bytes per token, and a prefill's logits (every position) stay within 0.1 (relative) of the
    bf16 pool's with >= 90% equal argmax; control: another prompt's logits land beyond 0.3."""
    pytest.importorskip("flashinfer")
    from tensorrt_llm import LLM
    from tensorrt_llm._torch.runtime.step import ForwardSegment
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i, 11, 12] * 5 for i in range(3)]
    logits, reports = {}, {}
    for dt in ("auto", "fp8"):
        with LLM(str(llama64_dir), device="cuda", kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16,
                                                                     "dtype": dt}) as llm:
            reports[dt] = llm.capacity_report
            ex, kv = llm._executor, llm._bundle.kv
            ex.shutdown()
            segs = []
            for i, p in enumerate(prompts):
                kv.add_sequence(1000 + i, p, len(p))
                kv.ensure_capacity(1000 + i, len(p))
                segs.append(ForwardSegment(1000 + i, p, 0, len(p)))
            logits[dt] = ex.engine.forward(segs).logits.float()
            for i in range(len(prompts)):
                kv.free(1000 + i)
    for dt, rep in reports.items():
        assert rep["attention_backend"]["target"]["name"] == "FLASHINFER", rep["attention_backend"]
    t8, t16 = reports["fp8"]["pools"]["target"], reports["auto"]["pools"]["target"]
    assert t8["dtype"] == "float8_e4m3fn" and 2 * t8["bytes_per_token"] == t16["bytes_per_token"]
    a, b = logits["fp8"], logits["auto"]
    assert rel(a, b) < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    n = len(prompts[0])
    assert rel(a[:n], b[n:2 * n]) > 0.3
