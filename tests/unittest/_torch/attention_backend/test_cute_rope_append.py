"""The CUTEDSL fused prep + append (`cute_rope_append`) on the CPU: its torch reference (what the CPU runs)
against the Triton fused append (`triton_rope_append`, Triton's interpreter) and against rms_norm + the
regions' rotation + the reference append, on `test_triton_rope_append`'s requests (uniform and ragged; a
-1 slot skipped and not counted, a foreign page, a page past the pool: refused, keep their bytes, counted
once per token); a slot one page past its request's pages is refused and counted, the same slot inside
them is written (control). Negative controls: tables one position off and a norm over one column fewer
land far outside the tolerance. Validation: the Triton form's messages, word for word (one shared check).
With nvidia-cutlass-dsl installed: both kernels compile for sm_90a without a GPU. The kernels' numerics
on the H200 are `test_cute_rope_append_gpu.py`'s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.cute_norm_rope import (  # noqa: E402
    dsl_import_error, norm_rope_reference)
from tensorrt_llm._torch.attention_backend.cute_rope_append import (  # noqa: E402
    cute_mla_rope_append, cute_rope_append)
from tensorrt_llm._torch.attention_backend.interface import HeadNorms  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_rope_append import mla_rope_append, rope_append  # noqa: E402

from tests.unittest._torch.attention_backend.test_triton_rope_append import (  # noqa: E402
    P, _case, _close, _expected, _mla_case, _mla_expected, _norms)


def _run(fn, args: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fn on a copy of the cache and a fresh counter -> (q, cache, refused)."""
    a = dict(args, kv_cache=args["kv_cache"].clone(), refused=torch.zeros_like(args["refused"]))
    out = fn(**a, **kw)
    return out, a["kv_cache"], int(a["refused"])


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_equals_triton_and_the_reference(dtype, ragged, normed):
    args, rot, slots = _case(dtype, ragged)
    args["q"], args["k"] = args["q"] * 3, args["k"] * 3          # RMS ~3: a skipped norm moves every value
    norms = _norms(args) if normed else None
    want_q, want_cache, want_refused = _expected(args, rot, norms)
    q, cache, refused = _run(cute_rope_append, args, head_norms=norms)
    tq, tcache, trefused = _run(rope_append, args, head_norms=norms)
    assert refused == trefused == int(want_refused) == 2
    ulps = 4 if normed else 1
    _close(q, tq, dtype, ulps)
    _close(cache, tcache, dtype, ulps)
    _close(q, want_q, dtype, ulps)
    _close(cache, want_cache, dtype, ulps)
    for s, ok in slots:                     # refused slots inside the pool keep their bytes
        if s >= 0 and not ok and s < 12 * P:
            assert torch.equal(cache[s // P, :, :, s % P], args["kv_cache"][s // P, :, :, s % P])
    # negative controls: tables one position off; a norm over one column fewer
    shifted = dict(args, cos=torch.roll(args["cos"], 1, 0), sin=torch.roll(args["sin"], 1, 0))
    assert (_run(cute_rope_append, shifted, head_norms=norms)[0].float() - want_q.float()).abs().max() > 0.1
    if normed:
        d, c, s = args["q"].shape[-1], args["cos"][:, 0], args["sin"][:, 0]
        short = norm_rope_reference(args["q"], c, s, d - 1, norms.q_weight[:-1], norms.eps, True)
        assert (q.float() - short.float()).abs().max() > 0.1


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_equals_triton_and_the_reference(dtype, ragged):
    a, rot, slots = _mla_case(dtype, ragged)
    want_q, want_cache, want_refused = _mla_expected(a, rot)
    q, cache, refused = _run(cute_mla_rope_append, a)
    tq, tcache, trefused = _run(mla_rope_append, a)
    assert refused == trefused == int(want_refused) == 2
    for got, ref in ((q, tq), (cache, tcache), (q, want_q), (cache, want_cache)):
        _close(got, ref, dtype, ulps=4)
    shifted = dict(a, cos=torch.roll(a["cos"], 1, 0), sin=torch.roll(a["sin"], 1, 0))
    assert (_run(cute_mla_rope_append, shifted)[0].float() - want_q.float()).abs().max() > 0.1
    rank, c, s = a["q_lat"].shape[-1], a["cos"][:, 0], a["sin"][:, 0]
    short = norm_rope_reference(a["kv"][:, None, :], c, s, rank - 1, a["norm_weight"][:-1], a["eps"], True)[:, 0]
    t, sl = next((t, sl) for t, (sl, ok) in enumerate(slots) if ok)       # a written latent
    assert (cache[sl // P, 0, 0, sl % P].float() - short[t].float()).abs().max() > 0.1


def test_counter_accumulates_over_calls():
    args, _, _ = _case()
    cute_rope_append(**args)
    cute_rope_append(**args)
    assert int(args["refused"]) == 4            # never zeroed: a persistent counter


@pytest.mark.parametrize("mla", [False, True])
def test_a_slot_one_page_past_the_requests_pages_is_refused_and_counted(mla):
    """Request 1 owns page 5 only: its slot moved to page 6 (allocated to nobody, inside the pool) is
    refused (page 6 keeps its bytes, the counter +1); control: the slot on page 5 is written."""
    a, _, _ = (_mla_case if mla else _case)()
    fn = cute_mla_rope_append if mla else cute_rope_append
    t = 2                                      # uniform: tokens 2, 3 are request 1's; token 2 at slot 5P + 1
    assert int(a["slot_mapping"][t]) == 5 * P + 1
    _, base_cache, base = _run(fn, a)
    past = dict(a, slot_mapping=a["slot_mapping"].clone())
    past["slot_mapping"][t] = 6 * P + 1
    _, cache, refused = _run(fn, past)
    assert refused == base + 1
    assert torch.equal(cache[6], a["kv_cache"][6])
    assert torch.equal(cache[5, ..., 1, :], a["kv_cache"][5, ..., 1, :])   # nor its owned slot
    assert not torch.equal(base_cache[5, ..., 1, :], a["kv_cache"][5, ..., 1, :])   # control: written there


def _gqa_bad():
    return [
        (lambda a: a.update(q=a["q"][:, :, :8]), "q"),
        (lambda a: a.update(cos=a["cos"].double()), "cos"),
        (lambda a: a.update(k=a["k"][:3]), "k"),
        (lambda a: a.update(v=a["v"].transpose(1, 2)), "v"),
        (lambda a: a.update(v=a["v"].double()), "v dtype"),
        (lambda a: a.update(kv_cache=a["kv_cache"][:, :1]), "kv_cache"),
        (lambda a: a.update(kv_cache=a["kv_cache"].bfloat16()), "kv_cache dtype"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables"),
        (lambda a: a.update(tokens_per_seq=4), "tokens_per_seq"),
        (lambda a: a.update(refused=a["refused"].long()), "refused"),
        (lambda a: a.update(refused=torch.zeros(2, dtype=torch.int32)), "refused shape"),
        (lambda a: a.update(cos=a["cos"].to("meta")), "cos device"),
    ]


def _message(fn, args: dict, **kw) -> str:
    with pytest.raises(ValueError) as err:
        fn(**args, **kw)
    return str(err.value)


@pytest.mark.parametrize("change,what", _gqa_bad())
def test_validation_is_the_triton_forms_word_for_word(change, what):
    args, _, _ = _case()
    change(args)
    assert _message(cute_rope_append, args) == _message(rope_append, args)


def test_bad_head_norms_and_mla_inputs_are_the_triton_forms_messages():
    args, _, _ = _case()
    good = _norms(args)
    for norms in (HeadNorms(good.q_weight[:8], good.k_weight, 1e-5), HeadNorms(good.q_weight, good.k_weight, 0.0)):
        assert _message(cute_rope_append, args, head_norms=norms) == _message(rope_append, args, head_norms=norms)
    a, _, _ = _mla_case()
    for change in (lambda x: x.update(q_lat=x["q_lat"].transpose(1, 2)), lambda x: x.update(q_pe=x["q_pe"][..., :4]),
                   lambda x: x.update(kv_cache=x["kv_cache"].double()), lambda x: x.update(eps=0.0),
                   lambda x: x.update(norm_weight=x["norm_weight"][:8]), lambda x: x.update(q_pe=x["q_pe"].to("meta")),
                   lambda x: x.update(slot_mapping=x["slot_mapping"][:2])):
        bad = dict(a)
        change(bad)
        msg = _message(cute_mla_rope_append, bad)
        assert msg == _message(mla_rope_append, bad) and msg


# the drafter's signatures: (dtype, Hq, Hkv, D, P, normed, ragged, v) and (dtype, H, R, r, P, ragged, v), v the
# chunk width (16 bytes: 8 bf16, 4 float32; 1 the scalar form, for inputs not 16-byte aligned)
GQA_SIGNATURES = [("bfloat16", 16, 2, 64, 16, True, True, 8), ("bfloat16", 16, 2, 64, 16, True, False, 8),
                  ("float32", 6, 3, 16, 4, False, False, 4), ("bfloat16", 16, 2, 64, 16, True, True, 1)]
MLA_SIGNATURES = [("bfloat16", 16, 512, 64, 16, True, 8), ("bfloat16", 16, 512, 64, 16, False, 8),
                  ("float32", 4, 16, 8, 4, True, 4), ("bfloat16", 16, 512, 64, 16, True, 1)]
COMPILE = """
import json, os, sys, torch
from tensorrt_llm._torch.attention_backend.cute_rope_append_kernel import (compiled_mla_rope_append,
                                                                           compiled_rope_append)
gqa, mla = json.loads(sys.argv[1])
for s in gqa + mla:
    f = (compiled_rope_append if len(s) == 8 else compiled_mla_rope_append)(getattr(torch, s[0]), *s[1:])
    ptx = f.artifacts.PTX
    ptx = open(ptx).read() if os.path.exists(ptx) else ptx
    print(type(f).__name__, ptx.count("ld.global.v4"), ptx.count("st.global.v4"), ptx.count("atom.global.add"))
"""


@pytest.fixture
def sm90a_env(tmp_path):
    """A CPU compile for Hopper: the DSL's target arch (no GPU to ask), a private cache folder, the PTX kept."""
    if dsl_import_error():
        pytest.skip(f"nvidia-cutlass-dsl is not installed here ({dsl_import_error()}); the 'cutedsl' extra "
                    "installs it")
    (tmp_path / "ptx").mkdir()
    return {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_CACHE_DIR": str(tmp_path),
            "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path / "ptx")}


def test_kernels_compile_for_sm90a_without_a_gpu_to_128_bit_accesses(sm90a_env):
    """Every signature compiles for sm90a (TVM FFI convention) with the refusal counter's one atomic add;
    16-byte chunks make the rows' loads and stores 128-bit (ld / st.global.v4), the scalar form has none."""
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([GQA_SIGNATURES, MLA_SIGNATURES])],
                         env=sm90a_env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    sigs = GQA_SIGNATURES + MLA_SIGNATURES
    assert [r[0] for r in rows] == ["TVMFFIJitCompiledFunctionWithKwargs"] * len(sigs), run.stdout
    for sig, (_, loads, stores, atomics) in zip(sigs, rows):
        assert int(atomics) == 1, (sig, atomics)
        if sig[-1] > 1:
            assert int(loads) > 0 and int(stores) > 0, (sig, loads, stores)
        else:
            assert int(loads) == int(stores) == 0, (sig, loads, stores)
