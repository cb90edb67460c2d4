"""H200: microseconds per call of the DSpark C++ ops (`cpp/`, `torch.ops.trtllm.*`) against their torch
paths, at decode shapes (batch 1 and 64).

  append   `dspark_paged_kv_append` (page-bounded K / V / latent writes) vs `reference_paged_kv_append`
           (torch: owner lookup, page check, masked scatter) into a page-32 pool, each request owning
           ctx / 32 + 1 pages:
             target_decode  B x 1 token,  3 KV heads x 64 (one plane; bf16 and fp8 e4m3 pools)
             target_verify  B x 9 tokens, 3 KV heads x 64
             mla_latent     B x 8 tokens, one 576-wide latent (the MLA drafter's context rows)
  quant    `dspark_quantize_ue8m0` (per-token 1 x 128 UE8M0 FP8 groups) vs `quantize_blocks_reference`,
           x [B x 8, K] bf16 (the drafter's block rows) for K = 576 and 1536
Per case: "eager" = CUDA-event time of 100 back-to-back calls / 100 (the launch cost included: what an
eager step pays); "graph" = a CUDA graph of 20 calls (launch cost excluded), median of 5 replays
(the torch append cannot be captured: dropping -1 slots reads a count on the host). Both paths'
outputs are compared before timing. Prints JSON lines; --json writes the list.

    . examples/gpu/device_setup.sh && python3 examples/gpu/ops_bench.py --json $OUT/ops.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from cuda_timing import graph_us

from tensorrt_llm._torch.attention_backend.cpp_ops import ops_loaded
from tensorrt_llm._torch.attention_backend.paged_append import paged_kv_append, reference_paged_kv_append
from tensorrt_llm._torch.modules.fp8_block import quantize_blocks, quantize_blocks_reference

P = 32
APPEND = {"target_decode": (1, 3, 64), "target_verify": (9, 3, 64), "mla_latent": (8, 1, 576)}  # q, heads, dim


def _events_us(fn, calls: int = 100, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


def append_case(name: str, batch: int, ctx: int, cache_dtype: torch.dtype, dev: torch.device) -> dict:
    q, heads, dim = APPEND[name]
    own = ctx // P + 1
    pages = batch * own
    cache = torch.zeros(pages, 2, heads, P, dim, dtype=cache_dtype, device=dev)
    values = torch.randn(batch * q, heads, dim, dtype=torch.bfloat16, device=dev)
    tables = torch.arange(pages, dtype=torch.int32, device=dev).view(batch, own)
    pos = ctx - q + torch.arange(q, device=dev)                      # the last q positions of each request
    slots = (tables.long()[:, pos // P] * P + pos % P).reshape(-1)   # [B * q]
    refused = torch.zeros(1, dtype=torch.int32, device=dev)
    ref_cache, ref_refused = cache.clone(), refused.clone()

    def op():
        paged_kv_append(values, cache, slots, tables, None, q, 0, refused)

    def ref():
        reference_paged_kv_append(values, ref_cache, slots, tables, None, q, 0, ref_refused)
    op()
    ref()
    same = (torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
            and int(refused) == int(ref_refused) == 0)
    return {"kind": "append", "case": name, "batch": batch, "ctx": ctx, "cache_dtype": str(cache_dtype)[6:],
            "equal": same, "op_eager_us": _events_us(op), "op_graph_us": graph_us(op),
            "torch_eager_us": _events_us(ref)}


def quant_case(batch: int, k: int, dev: torch.device) -> dict:
    x = torch.randn(batch * 8, k, dtype=torch.bfloat16, device=dev) * 3

    def op():
        return quantize_blocks(x, 1, 128)

    def ref():
        return quantize_blocks_reference(x, 1, 128)
    (qa, sa), (qb, sb) = op(), ref()
    same = torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
    return {"kind": "quant", "case": f"rows {batch * 8} x {k}", "batch": batch, "equal": same,
            "op_eager_us": _events_us(op), "op_graph_us": graph_us(op), "torch_eager_us": _events_us(ref),
            "torch_graph_us": graph_us(ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ops_bench needs a CUDA device")
    if not ops_loaded():
        raise SystemExit("the C++ ops are not built (python3 setup.py build_ext --inplace with nvcc)")
    dev = torch.device("cuda")
    rows = []
    for b in a.batch:
        for name in APPEND:
            for dt in ((torch.bfloat16, torch.float8_e4m3fn) if name == "target_decode" else (torch.bfloat16,)):
                rows.append(append_case(name, b, a.ctx, dt, dev))
                print(json.dumps(rows[-1]), flush=True)
        for k in (576, 1536):
            rows.append(quant_case(b, k, dev))
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
