"""Decode throughput of a random SmolLM2-shaped Llama: VANILLA vs FLASHINFER vs FLASHINFER + CUDA graphs.

Model: hidden 576, 30 layers, 9 heads / 3 KV heads (head_dim 64), intermediate 1536,
vocab 49152, bf16, random weights (written once with transformers' save_pretrained).
For each batch size B, B requests of a 32-token random prompt decode 128 tokens
(ignore_eos). Decode time = time(generate 129 tokens) - time(generate 1 token), so the
prefill step is excluded; tok/s = B * 128 / decode time. Warm-up runs every batch size
first (flashinfer JIT, graph capture). End-to-end through `LLM`, so per-step host work
(scheduling, metadata, sampling) is included.

    python examples/bench_decode_gpu.py [--batch-sizes 1 16 64] [--out results.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

PROMPT_LEN, NEW_TOKENS = 32, 128
CONFIGS = {"vanilla": ("VANILLA eager", "VANILLA", False),          # key: (row label, backend, graphs)
           "flashinfer": ("FLASHINFER eager", "FLASHINFER", False),
           "flashinfer_graphs": ("FLASHINFER + graphs", "FLASHINFER", True)}


def write_checkpoint(folder: Path) -> Path:
    """Random SmolLM2-135M-shaped Llama + a minimal word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=2048, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):   # fast random init
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    tk = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from tensorrt_llm import SamplingParams
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "a request stopped early"
    return time.perf_counter() - t0


def bench_config(path: Path, backend: str, graphs: bool, batch_sizes: list[int]) -> dict[int, float]:
    from tensorrt_llm import LLM

    top = max(batch_sizes)
    llm = LLM(str(path), device="cuda", attn_backend=backend, use_cuda_graph=graphs, max_batch_size=top,
              kv_cache_config={"max_tokens": top * (PROMPT_LEN + NEW_TOKENS + 64), "tokens_per_block": 32})
    g = torch.Generator().manual_seed(0)
    result = {}
    try:
        for b in batch_sizes:   # warm-up: JIT, graph capture for every bucket used below
            timed_generate(llm, [torch.randint(3, 49152, (PROMPT_LEN,), generator=g).tolist()] * b, 3)
        for b in batch_sizes:
            prompts = [torch.randint(3, 49152, (PROMPT_LEN,), generator=g).tolist() for _ in range(b)]
            t_prefill = timed_generate(llm, prompts, 1)
            t_all = timed_generate(llm, prompts, NEW_TOKENS + 1)
            result[b] = b * NEW_TOKENS / max(t_all - t_prefill, 1e-9)
        engine = llm._bundle.executor.engine
        if engine.graph_runner is not None:
            print(f"  graphs: {engine.graph_runner.graphs.num_captures} captured, "
                  f"{engine.graph_runner.graphs.num_replays} replays, {engine.piecewise.num_steps} piecewise "
                  f"steps, {engine.paths.eager} eager steps", flush=True)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/bench_smollm2_random"))
    ap.add_argument("--out", type=Path, default=None, help="also write the table as JSON")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="which rows to run")
    args = ap.parse_args()
    path = write_checkpoint(args.model_dir)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    table = {}
    for key in args.configs:
        label, backend, graphs = CONFIGS[key]
        t = time.perf_counter()
        table[label] = bench_config(path, backend, graphs, args.batch_sizes)
        print(f"  {label}: done in {time.perf_counter() - t:.1f}s", flush=True)
    head = f"{'decode tok/s':<22}" + "".join(f"{'B=' + str(b):>12}" for b in args.batch_sizes)
    print(head)
    for label, row in table.items():
        print(f"{label:<22}" + "".join(f"{row[b]:>12.1f}" for b in args.batch_sizes))
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
