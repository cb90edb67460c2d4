"""H200: microseconds per call of the TRITON (plan-free) and FLASHINFER paged attention at the
engine's shapes, and of FP8BlockLinear against a bf16 linear at the drafter's projection shapes.

Shapes (SmolLM2-135M target, the shipped drafters, page 32, context ~ the MT-Bench median):
  target decode   : B x 1 query,  9 q heads / 3 KV heads x 64, causal
  target verify   : B x 9 queries, same heads, causal
  GQA draft block : B x 8 queries, 16 / 16 heads x 64, non-causal
  MLA draft block : B x 8 queries, 16 heads over one 576-wide latent (512 value), non-causal
TRITON runs with its default KV split (sized by the grid, "triton") and with each count of --splits
("triton_s1", "triton_s2", ...); FLASHINFER with --flashinfer. --configs also times the attention
kernel alone (no K/V append) under every LaunchConfig (rows per program 16 / 32 / 64, 4 / 8 warps,
1-3 stages) against `launch_config`'s choice (the "configs" rows). Per shape, batch and context:
CUDA-event time of a CUDA graph of 20 calls (so launch cost is excluded), median of 5 replays;
FLASHINFER's plan is made once outside the timing, and its host plan time per call is reported
separately. Prints a table; --json writes it.
--rope-append (instead of the attention shapes): the CUTEDSL drafter's fused prep + append (`cute_rope_append`,
`cute_mla_rope_append`) against TRITON's (`rope_append`, `mla_rope_append` given q_lat) at the drafter's
layer shapes: B requests x 8 block tokens, GQA 16 q / 16 KV heads x 64 with head norms (q, k, v views of one
q|k|v buffer), MLA 16 heads, latent 512 + rope 64 (q_pe a view of the q buffer, the latent a view of the
projection output), page 32, each request owning its 13 pages, its block-table row padded with BAD_PAGE_INDEX
to --table-width entries (the engine's rows are as wide as its longest request allows, and the CuTe kernel's
page-ownership check scans the whole row). One JSON line per kind and batch: "graph_us"
and "eager_us" (as --norm-rope) for "cute" and "triton", and the max abs difference of their q outputs.
--w-uv (instead of the attention shapes): the MLA draft block with its output through W_UV at the default
split count and at each --splits count: the attention then `mla_value_projection` (as the engine runs it)
and the attention alone; one JSON line per batch and context with the two graph times per split count.
--norm-rope (instead of the attention shapes): the CuTe DSL norm + RoPE prep kernel (`cute_norm_rope`, the
CUTEDSL drafter backend's; needs nvidia-cutlass-dsl) against its torch path (`norm_rope_reference`) on the
drafter's rows at --batch requests (8 block queries each; 9 committed context tokens each for the context
rows): GQA q heads (16 x 64, read in place from the q|k|v buffer), MLA query rope parts (16 x 64, written at
column 512 of the 576-wide query), MLA block latents (576: 512 normed + 64 rope) and the MLA context
latents of 5 layers (one norm weight per layer). One JSON line per shape and batch: "graph_us" (a CUDA
graph of 20 calls, median of 5 replays: device time) and "eager_us" (wall time per call of 200 eager calls:
with the host's launch cost, what an eager draft step pays), for "cute" and "torch", and the max abs
difference of the two outputs.

    . examples/gpu/device_setup.sh && python3 examples/gpu/attention_bench.py --batch 1 16 64 --ctx 256 512 \
        --splits 1 2 4 8 16 --json $OUT/attn.json
    python3 examples/gpu/attention_bench.py --batch 16 64 --ctx 256 512 --splits --configs --json $OUT/cfg.json
    python3 examples/gpu/attention_bench.py --norm-rope --json $OUT/norm_rope.json
    python3 examples/gpu/attention_bench.py --rope-append --batch 1 16 64 --table-width 13 128 \\
        --json $OUT/rope_append.json
    python3 examples/gpu/attention_bench.py --w-uv --batch 1 4 16 --ctx 256 512 --splits 1 2 4 8 16 \\
        --json $OUT/w_uv.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
from cuda_timing import graph_us

from tensorrt_llm._torch.attention_backend.cute_norm_rope import norm_rope, norm_rope_reference
from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
from tensorrt_llm._torch.attention_backend.triton_paged_kernel import LaunchConfig, default_num_splits, \
    launch_config, paged_attention
from tensorrt_llm._torch.modules.fp8_block import FP8BlockLinear, FP8BlockQuantConfig

P = 32
SHAPES = {  # name: (queries per request, q heads, kv heads, head dim, mla, causal)
    "target_decode": (1, 9, 3, 64, False, True),
    "target_verify": (9, 9, 3, 64, False, True),
    "gqa_draft_block": (8, 16, 16, 64, False, False),
    "mla_draft_block": (8, 16, 1, 576, True, False),
}


def _tensors(name: str, batch: int, ctx: int, dev: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A bf16 cache of batch x pages_per random pages (one spare), the requests' tables in page
    order, and q [batch * qps, Hq, D] -> (cache, table, q, pages_per)."""
    qps, hq, hkv, d, mla, _ = SHAPES[name]
    pages_per = -(-(ctx + qps) // P)
    planes, heads = (1, 1) if mla else (2, hkv)
    cache = torch.randn(batch * pages_per + 1, planes, heads, P, d, device=dev, dtype=torch.bfloat16)
    table = torch.arange(batch * pages_per, device=dev, dtype=torch.int32).view(batch, pages_per)
    q = torch.randn(batch * qps, hq, d, device=dev, dtype=torch.bfloat16)
    return cache, table, q, pages_per


def _case(name: str, batch: int, ctx: int, dev: torch.device, splits: list[int], flashinfer: bool) -> dict:
    qps, hq, hkv, d, mla, causal = SHAPES[name]
    cache, table, q, pages_per = _tensors(name, batch, ctx, dev)
    n_pages = cache.shape[0]
    t = batch * qps
    slots = (table.long()[:, -1:] * P + (ctx % P)).repeat(1, qps).view(-1).clamp(max=n_pages * P - 1)
    md_args = dict(seq_lens=[qps] * batch, num_cached=[ctx] * batch, block_tables=table, slot_mapping=slots,
                   tokens_per_block=P, causal=causal)
    v_dim = 512 if mla else d
    out = {}
    arms = [("triton", TritonAttention())] + [(f"triton_s{n}", TritonAttention(num_splits=n)) for n in splits]
    if flashinfer:
        arms.append(("flashinfer", FlashInferAttention()))
    for label, backend in arms:
        md = AttentionMetadata(**md_args, graph_shape=(batch, qps, pages_per),
                               kv_lens_device=torch.full((batch,), ctx + qps, dtype=torch.int32, device=dev))
        t0 = time.perf_counter()
        backend.prepare(md)
        plan_us = (time.perf_counter() - t0) * 1e6
        if mla:
            lat = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
            fn = lambda b=backend, m=md: b.forward_mla(q, lat, cache, m, 0.1, v_dim)   # noqa: E731
        else:
            kk = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
            fn = lambda b=backend, m=md: b.forward(q, kk, kk, cache, m, 0.1)           # noqa: E731
        fn()                                  # plans (flashinfer) and compiles (triton) outside the graph
        torch.cuda.synchronize()
        out[label] = {"us_per_call": round(graph_us(fn), 2), "host_prepare_us": round(plan_us, 1)}
    return out


def _config_sweep(name: str, batch: int, ctx: int, dev: torch.device) -> dict:
    """us per call of the attention kernel alone (one KV split) under every LaunchConfig, and
    `launch_config`'s choice; a config whose output differs from the default's is marked."""
    qps, hq, hkv, d, mla, causal = SHAPES[name]
    cache, table, q, _ = _tensors(name, batch, ctx, dev)
    lens = torch.full((batch,), ctx + qps, dtype=torch.int32, device=dev)
    v_dim = 512 if mla else d
    default = launch_config(batch * cache.shape[2], qps * (hq // hkv), P, d, 2, mla, dev)
    ref = paged_attention(q, cache, table, lens, 0.1, causal, v_dim, mla, num_splits=1)
    timed = {}
    for bm, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3)):
        cfg = LaunchConfig(bm, warps, stages)
        fn = lambda c=cfg: paged_attention(q, cache, table, lens, 0.1, causal, v_dim, mla,  # noqa: E731
                                           num_splits=1, config=c)
        try:
            ok = (fn().float() - ref.float()).abs().max().item() < 0.05
            timed[f"bm{bm}_w{warps}_s{stages}"] = {"us_per_call": round(graph_us(fn), 2), "matches": ok}
        except Exception as e:       # a config this GPU cannot run (shared memory): recorded as such
            timed[f"bm{bm}_w{warps}_s{stages}"] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    key = f"bm{default.block_m}_w{default.num_warps}_s{default.num_stages}"
    return {"default": key, "configs": timed}


def _w_uv_case(batch: int, ctx: int, dev: torch.device, splits: list[int]) -> dict:
    """The MLA draft block's attention with its output through W_UV [16, 64, 512] (`paged_attention(v_proj=)`:
    the attention, then `mla_value_projection`), and the attention alone, at the default split count and at
    each of `splits`."""
    qps, hq, _, _, _, _ = SHAPES["mla_draft_block"]
    cache, table, q, _ = _tensors("mla_draft_block", batch, ctx, dev)
    lens = torch.full((batch,), ctx + qps, dtype=torch.int32, device=dev)
    w_uv = torch.randn(hq, 64, 512, device=dev, dtype=torch.bfloat16) / 16
    default = default_num_splits(batch * triton.cdiv(qps * hq, launch_config(
        batch, qps * hq, P, cache.shape[-1], 2, True, dev).block_m), dev)
    row = {"shape": "mla_draft_block_w_uv", "batch": batch, "ctx": ctx, "default_splits": default}
    for n in [default] + [n for n in splits if n != default]:
        def attend(v=None, n=n):
            return paged_attention(q, cache, table, lens, 0.1, False, 512, True, num_splits=n, v_proj=v)
        row[f"s{n}"] = {"with_w_uv_us": round(graph_us(lambda: attend(w_uv)), 2),
                        "attention_only_us": round(graph_us(attend), 2)}
    return row


def _linear_case(n: int, k: int, tokens: int, dev: torch.device) -> dict:
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = FP8BlockLinear.from_linear(lin, FP8BlockQuantConfig())
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    return {"bf16_us": round(graph_us(lambda: lin(x)), 2), "fp8_reference_us": round(graph_us(lambda: fp8(x)), 2)}


# name: (rows per request, heads, heads in the input buffer, width, norm_dim, rope_dim, apply_rmsnorm,
#        weight: None | "shared" | "per_head", output width, out_offset)
NORM_ROPE_SHAPES = {
    "gqa_q_heads": (8, 16, 48, 64, 64, 64, True, "shared", 64, 0),
    "mla_q_rope": (8, 16, 16, 64, 0, 64, False, None, 576, 512),
    "mla_block_latent": (8, 1, 1, 576, 512, 64, True, "shared", 576, 0),
    "mla_context_5_layers": (9, 5, 5, 576, 512, 64, True, "per_head", 576, 0),
}


def _eager_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def _norm_rope_case(name: str, batch: int, dev: torch.device) -> dict:
    per_req, heads, buf_heads, width, norm_dim, rope_dim, apply, wkind, out_w, off = NORM_ROPE_SHAPES[name]
    t = batch * per_req
    x = torch.randn(t, buf_heads, width, device=dev, dtype=torch.bfloat16)[:, :heads]
    w = None if wkind is None else torch.randn((norm_dim,) if wkind == "shared" else (heads, norm_dim), device=dev,
                                               dtype=torch.bfloat16)
    cos, sin = (torch.randn(t, rope_dim, device=dev) for _ in range(2))
    out = torch.empty(t, heads, out_w, device=dev, dtype=torch.bfloat16)
    kw = dict(norm_dim=norm_dim, weight=w, eps=1e-6, apply_rmsnorm=apply)
    cute = lambda: norm_rope(x, cos, sin, out, out_offset=off, **kw)                                # noqa: E731
    ref = lambda: out[..., off:off + width].copy_(norm_rope_reference(x, cos, sin, norm_dim, w, 1e-6, apply))  # noqa
    cute()
    got = out[..., off:off + width].clone()
    diff = (got.float() - norm_rope_reference(x, cos, sin, norm_dim, w, 1e-6, apply).float()).abs().max().item()
    return {"shape": name, "batch": batch, "rows": t * heads, "width": width,
            "cute": {"graph_us": round(graph_us(cute), 2), "eager_us": round(_eager_us(cute), 2)},
            "torch": {"graph_us": round(graph_us(ref), 2), "eager_us": round(_eager_us(ref), 2)},
            "max_abs_diff": diff}


def _rope_append_case(kind: str, batch: int, dev: torch.device, table_width: int) -> dict:
    from tensorrt_llm._torch.attention_backend.cute_rope_append import cute_mla_rope_append, cute_rope_append
    from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, HeadNorms
    from tensorrt_llm._torch.attention_backend.triton_rope_append import mla_rope_append, rope_append
    t, page, heads, bf = batch * 8, 32, 16, torch.bfloat16
    own = 1 + 400 // page
    tables = torch.full((batch, max(table_width, own)), BAD_PAGE_INDEX, dtype=torch.int32, device=dev)
    tables[:, :own] = torch.arange(batch * own, dtype=torch.int32, device=dev).view(batch, own)
    pos = 400 + torch.arange(8, device=dev)
    slots = (tables.long()[:, pos // page] * page + pos % page).reshape(-1)
    cos, sin = (torch.randn(t, 1, 64, device=dev) for _ in range(2))
    common = dict(slot_mapping=slots, block_tables=tables, qo_indptr=None, tokens_per_seq=8,
                  refused=torch.zeros(1, dtype=torch.int32, device=dev), cos=cos, sin=sin)
    if kind == "gqa":
        qkv = torch.randn(t, 3 * heads, 64, device=dev, dtype=bf)
        norms = HeadNorms(torch.rand(64, device=dev, dtype=bf) + 0.5, torch.rand(64, device=dev, dtype=bf) + 0.5, 1e-6)
        args = dict(q=qkv[:, :heads], k=qkv[:, heads:2 * heads], v=qkv[:, 2 * heads:], head_norms=norms,
                    kv_cache=torch.zeros(batch * own, 2, heads, page, 64, device=dev, dtype=bf), **common)
        cute, tri = (lambda: cute_rope_append(**args)), (lambda: rope_append(**args))           # noqa: E731
    else:
        qbuf = torch.randn(t, heads, 576, device=dev, dtype=bf)
        proj = torch.randn(t, 576 + 64, device=dev, dtype=bf)
        args = dict(q_lat=qbuf[:, :, :512], q_pe=qbuf[:, :, 512:], kv=proj[:, :576],
                    norm_weight=torch.rand(512, device=dev, dtype=bf) + 0.5, eps=1e-6,
                    kv_cache=torch.zeros(batch * own, 1, 1, page, 576, device=dev, dtype=bf), **common)
        cute, tri = (lambda: cute_mla_rope_append(**args)), (lambda: mla_rope_append(**args))   # noqa: E731
    diff = (cute().float() - tri().float()).abs().max().item()
    return {"kind": kind, "batch": batch, "tokens": t, "table_width": tables.shape[1], "max_abs_diff": diff,
            "cute": {"graph_us": round(graph_us(cute), 2), "eager_us": round(_eager_us(cute), 2)},
            "triton": {"graph_us": round(graph_us(tri), 2), "eager_us": round(_eager_us(tri), 2)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[400], help="cached tokens per request")
    ap.add_argument("--splits", type=int, nargs="*", default=[1], help="fixed KV split counts to time")
    ap.add_argument("--flashinfer", action="store_true", help="also time FLASHINFER (JIT-compiles on a fresh machine)")
    ap.add_argument("--linear", action="store_true", help="also time the FP8 block linear against bf16")
    ap.add_argument("--configs", action="store_true", help="also sweep the kernel's LaunchConfig (module doc)")
    ap.add_argument("--norm-rope", action="store_true", help="time the CuTe DSL norm + RoPE prep (module doc) only")
    ap.add_argument("--rope-append", action="store_true", help="time CUTEDSL's fused prep + append against "
                    "TRITON's only (module doc)")
    ap.add_argument("--table-width", type=int, nargs="+", default=[0], help="--rope-append: block-table entries "
                    "per request, each a case (the 13 owned pages, then BAD_PAGE_INDEX)")
    ap.add_argument("--w-uv", action="store_true", help="time the MLA draft block with W_UV only (module doc)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in NORM_ROPE_SHAPES if a.norm_rope else ():
        for b in a.batch:
            rows.append(_norm_rope_case(name, b, dev))
            print(json.dumps(rows[-1]), flush=True)
    for kind, b, width in itertools.product(("gqa", "mla"), a.batch, a.table_width) if a.rope_append else ():
        rows.append(_rope_append_case(kind, b, dev, width))
        print(json.dumps(rows[-1]), flush=True)
    for b, ctx in itertools.product(a.batch, a.ctx) if a.w_uv else ():
        rows.append(_w_uv_case(b, ctx, dev, a.splits))
        print(json.dumps(rows[-1]), flush=True)
    for name in SHAPES if not (a.norm_rope or a.w_uv or a.rope_append) else ():
        for b in a.batch:
            for ctx in a.ctx:
                r = {"shape": name, "batch": b, "ctx": ctx, **_case(name, b, ctx, dev, a.splits, a.flashinfer)}
                rows.append(r)
                arms = "  ".join(f"{k.removeprefix('triton_')} {v['us_per_call']:6.2f}" for k, v in r.items()
                                 if isinstance(v, dict))
                print(f"{name:16s} B={b:3d} ctx={ctx:4d}  us per call: {arms}", flush=True)
                if a.configs:
                    sw = _config_sweep(name, b, ctx, dev)
                    rows.append({"shape": name, "batch": b, "ctx": ctx, "sweep": sw})
                    ok = sorted((v["us_per_call"], k) for k, v in sw["configs"].items() if v.get("matches"))
                    print(f"    configs: default {sw['default']} {sw['configs'][sw['default']].get('us_per_call')} us;"
                          f" fastest " + ", ".join(f"{k} {us:.1f}" for us, k in ok[:4]), flush=True)
    for n, k in ((576, 576), (384 * 2, 576), (576, 2880)) if a.linear else ():   # q/o, gate+up, fc (5 x 576 -> 576)
        for t in (8, 512):
            r = {"linear": f"{n}x{k}", "tokens": t, **_linear_case(n, k, t, dev)}
            rows.append(r)
            print(f"linear {n}x{k} T={t:4d}  bf16 {r['bf16_us']:7.2f} us   "
                  f"fp8 reference {r['fp8_reference_us']:7.2f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
