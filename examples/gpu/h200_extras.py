"""H200 measurements beside the throughput table (issue: GPU path).

1. MLA draft-context kernel bandwidth: our FLASHINFER `forward_mla` (flashinfer fa3) at B=64
   requests, 8K context, 8 block queries, 16 heads; bytes = latent pages read once.
2. KV capacity at free_gpu_memory_fraction=0.8 for the GQA vs MLA drafter, from the manager's
   own report, next to the formula.
3. Draft step / verify step time of DSpark at batch 1, 16 and 64 (device-synchronized wall
   time around `ModelEngine.forward` of verify steps and `DSparkWorker.draft`).

    python examples/gpu/h200_extras.py --model DIR --gqa DIR --mla DIR --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def mla_bandwidth(batch: int = 64, ctx: int = 8192, q_per_req: int = 8, heads: int = 16,
                  page: int = 64) -> dict:
    from tensorrt_llm._torch.attention_backend.flashinfer_backend import FlashInferAttention
    from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
    dev = torch.device("cuda")
    pages_per = (ctx + q_per_req + page - 1) // page
    n_pages = batch * pages_per
    cache = torch.randn(n_pages, 1, 1, page, 576, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(n_pages, device=dev).to(torch.int32).view(batch, pages_per)
    slots = []
    for b in range(batch):
        for j in range(q_per_req):
            pos = ctx + j
            slots.append(int(perm[b, pos // page]) * page + pos % page)
    md = AttentionMetadata(seq_lens=[q_per_req] * batch, num_cached=[ctx] * batch, block_tables=perm,
                           slot_mapping=torch.tensor(slots, device=dev), tokens_per_block=page,
                           causal=False)
    be = FlashInferAttention()
    be.prepare(md)
    q = torch.randn(batch * q_per_req, heads, 576, dtype=torch.bfloat16, device=dev)
    lat = torch.randn(batch * q_per_req, 576, dtype=torch.bfloat16, device=dev)
    scale = 1 / (128 ** 0.5)
    for _ in range(3):
        be.forward_mla(q, lat, cache, md, scale, 512)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    e0.record()
    for _ in range(iters):
        be.forward_mla(q, lat, cache, md, scale, 512)
    e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / iters
    nbytes = batch * (ctx + q_per_req) * 576 * 2
    return {"batch": batch, "ctx": ctx, "block_queries": q_per_req, "heads": heads, "us": ms * 1000,
            "latent_bytes": nbytes, "TB_per_s": nbytes / ms / 1e9,
            "note": "includes the latent scatter of the block and the per-call plan"}


def capacity(model: str, drafters: dict[str, str]) -> list[dict]:
    from tensorrt_llm import LLM
    rows = []
    for name, path in drafters.items():
        llm = LLM(model, kv_cache_config={"free_gpu_memory_fraction": 0.8},
                  speculative_config={"decoding_type": "DSpark", "speculative_model": path})
        r = llm.capacity_report
        t, d = r["pools"]["target"], r["pools"]["draft"]
        rows.append({"drafter": name, "max_tokens": r["max_tokens"], "num_pages": r["num_pages"],
                     "target_B_per_token": t["bytes_per_token"], "draft_B_per_token": d["bytes_per_token"],
                     "target_shape": t["shape_str"], "draft_shape": d["shape_str"],
                     "backends": r["attention_backend"]})
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    if len(rows) == 2:
        a, b = rows
        formula = (a["target_B_per_token"] + a["draft_B_per_token"]) / (b["target_B_per_token"] + b["draft_B_per_token"])
        rows.append({"ratio_tokens_" + b["drafter"] + "_over_" + a["drafter"]: b["max_tokens"] / a["max_tokens"],
                     "formula": formula})
    return rows


def step_ratio(model: str, drafter: str, batches=(1, 16, 64), new_tokens: int = 128) -> list[dict]:
    from tensorrt_llm import LLM, SamplingParams
    out = []
    llm = LLM(model, attn_backend="FLASHINFER", use_cuda_graph=True, max_batch_size=max(batches),
              kv_cache_config={"max_tokens": 262144},
              speculative_config={"decoding_type": "DSpark", "speculative_model": drafter})
    ex = llm._executor
    timers = {"verify": 0.0, "draft": 0.0, "n_verify": 0, "n_draft": 0}
    eng_fwd, drf = ex.engine.forward, ex.drafter.draft

    def timed_forward(segments):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = eng_fwd(segments)
        torch.cuda.synchronize()
        if all(len(s.token_ids) > 1 and s.num_logits == len(s.token_ids) for s in segments):
            timers["verify"] += time.perf_counter() - t
            timers["n_verify"] += 1
        return r

    def timed_draft(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = drf(*a, **k)
        torch.cuda.synchronize()
        timers["draft"] += time.perf_counter() - t
        timers["n_draft"] += 1
        return r

    ex.engine.forward, ex.drafter.draft = timed_forward, timed_draft
    prompt = llm.apply_chat_template([{"role": "user", "content": "Write a long story about a robot."}])
    for b in batches:
        llm.generate([prompt] * b, SamplingParams(max_tokens=16, ignore_eos=True))   # warm-up / capture
        for k in list(timers):
            timers[k] = 0 if k.startswith("n_") else 0.0
        llm.generate([prompt] * b, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        v = timers["verify"] / max(timers["n_verify"], 1)
        d = timers["draft"] / max(timers["n_draft"], 1)
        g = ex.drafter.graph_runner
        out.append({"batch": b, "verify_ms": v * 1000, "draft_ms": d * 1000, "draft_over_verify": d / v if v else None,
                    "verify_steps": timers["n_verify"], "draft_steps": timers["n_draft"],
                    "draft_graph_replays_total": g.graphs.num_replays if g else 0,
                    "draft_graph_launches_total": g.num_launches if g else None})
    llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gqa", required=True)
    ap.add_argument("--mla", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    res = {}
    for name, fn in [("mla_kernel", lambda: mla_bandwidth()),
                     ("capacity_0.8", lambda: capacity(a.model, {"gqa": a.gqa, "mla": a.mla})),
                     ("step_ratio_mla", lambda: step_ratio(a.model, a.mla)),
                     ("step_ratio_gqa", lambda: step_ratio(a.model, a.gqa))]:
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # keep measuring the rest; report the failure
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"== {name} ({time.perf_counter() - t:.1f} s)\n{json.dumps(res[name], indent=1)}", flush=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
