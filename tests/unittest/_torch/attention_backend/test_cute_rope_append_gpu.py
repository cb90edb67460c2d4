"""The CuTe DSL fused prep + append kernels (`cute_rope_append`) on the GPU (H200, sm90; nvidia-cutlass-dsl
importable there) against the Triton fused append (`triton_rope_append`) and the torch reference
(`rope_append_reference` / `mla_rope_append_reference`, itself checked on the CPU in `test_cute_rope_append`).

Shapes: `test_triton_rope_append`'s requests (uniform and ragged, a -1 slot, a foreign page, a page past the
pool) at the drafter's widths (GQA 16 q / 2 KV heads x 64 with and without head norms; MLA 16 heads, latent
512 + rope 64), and 64 tokens over 8 requests of 8-slot pages. Tolerance: bf16 within 4 ulps of the value
(`_close`: the normed value is rounded before the rotation, so one ulp there moves the output by up to ~2 ulps;
rsqrt.approx and the summation order differ between the kernels); float32 within 1e-5; the refusal count
exact; refused slots keep their bytes. Negative controls: the reference with a norm over one column fewer,
or with the tables one position off, lands beyond 0.1; a slot one page past its request's pages is refused
and counted (a plain scatter writes it). The kernel captured in a CUDA graph replays new inputs and
accumulates the counter; a new token count reuses the compiled kernel.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.cute_norm_rope import norm_rope_reference  # noqa: E402
from tensorrt_llm._torch.attention_backend.cute_rope_append import (  # noqa: E402
    cute_mla_rope_append, cute_rope_append, mla_rope_append_reference, rope_append_reference)
from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, HeadNorms  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_rope_append import mla_rope_append, rope_append  # noqa: E402
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding  # noqa: E402

from tests.unittest._torch.attention_backend.test_triton_rope_append import (  # noqa: E402
    P, _case, _close, _mla_case, _norms)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _run(fn, args: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fn on a copy of the cache and a fresh counter -> (q, cache, refused)."""
    a = dict(args, kv_cache=args["kv_cache"].clone(), refused=torch.zeros_like(args["refused"]))
    out = fn(**a, **kw)
    torch.cuda.synchronize()
    return out, a["kv_cache"], int(a["refused"])


def _far(a: torch.Tensor, b: torch.Tensor) -> None:
    assert float((a.float() - b.float()).abs().max()) > 0.1


def _many(dtype: torch.dtype, mla: bool, seed: int = 0) -> dict:
    """64 tokens, 8 requests of 8 tokens (uniform), pages of 8 slots, 40 pages: request b owns pages
    4b .. 4b+2 (BAD after), its tokens at slots of page 4b+1; token 7 of each request goes one page past
    its pages (4b+3: nobody's) and must be refused (8 refusals)."""
    g = torch.Generator().manual_seed(seed)
    pg, b_n, qps = 8, 8, 8
    tables = torch.full((b_n, 4), BAD_PAGE_INDEX, dtype=torch.int32)
    slots = []
    for b in range(b_n):
        tables[b, :3] = torch.arange(4 * b, 4 * b + 3)
        slots += [(4 * b + 1) * pg + i for i in range(qps - 1)] + [(4 * b + 3) * pg]
    t = b_n * qps
    common = dict(slot_mapping=torch.tensor(slots, device=DEV), block_tables=tables.to(DEV), qo_indptr=None,
                  tokens_per_seq=qps, refused=torch.zeros(1, dtype=torch.int32, device=DEV))
    rope = 64
    cos, sin = RotaryEmbedding(rope, 10000.0, 8192).cos_sin(torch.randint(0, 8000, (t,), generator=g))
    tab = dict(cos=cos.to(DEV), sin=sin.to(DEV))
    rnd = lambda *s: (3 * torch.randn(*s, generator=g)).to(DEV, dtype)    # noqa: E731
    if mla:
        return dict(q_lat=rnd(t, 16, 512), q_pe=rnd(t, 16, 64 + 8)[:, :, 8:], kv=rnd(t, 600)[:, :576], **tab,
                    norm_weight=(0.5 + torch.rand(512, generator=g)).to(DEV, dtype), eps=1e-6,
                    kv_cache=rnd(40, 1, 1, pg, 576), **common)
    qkv = rnd(t, 20, 64)
    return dict(q=qkv[:, :16], k=qkv[:, 16:18], v=qkv[:, 18:], **tab, kv_cache=rnd(40, 2, 2, pg, 64), **common)


def _agree(fn, ref, triton_fn, args: dict, dtype: torch.dtype, refusals: int, **kw) -> tuple:
    """The kernel's q, cache and count against the Triton form and the torch reference; refused slots
    inside the pool keep their bytes. Returns (q, cache)."""
    q, cache, refused = _run(fn, args, **kw)
    tq, tcache, trefused = _run(triton_fn, args, **kw)
    rq, rcache, rrefused = _run(ref, args, **kw)
    assert refused == trefused == rrefused == refusals
    for got, want in ((q, tq), (cache, tcache), (q, rq), (cache, rcache)):
        _near(got, want)
    return q, cache


def _near(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16: 4 ulps of the value (`_close`); float32: 1e-5 (rsqrt.approx against torch's rsqrt)."""
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        _close(a, b, a.dtype, ulps=4)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gqa_kernel_equals_triton_and_reference(dtype, ragged, normed):
    args, _, slots = _case(dtype, ragged, hq=16, hkv=2, d=64, dev=DEV)
    args["q"], args["k"] = args["q"] * 3, args["k"] * 3
    norms = _norms(args) if normed else None
    q, cache = _agree(cute_rope_append, rope_append_reference, rope_append, args, dtype, 2, head_norms=norms)
    for s, ok in slots:
        if s >= 0 and not ok and s < 12 * P:
            assert torch.equal(cache[s // P, :, :, s % P], args["kv_cache"][s // P, :, :, s % P])
    c, s_ = args["cos"][:, 0], args["sin"][:, 0]
    if normed:   # negative control: a norm over one column fewer
        _far(q, norm_rope_reference(args["q"], c, s_, 63, norms.q_weight[:-1], norms.eps, True))
    _far(q, norm_rope_reference(args["q"], torch.roll(c, 1, 0), torch.roll(s_, 1, 0), 64 if normed else 0,
                                norms.q_weight if normed else None, 1e-5, normed))     # tables one position off


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_kernel_equals_triton_and_reference(dtype, ragged):
    a, _, slots = _mla_case(dtype, ragged, heads=16, rank=512, rope=64, dev=DEV)
    q, cache = _agree(cute_mla_rope_append, mla_rope_append_reference, mla_rope_append, a, dtype, 2)
    t, sl = next((t, sl) for t, (sl, ok) in enumerate(slots) if ok)
    c, s_ = a["cos"][:, 0], a["sin"][:, 0]
    short = norm_rope_reference(a["kv"][:, None, :], c, s_, 511, a["norm_weight"][:-1], a["eps"], True)[:, 0]
    _far(cache[sl // P, 0, 0, sl % P], short[t])                                   # a norm one column short
    _far(q[..., 512:], norm_rope_reference(a["q_pe"], torch.roll(c, 1, 0), torch.roll(s_, 1, 0), 0, None, 1e-6,
                                           False))                                 # tables one position off


@pytest.mark.parametrize("mla", [False, True])
def test_inputs_off_16_bytes_take_narrower_chunks_and_agree(mla):
    """The 64-token case with every row input 2 bytes (one bf16) off its 16-byte alignment: the launch
    picks the scalar chunk (v = 1, its own compiled kernel) and still equals TRITON and the reference."""
    from tensorrt_llm._torch.attention_backend.cute_norm_rope_kernel import vector_width
    args = _many(torch.bfloat16, mla)
    names = ("q_lat", "q_pe", "kv") if mla else ("q", "k", "v")
    assert vector_width(2, [args[n] for n in names], (64,)) == 8
    for name in names:
        x = args[name]
        buf = torch.empty(x.numel() + x.shape[0] + 1, dtype=x.dtype, device=DEV)[1:]       # 2 bytes off
        args[name] = buf[:x.numel()].view(x.shape).copy_(x)
    assert vector_width(2, [args[n] for n in names], (64,)) == 1
    fn, ref, tri = ((cute_mla_rope_append, mla_rope_append_reference, mla_rope_append) if mla else
                    (cute_rope_append, rope_append_reference, rope_append))
    kw = {} if mla else {"head_norms": _norms(args)}
    _agree(fn, ref, tri, args, torch.bfloat16, 8, **kw)


@pytest.mark.parametrize("mla", [False, True])
def test_64_tokens_a_slot_past_its_requests_pages_is_refused_and_counted(mla):
    args = _many(torch.bfloat16, mla)
    fn, ref, tri = ((cute_mla_rope_append, mla_rope_append_reference, mla_rope_append) if mla else
                    (cute_rope_append, rope_append_reference, rope_append))
    kw = {} if mla else {"head_norms": _norms(args)}
    _, cache = _agree(fn, ref, tri, args, torch.bfloat16, 8, **kw)
    for b in range(8):
        assert torch.equal(cache[4 * b + 3], args["kv_cache"][4 * b + 3])       # nobody's page: untouched
    inside = dict(args, slot_mapping=args["slot_mapping"].clone())            # control: in bounds -> written
    inside["slot_mapping"][7::8] -= 2 * 8 - 7                # page 4b+1, offset 7 (free)
    _, cache2, refused = _run(fn, inside, **kw)
    assert refused == 0
    assert not torch.equal(cache2[1, ..., 7, :], args["kv_cache"][1, ..., 7, :])


def test_parameter_weights_and_inputs_that_require_grad():
    args, _, _ = _case(torch.bfloat16, True, hq=16, hkv=2, d=64, dev=DEV)
    norms = _norms(args)
    params = HeadNorms(torch.nn.Parameter(norms.q_weight), torch.nn.Parameter(norms.k_weight), norms.eps)
    with torch.no_grad():
        q, cache, refused = _run(cute_rope_append, args, head_norms=params)
    rq, rcache, _ = _run(rope_append_reference, args, head_norms=norms)
    _near(q, rq)
    _near(cache, rcache)
    assert refused == 2


@pytest.mark.parametrize("mla", [False, True])
def test_captured_in_a_cuda_graph_and_compiled_once_per_signature(mla):
    from tensorrt_llm._torch.attention_backend import cute_rope_append_kernel as kernels
    cached = kernels.compiled_mla_rope_append if mla else kernels.compiled_rope_append
    fn, ref = (cute_mla_rope_append, mla_rope_append_reference) if mla else (cute_rope_append, rope_append_reference)
    args = _many(torch.bfloat16, mla)
    kw = {} if mla else {"head_norms": _norms(args)}
    first = {k: (v[:8] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 64 else v)
             for k, v in args.items()}
    first["block_tables"] = args["block_tables"][:1]
    _run(fn, first, **kw)                                  # compiled here (8 tokens, 1 request)
    misses = cached.cache_info().misses
    start = args["kv_cache"].clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(**args, **kw)                                   # 64 tokens: the same kernel
    torch.cuda.current_stream().wait_stream(side)
    assert cached.cache_info().misses == misses
    with torch.cuda.graph(graph):
        captured = fn(**args, **kw)
    fresh = _many(torch.bfloat16, mla, seed=1)
    for k in ("cos", "sin") + (("q_lat", "q_pe", "kv") if mla else ("q", "k", "v")):
        args[k].copy_(fresh[k])
    args["kv_cache"].copy_(start)
    args["refused"].zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    rq, rcache, _ = _run(ref, dict(args, kv_cache=start), **kw)
    _near(captured, rq)
    _near(args["kv_cache"], rcache)
    assert int(args["refused"]) == 16                      # two replays, 8 refusals each
