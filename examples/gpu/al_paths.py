"""Acceptance length of one drafter through different engine paths, on the same prompts.

The throughput benchmark's AL depends on the numerics of the path that runs the step (bf16 kernels,
compiled regions, CUDA graphs). This runs the first N MT-Bench first turns one request at a time
(C = 1, T = 0, every request exactly --max-tokens tokens) through each named path and reports, per
path, the pooled AL (1 + accepted / verify steps), the per-prompt AL, the accept histogram and, per
prompt, the first token where the output differs from the first path's (None: identical). A path
whose text equals the reference's but whose AL is lower drafts differently: a drafting error.

    python3 examples/gpu/al_paths.py --model $M --drafter $DRAFTER_GQA --prompts mtbench_prompts.json \\
        --paths prod,graphs_eager_regions,vanilla_eager,prod_fp32 --out $OUT/al_paths.json

Paths: prod (TRITON + CUDA graphs + compiled regions, bf16: the benchmark's), graphs_eager_regions
(no compiled regions), triton_eager (no graphs), vanilla_eager (VANILLA target and drafter, the CPU
reference path, on the GPU), flashinfer_eager (FLASHINFER target and drafter),
triton_target_vanilla_drafter and vanilla_target_triton_drafter (which side's kernels move the AL), and each with a _fp32 suffix in float32 (FLASHINFER cannot run it:
VANILLA and TRITON can). --device cpu with vanilla_eager / vanilla_eager_fp32 for a CPU run.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

PATHS = {
    "prod": dict(attn_backend="TRITON", use_cuda_graph=True, torch_compile_config={"enable_inductor": True}),
    "graphs_eager_regions": dict(attn_backend="TRITON", use_cuda_graph=True),
    "triton_eager": dict(attn_backend="TRITON"),
    "vanilla_eager": dict(attn_backend="VANILLA", drafter_backend="VANILLA"),
    "flashinfer_eager": dict(attn_backend="FLASHINFER", drafter_backend="FLASHINFER"),
    "triton_target_vanilla_drafter": dict(attn_backend="TRITON", drafter_backend="VANILLA"),
    "vanilla_target_triton_drafter": dict(attn_backend="VANILLA", drafter_backend="TRITON"),
}


def path_args(name: str) -> dict:
    base, fp32 = (name[:-5], True) if name.endswith("_fp32") else (name, False)
    if base not in PATHS:
        raise ValueError(f"unknown path {name!r}; known: {sorted(PATHS)} (each also with _fp32)")
    return {**PATHS[base], **({"dtype": "float32"} if fp32 else {})}


def run_path(name: str, a: argparse.Namespace, texts: list[str]) -> tuple[dict, list[list[int]]]:
    from tensorrt_llm import LLM, SamplingParams
    kw = path_args(name)
    spec = {"decoding_type": "DSpark", "speculative_model": a.drafter}
    if "drafter_backend" in kw:
        spec["attention_backend"] = kw.pop("drafter_backend")
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, kv_cache_config={"max_tokens": a.kv_tokens}, max_batch_size=4,
              speculative_config=spec, **kw)
    chat = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    llm.generate(chat[:1], SamplingParams(max_tokens=32, ignore_eos=True))     # warm-up
    start = time.perf_counter()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for p in chat]
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    accepted = sum(o.metrics["num_accepted_drafts"] for o in outs)
    row = {"path": name, "engine_args": path_args(name),
           "acceptance_length": 1 + accepted / max(steps, 1),
           "al_per_prompt": [round(o.metrics["acceptance_length"], 4) for o in outs],
           "accept_histogram": llm.get_stats()["speculative"]["accept_histogram"],
           "startup_s": round(start - t0, 1), "generate_s": round(time.perf_counter() - start, 2)}
    toks = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, toks


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list:
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True, help="prepare_carry.sh's mtbench_prompts.json")
    ap.add_argument("--paths", default="prod,graphs_eager_regions,vanilla_eager,prod_fp32")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--out", required=True, help="JSON report (rewritten after every path)")
    a = ap.parse_args()
    names = [n.strip() for n in a.paths.split(",") if n.strip()]
    for n in names:
        path_args(n)                       # an unknown path fails before any model loads
    texts = json.loads(Path(a.prompts).read_text())["prompts"][:a.num_prompts]
    rows, toks = [], {}
    for n in names:
        row, toks[n] = run_path(n, a, texts)
        row["first_divergence_vs_" + names[0]] = first_divergence(toks[names[0]], toks[n])
        rows.append(row)
        print(f"{n:24s} AL {row['acceptance_length']:.3f}  per prompt {row['al_per_prompt']}  "
              f"first divergence vs {names[0]}: {row['first_divergence_vs_' + names[0]]}", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"num_prompts": len(texts), "max_tokens": a.max_tokens,
                                           "model": a.model, "drafter": a.drafter, "paths": rows}, indent=1))


if __name__ == "__main__":
    main()
