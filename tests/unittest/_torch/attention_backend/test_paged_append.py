"""The page-bounded paged-KV append (`paged_append.py`, C++ `cpp/dspark_ops.cpp` / `.cu`).

CPU: the reference writes exactly the owned slots (uniform and ragged steps, a bf16 and an fp8
pool), skips -1 slots, and refuses a slot in another request's page, past the request's pages or
outside the pool, adding it to the caller's counter (which a second call accumulates, never
zeroes); a plain scatter (the negative control) writes the foreign slot.
The C++ CPU kernel (built here with torch.utils.cpp_extension; skipped without ninja or a
compiler) equals the reference bitwise, counts the same, and for every bad input the C++ message
equals the Python guard's word for word.
GPU: the CUDA kernel equals the reference bitwise and runs inside a captured CUDA graph, whose
replays accumulate into the counter (the op launches no fill of its own).
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, write_slots
from tensorrt_llm._torch.attention_backend.paged_append import check_paged_kv_append, reference_paged_kv_append

P, H, D = 4, 2, 8


def _case(dev="cpu", cache_dtype=torch.bfloat16, value_dtype=torch.bfloat16, ragged=False, seed=0):
    """Two requests on a 10-page pool: request 0 owns pages 3, 7; request 1 owns page 5 (its table row
    is BAD past it). Tokens: request 0 writes slots in its pages and one -1; request 1 writes one
    slot in page 5, one in request 0's page 7 (foreign), one past the pool; then expected cache."""
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(10, 2, H, P, D, generator=g) * 0.5).to(cache_dtype)
    tables = torch.tensor([[3, 7, BAD_PAGE_INDEX], [5, BAD_PAGE_INDEX, BAD_PAGE_INDEX]], dtype=torch.int32)
    if ragged:   # request 0: 3 tokens, request 1: 3 tokens
        slots = [3 * P + 1, 7 * P + 2, -1, 5 * P + 0, 7 * P + 3, 10 * P + 1]
        qo = torch.tensor([0, 3, 6], dtype=torch.int32)
        q = 0
    else:        # 3 tokens each as well (uniform)
        slots = [3 * P + 1, 7 * P + 2, -1, 5 * P + 0, 7 * P + 3, 10 * P + 1]
        qo, q = None, 3
    values = (torch.randn(len(slots), H, D, generator=g)).to(value_dtype)
    owned = [0, 1, 3]
    want = cache.clone()
    for t in owned:
        s = slots[t]
        want[s // P, 1, :, s % P] = values[t].to(cache_dtype)
    to = lambda x: None if x is None else x.to(dev)   # noqa: E731
    return dict(values=to(values), kv_cache=to(cache), slot_mapping=to(torch.tensor(slots)), block_tables=to(tables),
                qo_indptr=to(qo), tokens_per_seq=q, plane=1, refused=to(torch.zeros(1, dtype=torch.int32))), to(want), 2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("cache_dtype,value_dtype", [(torch.bfloat16, torch.bfloat16),
                                                     (torch.float8_e4m3fn, torch.float32),
                                                     (torch.float8_e5m2, torch.bfloat16)])
def test_reference_writes_owned_slots_and_refuses_the_rest(ragged, cache_dtype, value_dtype):
    args, want, refused = _case(cache_dtype=cache_dtype, value_dtype=value_dtype, ragged=ragged)
    naive = args["kv_cache"].clone()
    check_paged_kv_append(**args)
    reference_paged_kv_append(**args)
    assert args["refused"].tolist() == [refused]
    assert torch.equal(_bytes(args["kv_cache"]), _bytes(want))
    reference_paged_kv_append(**args)                 # the same writes again: the counter accumulates
    assert args["refused"].tolist() == [2 * refused]
    assert torch.equal(_bytes(args["kv_cache"]), _bytes(want))
    # negative control: a plain scatter of the in-pool slots writes request 0's page from request 1
    keep = args["slot_mapping"] < 10 * P
    write_slots(naive[:, 1], args["values"][keep], args["slot_mapping"][keep])
    assert not torch.equal(_bytes(naive), _bytes(want))


def _bad_inputs():
    """(label, mutation of a valid argument dict, expected message start)."""
    def with_(**kw):
        return lambda a: {**a, **kw}
    return [
        ("values 2-D", lambda a: {**a, "values": a["values"][:, 0]}, "DSpark values must be [T, H, D], got 2-D"),
        ("cache 4-D", lambda a: {**a, "kv_cache": a["kv_cache"][0]}, "DSpark kv_cache must be [pages, planes, H, P, D]"),
        ("values int", lambda a: {**a, "values": a["values"].to(torch.int32)},
         "DSpark values dtype must be one of (BFloat16, Half, Float), got Int"),
        ("cache dtype", lambda a: {**a, "kv_cache": a["kv_cache"].float()},
         "DSpark kv_cache dtype must be the values' (BFloat16) or one of (Float8_e4m3fn, Float8_e5m2), got Float"),
        ("zero pages", lambda a: {**a, "kv_cache": a["kv_cache"][:0]}, "DSpark kv_cache must hold at least one page"),
        ("zero page stride", lambda a: {**a, "kv_cache": a["kv_cache"][:1].expand(4, -1, -1, -1, -1)},
         "DSpark kv_cache page stride must be non-zero, got strides [0, "),
        ("heads", lambda a: {**a, "values": a["values"][:, :1]}, "DSpark num_heads must be the cache's (2), got 1"),
        ("head_dim", lambda a: {**a, "values": a["values"][..., :4]}, "DSpark head_dim must be the cache's (8), got 4"),
        ("plane", with_(plane=2), "DSpark plane must be in [0, 2), got 2"),
        ("slots int32", lambda a: {**a, "slot_mapping": a["slot_mapping"].int()}, "DSpark slot_mapping must be Long, got Int"),
        ("slots shape", lambda a: {**a, "slot_mapping": a["slot_mapping"][:5]}, "DSpark slot_mapping must be [6], got [5]"),
        ("tables int64", lambda a: {**a, "block_tables": a["block_tables"].long()},
         "DSpark block_tables must be Int, got Long"),
        ("tables 1-D", lambda a: {**a, "block_tables": a["block_tables"][0]}, "DSpark block_tables must be [B, max_pages], got 1-D"),
        ("qo dtype", with_(qo_indptr=torch.tensor([0, 3, 6])), "DSpark qo_indptr must be Int, got Long"),
        ("qo shape", with_(qo_indptr=torch.tensor([0, 6], dtype=torch.int32)), "DSpark qo_indptr must be [3], got [2]"),
        ("q split", with_(tokens_per_seq=4),
         "DSpark tokens_per_seq must split the 6 tokens over 2 requests without qo_indptr, got 4"),
        ("values strides", lambda a: {**a, "values": a["values"].transpose(1, 2).contiguous().transpose(1, 2)},
         "DSpark values must have contiguous heads and dims (strides [*, 8, 1]), got [16, 1, 2]"),
        ("cache contiguity", lambda a: {**a, "kv_cache": a["kv_cache"].transpose(3, 4).contiguous().transpose(3, 4)},
         "DSpark kv_cache must be contiguous"),
        ("refused int64", lambda a: {**a, "refused": a["refused"].long()}, "DSpark refused must be Int, got Long"),
        ("refused shape", with_(refused=torch.zeros(2, dtype=torch.int32)), "DSpark refused must be [1], got [2]"),
        ("refused 0-D", with_(refused=torch.zeros((), dtype=torch.int32)), "DSpark refused must be [1], got []"),
        ("slots contiguity", lambda a: {**a, "slot_mapping": torch.stack([a["slot_mapping"]] * 2, 1)[:, 0]},
         "DSpark slot_mapping must be contiguous"),
    ]


@pytest.mark.parametrize("label,mutate,msg", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_python_guard_names_the_problem(label, mutate, msg):
    args, _, _ = _case()
    with pytest.raises(ValueError) as e:
        check_paged_kv_append(**mutate(args))
    assert str(e.value).startswith(msg), str(e.value)
    check_paged_kv_append(**args)                      # control: the valid inputs pass


@pytest.fixture(scope="module")
def cpp_op(dspark_ops):
    return dspark_ops.dspark_paged_kv_append


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("cache_dtype,value_dtype", [(torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.float32),
                                                     (torch.float8_e4m3fn, torch.float32)])
def test_cpp_cpu_kernel_equals_the_reference(cpp_op, ragged, cache_dtype, value_dtype):
    args, want, refused = _case(cache_dtype=cache_dtype, value_dtype=value_dtype, ragged=ragged, seed=3)
    if cache_dtype == torch.float32:
        want = None
    ref = dict(args, kv_cache=args["kv_cache"].clone(), refused=args["refused"].clone())
    reference_paged_kv_append(**ref)
    assert ref["refused"].tolist() == [refused]
    assert cpp_op(*args.values()) is None
    assert args["refused"].tolist() == [refused]
    assert torch.equal(_bytes(args["kv_cache"]), _bytes(ref["kv_cache"]))
    if want is not None:
        assert torch.equal(_bytes(args["kv_cache"]), _bytes(want))
    cpp_op(*args.values())                             # again: the caller's counter accumulates
    assert args["refused"].tolist() == [2 * refused]


@pytest.mark.parametrize("label,mutate,msg", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_cpp_messages_equal_the_python_guard(cpp_op, label, mutate, msg):
    args = mutate(_case()[0])
    with pytest.raises(ValueError) as py:
        check_paged_kv_append(**args)
    with pytest.raises(ValueError) as cc:
        cpp_op(*args.values())
    assert str(cc.value).split("\n")[0] == str(py.value), (str(cc.value), str(py.value))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ragged", [False, True])
def test_cuda_kernel_equals_the_reference_in_a_graph(cpp_op, ragged):
    op = cpp_op
    for cache_dtype, value_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.bfloat16)):
        args, want, refused = _case("cuda", cache_dtype, value_dtype, ragged, seed=4)
        ref = dict(args, kv_cache=args["kv_cache"].clone(), refused=args["refused"].clone())
        reference_paged_kv_append(**ref)
        start = args["kv_cache"].clone()
        graph = torch.cuda.CUDAGraph()
        op(*dict(args, kv_cache=start.clone(), refused=torch.zeros_like(args["refused"])).values())   # warm-up
        with torch.cuda.graph(graph):
            op(*args.values())
        args["kv_cache"].copy_(start)
        torch.cuda.synchronize()
        assert args["refused"].tolist() == [0]                            # capture ran nothing
        graph.replay()
        torch.cuda.synchronize()
        assert args["refused"].tolist() == [refused] == ref["refused"].tolist()
        assert torch.equal(_bytes(args["kv_cache"]), _bytes(ref["kv_cache"]))
        assert torch.equal(_bytes(args["kv_cache"]), _bytes(want))
        graph.replay()                               # the graph holds no fill: replays accumulate
        torch.cuda.synchronize()
        assert args["refused"].tolist() == [2 * refused]


@pytest.mark.parametrize("ragged", [False, True])
def test_triton_backend_writes_through_the_op(cpp_op, monkeypatch, ragged):
    """TRITON (Triton's interpreter) writes its K/V through the op once it is loaded: the same cache
    and output as its scatter path; a slot in another request's page is refused by the op (the
    scatter path, the control, writes it)."""
    pytest.importorskip("triton")
    from tensorrt_llm._torch.attention_backend import triton_backend
    from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
    g = torch.Generator().manual_seed(7)
    hkv, d, p = 2, 16, 16
    cache0 = torch.randn(6, 2, hkv, p, d, generator=g)
    tables = torch.tensor([[0, 2], [4, BAD_PAGE_INDEX]], dtype=torch.int32)
    lens = [3, 2] if ragged else [2, 2]
    cached = [20, 5]
    slots = [0 * p + 0, 2 * p + 4, 2 * p + 5][:lens[0]] + [4 * p + 5, 4 * p + 6]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (4, hkv, hkv))

    def run(use_op: bool, foreign: bool = False):
        monkeypatch.setattr(triton_backend, "ops_loaded", lambda: use_op)
        sm = list(slots)
        if foreign:
            sm[-1] = 2 * p + 9          # request 1 writing into request 0's page 2
        md = AttentionMetadata(seq_lens=lens, num_cached=cached, block_tables=tables, slot_mapping=torch.tensor(sm),
                               tokens_per_block=p, causal=True)
        cache = cache0.clone()
        backend = triton_backend.TritonAttention()
        out = backend.forward(q, k, v, cache, md, 0.25)
        return out, cache, backend
    out_op, cache_op, be = run(True)
    out_sc, cache_sc, _ = run(False)
    assert torch.equal(cache_op, cache_sc) and torch.allclose(out_op, out_sc, atol=1e-6)
    assert be.refused_writes() == 0
    _, bad_op, be = run(True, foreign=True)
    _, bad_sc, _ = run(False, foreign=True)
    assert torch.equal(bad_op[2, :, :, 9], cache0[2, :, :, 9])           # the op refused it
    assert be.refused_writes() == 2                                      # the token's K and its V write
    assert not torch.equal(bad_sc[2, :, :, 9], cache0[2, :, :, 9])       # control: the scatter wrote it
