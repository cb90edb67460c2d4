"""RoPE of q and k fused with the page-bounded KV append (`triton_rope_append.py`; Triton's
interpreter on the CPU).

The kernel's q equals `RotaryEmbedding.apply` (the regions' rotation) and its cache equals the
reference append (`reference_paged_kv_append`) of the rotated k and of v, for uniform and ragged
steps (requests of 2, 3 and 1 tokens; padding rows past the last request are its own), float32 and bfloat16 (within one bf16 ulp); a -1 slot is
skipped and not counted; a slot in another request's page, past the request's pages or outside
the pool is refused (the cache keeps its bytes) and counted once per token. Negative controls:
tables of the wrong positions move q far outside the tolerance; a plain scatter writes the
foreign slot the kernel refuses. With `HeadNorms` (the drafter's per-head q / k RMSNorms before
the rotation) q and the cache equal `rms_norm` then the rotation, within the same tolerances; the
un-normed kernel lands far outside them. The absorbed-MLA form (`mla_rope_append`) gives
[q_lat | rope(q_pe)] and appends [rms_norm(c_kv) | rope(k_pe)] as the reference append does, with
the same refusals; controls: shifted tables, no norm. Given W_UK it takes q_nope and forms
q_lat = q_nope W_UK in the launch (control: W_UK's heads rolled). Validation names the argument. GPU: bf16 at SmolLM2's
heads, eager and replayed in a CUDA graph, against the same references.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.interface import (  # noqa: E402
    BAD_PAGE_INDEX, HeadNorms, joint_planes, write_slots)
from tensorrt_llm._torch.attention_backend.paged_append import reference_paged_kv_append  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_rope_append import mla_rope_append, rope_append  # noqa: E402
from tensorrt_llm._torch.modules.rms_norm import rms_norm  # noqa: E402
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding  # noqa: E402

P = 4


def _case(dtype=torch.float32, ragged=False, hq=6, hkv=3, d=16, dev="cpu", seed=0):
    """Three requests on a 12-page pool. Request 0 owns pages 3, 7; request 1 page 5 (BAD past it);
    request 2 page 9. Token slots (uniform: 2 tokens each; ragged: 2, 3, 1 tokens) include a -1, a
    slot in request 0's page written by request 1 (foreign), one past the pool. Returns the kernel's
    arguments, the rotary, and the tokens' (slot, owned) list."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[3, 7, BAD_PAGE_INDEX], [5, BAD_PAGE_INDEX, BAD_PAGE_INDEX],
                           [9, BAD_PAGE_INDEX, BAD_PAGE_INDEX]], dtype=torch.int32)
    if ragged:
        slots = [(3 * P + 2, True), (3 * P + 3, True), (5 * P + 1, True), (7 * P + 0, False), (12 * P + 1, False),
                 (9 * P + 2, True)]
        qo, qps = torch.tensor([0, 2, 5, 6], dtype=torch.int32), 0
    else:
        slots = [(7 * P + 1, True), (-1, False), (5 * P + 1, True), (7 * P + 2, False), (9 * P + 0, True),
                 (12 * P + 3, False)]
        qo, qps = None, 2
    t = len(slots)
    rot = RotaryEmbedding(d, 1000.0, 256)
    positions = torch.randint(0, 200, (t,), generator=g)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)          # views of one buffer, token stride (hq + 2 hkv) d
    cos, sin = rot.cos_sin(positions)
    cache = torch.randn(12, 2, hkv, P, d, generator=g).to(dtype)
    to = lambda x: None if x is None else x.to(dev)      # noqa: E731
    args = dict(q=to(q), k=to(k), v=to(v), cos=to(cos), sin=to(sin), kv_cache=to(cache),
                slot_mapping=to(torch.tensor([s for s, _ in slots])), block_tables=to(tables), qo_indptr=to(qo),
                tokens_per_seq=qps, refused=to(torch.zeros(1, dtype=torch.int32)))
    return args, rot, slots


def _norms(args, seed=1):
    """Per-head norm weights around 1 (0.25..1.75) in the values' dtype, eps 1e-5."""
    g = torch.Generator().manual_seed(seed)
    d, x = args["q"].shape[-1], args["q"]
    w = lambda: (0.25 + 1.5 * torch.rand(d, generator=g)).to(x.dtype).to(x.device)   # noqa: E731
    return HeadNorms(w(), w(), 1e-5)


def _expected(args, rot, norms=None):
    """(rotated q, the cache after the reference append of rotated k | v, its refusal count); q and
    k RMSNormed per head first with norms."""
    q, k = args["q"], args["k"]
    if norms is not None:
        q, k = rms_norm(q, norms.q_weight, norms.eps), rms_norm(k, norms.k_weight, norms.eps)
    q = rot.apply(q, args["cos"], args["sin"])
    k = rot.apply(k, args["cos"], args["sin"])
    cache, refused = args["kv_cache"].clone(), torch.zeros_like(args["refused"])
    reference_paged_kv_append(torch.cat((k, args["v"]), dim=1), joint_planes(cache), args["slot_mapping"],
                              args["block_tables"], args["qo_indptr"], args["tokens_per_seq"], 0, refused)
    return q, cache, refused


def _close(a, b, dtype, ulps=1):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:   # bf16 ulps: the float32 products may round apart before the cast
        torch.testing.assert_close(a.float(), b.float(), rtol=ulps * 2 ** -7, atol=ulps * 2 ** -7)


def _refused_keep_their_bytes(cache, before, slots):
    """Refused slots inside the pool (another request's page) were not written."""
    for s, ok in slots:
        if s >= 0 and not ok and s < 12 * P:
            assert torch.equal(cache[s // P, :, :, s % P], before[s // P, :, :, s % P])


def _launch_matches(fn, args, want, slots, dtype, ulps=1) -> torch.Tensor:
    """Run fn(**args) once: its q and the cache equal `want` (q, cache, refused count), two slots are
    refused and keep their bytes. Returns the cache as it was before the launch."""
    want_q, want_cache, want_refused = want
    before = args["kv_cache"].clone()
    out = fn(**args)
    _close(out, want_q, dtype, ulps=ulps)
    _close(args["kv_cache"], want_cache, dtype, ulps=ulps)
    assert int(args["refused"]) == int(want_refused) == 2
    _refused_keep_their_bytes(args["kv_cache"], before, slots)
    return before


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotates_q_and_appends_owned_slots(ragged, dtype):
    args, rot, slots = _case(dtype, ragged)
    _launch_matches(rope_append, args, _expected(args, rot), slots, dtype)
    assert sum(s >= 0 and not ok for s, ok in slots) == 2
    # a second call accumulates into the counter (never zeroed)
    rope_append(**args)
    assert int(args["refused"]) == 4


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norms_before_the_rotation(ragged, dtype):
    """The drafter's q / k norms in the same launch: q and the cache equal rms_norm, then RoPE; the
    un-normed kernel (control) lands far outside the tolerance."""
    args, rot, slots = _case(dtype, ragged)
    args["q"], args["k"] = args["q"] * 3, args["k"] * 3          # RMS ~3: the norm moves every value
    norms = _norms(args)
    want_q, want_cache, want_refused = _expected(args, rot, norms)
    start = args["kv_cache"].clone()
    out = rope_append(**args, head_norms=norms)
    # bf16: the normed value is rounded before the rotation, so one ulp there (the float32
    # statistic summed in another order) moves the output by up to ~2 ulps of its own scale
    _close(out, want_q, dtype, ulps=4)
    _close(args["kv_cache"], want_cache, dtype, ulps=4)
    assert int(args["refused"]) == int(want_refused) == 2
    args["kv_cache"].copy_(start)
    plain = rope_append(**args)
    assert (plain.float() - want_q.float()).abs().max() > 1.0
    assert (args["kv_cache"].float() - want_cache.float()).abs().max() > 1.0


def test_rows_past_the_last_request_are_its_own():
    """A captured step's padding rows (past qo_indptr[B]) belong to the last request, as in the C++ op:
    the last row's slot is in request 2's page while request 2 has no rows of its own."""
    args, rot, slots = _case(ragged=True)
    args["qo_indptr"] = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    want_q, want_cache, want_refused = _expected(args, rot)
    before = args["kv_cache"][9, :, :, 2].clone()
    rope_append(**args)
    torch.testing.assert_close(args["kv_cache"], want_cache, rtol=1e-6, atol=1e-6)
    assert int(args["refused"]) == int(want_refused) == 2
    assert (args["kv_cache"][9, :, :, 2] - before).abs().max() > 0.1      # written


def test_negative_controls_land_far_outside():
    args, rot, slots = _case()
    want_q, want_cache, _ = _expected(args, rot)
    shifted = dict(args, cos=torch.roll(args["cos"], 1, 0), sin=torch.roll(args["sin"], 1, 0))
    assert (rope_append(**shifted) - want_q).abs().max() > 0.1
    naive = args["kv_cache"].clone()   # a plain scatter writes the foreign slot the kernel refuses
    k = rot.apply(args["k"], args["cos"], args["sin"])
    write_slots(joint_planes(naive)[:, 0], torch.cat((k, args["v"]), dim=1),
                torch.where(args["slot_mapping"] < 12 * P, args["slot_mapping"], -1))
    foreign = [s for s, ok in slots if s >= 0 and not ok and s < 12 * P][0]
    assert (naive[foreign // P, :, :, foreign % P] - want_cache[foreign // P, :, :, foreign % P]).abs().max() > 0.1


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(cos=a["cos"].double()), "cos must be"),
    (lambda a: a.update(k=a["k"][:3]), "k must be|k holds 3 tokens"),
    (lambda a: a.update(v=a["v"].transpose(1, 2)), "v must be"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, :1]), "kv_cache must be"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be"),
    (lambda a: a.update(tokens_per_seq=4), "tokens_per_seq 4 does not split 6 tokens over 3 requests"),
    (lambda a: a.update(refused=a["refused"].long()), "refused must be"),
])
def test_bad_inputs_name_the_argument(change, message):
    args, _, _ = _case()
    change(args)
    with pytest.raises(ValueError, match=message):
        rope_append(**args)


def test_bad_head_norms_name_the_field():
    args, _, _ = _case()
    good = _norms(args)
    for norms, message in ((HeadNorms(good.q_weight[:8], good.k_weight, 1e-5), r"head_norms.q_weight must be \[16\]"),
                           (HeadNorms(good.q_weight, good.k_weight.double(), 1e-5), "head_norms.k_weight must be"),
                           (HeadNorms(good.q_weight, good.k_weight, 0.0), "head_norms.eps must be > 0")):
        with pytest.raises(ValueError, match=message):
            rope_append(**args, head_norms=norms)


def _mla_case(dtype=torch.float32, ragged=False, heads=4, rank=16, rope=8, dev="cpu", seed=0):
    """The GQA case's requests, tables and slots with an MLA cache [12, 1, 1, P, rank + rope] and the
    layer's pieces: q_lat [T, H, R], q_pe (a view of a wider q buffer), the raw latent kv (a view
    of a wider GEMM output), norm weight, tables."""
    args, rot, slots = _case(dtype, ragged, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    t = len(slots)
    rot = RotaryEmbedding(rope, 1000.0, 256)
    positions = torch.randint(0, 200, (t,), generator=g)
    cos, sin = rot.cos_sin(positions)
    q_buf = (3 * torch.randn(t, heads, 64 + rope, generator=g)).to(dtype)
    kv_buf = (3 * torch.randn(t, rank + rope + 5, generator=g)).to(dtype)
    to = lambda x: x.to(dev)                                          # noqa: E731
    q_lat = torch.randn(heads, t, rank, generator=g).to(dtype).transpose(0, 1)      # a bmm's [H, T, R], viewed
    mla = dict(q_lat=to(q_lat), q_pe=to(q_buf)[:, :, 64:],
               kv=to(kv_buf)[:, :rank + rope], cos=to(cos), sin=to(sin),
               norm_weight=to((0.25 + 1.5 * torch.rand(rank, generator=g)).to(dtype)), eps=1e-5,
               kv_cache=to(torch.randn(12, 1, 1, P, rank + rope, generator=g).to(dtype)),
               slot_mapping=args["slot_mapping"].to(dev), block_tables=args["block_tables"].to(dev),
               qo_indptr=None if args["qo_indptr"] is None else args["qo_indptr"].to(dev),
               tokens_per_seq=args["tokens_per_seq"], refused=args["refused"].to(dev))
    return mla, rot, slots


def _mla_expected(a, rot, norm=True):
    rank = a["q_lat"].shape[-1]
    q = torch.cat((a["q_lat"], rot.apply(a["q_pe"], a["cos"], a["sin"])), dim=-1)
    ckv, k_pe = a["kv"][:, :rank], a["kv"][:, rank:]
    c = rms_norm(ckv, a["norm_weight"], a["eps"]) if norm else ckv
    latent = torch.cat((c, rot.apply(k_pe[:, None, :], a["cos"], a["sin"])[:, 0]), dim=-1)
    cache, refused = a["kv_cache"].clone(), torch.zeros_like(a["refused"])
    reference_paged_kv_append(latent[:, None, :], cache, a["slot_mapping"], a["block_tables"], a["qo_indptr"],
                              a["tokens_per_seq"], 0, refused)
    return q, cache, refused


@pytest.mark.parametrize("rank", [16, 256], ids=["R16", "R256-two-chunks"])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_form_builds_q_and_appends_the_latent(ragged, dtype, rank):
    """R 256 spreads each head's q_lat over two programs of 128 columns."""
    a, rot, slots = _mla_case(dtype, ragged, rank=rank)
    want = _mla_expected(a, rot)
    want_q, want_cache, _ = want
    before = _launch_matches(mla_rope_append, a, want, slots, dtype, ulps=4)
    # controls: other positions' tables move q; the un-normed latent is far from the written one
    shifted = dict(a, cos=torch.roll(a["cos"], 1, 0), sin=torch.roll(a["sin"], 1, 0), kv_cache=before.clone())
    assert (mla_rope_append(**shifted).float() - want_q.float()).abs().max() > 0.1
    _, plain_cache, _ = _mla_expected(a, rot, norm=False)
    assert (plain_cache.float() - want_cache.float()).abs().max() > 1.0


def test_mla_form_names_bad_inputs():
    a, _, _ = _mla_case()
    for change, message in (
            (lambda x: x.update(q_lat=x["q_lat"].transpose(1, 2)), "q_lat must be"),
            (lambda x: x.update(q_pe=x["q_pe"][:, :, :4]), "q_pe must be"),
            (lambda x: x.update(kv_cache=x["kv_cache"].expand(12, 2, 1, P, 24)), "kv_cache must be"),
            (lambda x: x.update(kv_cache=x["kv_cache"].double()), "share one dtype"),
            (lambda x: x.update(norm_weight=x["norm_weight"][:8]), "norm_weight must be"),
            (lambda x: x.update(eps=0.0), "eps must be > 0"),
            (lambda x: x.update(cos=x["cos"].double()), "cos must be"),
            (lambda x: x.update(slot_mapping=x["slot_mapping"].int()), "slot_mapping must be"),
            (lambda x: x.update(q_lat=x["q_lat"].to("meta")), r"^q_lat must be on cpu")):
        bad = dict(a)
        change(bad)
        with pytest.raises(ValueError, match=message):
            mla_rope_append(**bad)


def _w_uk_case(a, dtype, nope=16, seed=3):
    """q_nope [T, H, nope] (a view of a wider buffer) and W_UK [H, nope, R] for an `_mla_case`, and the
    q_lat = q_nope W_UK they stand for (float32 products, rounded to dtype)."""
    g = torch.Generator().manual_seed(seed)
    t, heads, rank = a["q_lat"].shape
    dev = a["kv"].device
    q_nope = torch.randn(t, heads, nope + 8, generator=g).to(dtype).to(dev)[:, :, :nope]
    w_uk = (torch.randn(heads, nope, rank, generator=g) / 4).to(dtype).to(dev)
    return q_nope, w_uk, torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()).to(dtype)


@pytest.mark.parametrize("rank", [32, 256], ids=["R32", "R256-two-chunks"])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_form_forms_q_nope_w_uk(ragged, dtype, rank):
    """Given W_UK the launch takes q_nope and forms q_lat = q_nope W_UK per head itself: q and the cache
    as the q_lat form's, within 4 bf16 ulps (R 256: each head's columns from two programs). Control: W_UK
    with its heads rolled is far off."""
    a, rot, slots = _mla_case(dtype, ragged, rank=rank)
    q_nope, w_uk, q_lat = _w_uk_case(a, dtype)
    want = _mla_expected(dict(a, q_lat=q_lat), rot)
    before = _launch_matches(mla_rope_append, dict(a, q_lat=q_nope, w_uk=w_uk), want, slots, dtype, ulps=4)
    rolled = mla_rope_append(**dict(a, q_lat=q_nope, w_uk=torch.roll(w_uk, 1, 0).contiguous(),
                                    kv_cache=before.clone()))
    assert (rolled.float() - want[0].float()).abs().max() > 0.1


@pytest.mark.parametrize("t", [40, 300])
def test_mla_form_over_several_token_blocks(t):
    """More tokens than one program's block (16; 64 past 256 tokens): every token's q (W_UK formed) and
    latent, one request owning every slot. Control: the un-normed latent is far from the written one."""
    rank, rope, heads = 32, 8, 4
    pages = -(-t // P)
    g = torch.Generator().manual_seed(11)
    rot = RotaryEmbedding(rope, 1000.0, 512)
    cos, sin = rot.cos_sin(torch.arange(t))
    a = dict(q_lat=torch.zeros(t, heads, rank), q_pe=torch.randn(t, heads, rope, generator=g),
             kv=3 * torch.randn(t, rank + rope, generator=g), cos=cos, sin=sin,
             norm_weight=0.25 + 1.5 * torch.rand(rank, generator=g), eps=1e-5,
             kv_cache=torch.zeros(pages + 1, 1, 1, P, rank + rope), slot_mapping=torch.arange(t),
             block_tables=torch.arange(pages, dtype=torch.int32)[None], qo_indptr=None, tokens_per_seq=t,
             refused=torch.zeros(1, dtype=torch.int32))
    q_nope, w_uk, q_lat = _w_uk_case(a, torch.float32)
    want_q, want_cache, _ = _mla_expected(dict(a, q_lat=q_lat), rot)
    out = mla_rope_append(**dict(a, q_lat=q_nope, w_uk=w_uk))
    _close(out, want_q, torch.float32)
    _close(a["kv_cache"], want_cache, torch.float32)
    assert int(a["refused"]) == 0
    _, plain_cache, _ = _mla_expected(dict(a, q_lat=q_lat), rot, norm=False)
    assert (plain_cache - want_cache).abs().max() > 1.0


def test_w_uk_form_names_bad_inputs():
    a, _, _ = _mla_case(rank=32)
    q_nope, w_uk, _ = _w_uk_case(a, torch.float32)
    for w, q, message in ((w_uk[:3], q_nope, "w_uk must be"), (w_uk.transpose(1, 2), q_nope, "w_uk must be"),
                          (w_uk.double(), q_nope, "w_uk must be"), (w_uk[:, :8].contiguous(), q_nope[:, :, :8],
                                                                    "q_nope width 8 must be a power of two >= 16")):
        with pytest.raises(ValueError, match=message):
            mla_rope_append(**dict(a, q_lat=q, w_uk=w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("absorb", [False, True])
def test_gpu_bf16_mla_form(absorb):
    """At the MLA drafter's widths (16 heads, nope 64, R 512, rope 64); with W_UK formed in the launch."""
    a, rot, _ = _mla_case(torch.bfloat16, True, heads=16, rank=512, rope=64, dev="cuda")
    if absorb:
        q_nope, w_uk, q_lat = _w_uk_case(a, torch.bfloat16, nope=64)
        a = dict(a, q_lat=q_lat)
    want_q, want_cache, _ = _mla_expected(a, rot)
    out = mla_rope_append(**(dict(a, q_lat=q_nope, w_uk=w_uk) if absorb else a))
    _close(out, want_q, torch.bfloat16, ulps=4)
    _close(a["kv_cache"], want_cache, torch.bfloat16, ulps=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ragged", [False, True])
def test_gpu_bf16_eager_and_in_a_graph(ragged):
    args, rot, slots = _case(torch.bfloat16, ragged, hq=9, hkv=3, d=64, dev="cuda")
    want_q, want_cache, _ = _expected(args, rot)
    start = args["kv_cache"].clone()
    out = rope_append(**args)
    _close(out, want_q, torch.bfloat16)
    _close(args["kv_cache"], want_cache, torch.bfloat16)
    assert int(args["refused"]) == 2
    args["kv_cache"].copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rope_append(**args)
    args["kv_cache"].copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    _close(captured, want_q, torch.bfloat16)
    _close(args["kv_cache"], want_cache, torch.bfloat16)
    assert int(args["refused"]) == 4          # the capture ran nothing; the replay counted 2 more


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_head_norms():
    args, rot, _ = _case(torch.bfloat16, True, hq=9, hkv=3, d=64, dev="cuda")
    norms = _norms(args)
    want_q, want_cache, _ = _expected(args, rot, norms)
    out = rope_append(**args, head_norms=norms)
    _close(out, want_q, torch.bfloat16, ulps=4)
    _close(args["kv_cache"], want_cache, torch.bfloat16, ulps=4)
