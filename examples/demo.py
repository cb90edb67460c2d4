"""Main job: chat answers from SmolLM2-135M-Instruct, with the DSpark MLA drafter when shipped.

Run with `make demo` (fetches the model first). Prints each answer, tokens/s, and the
acceptance length (AL) when speculative decoding is on.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.fetch_model import fetch_model

DRAFTERS = Path(__file__).parent / "models"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "Name three fruits that are usually red.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", choices=["mla", "gqa", "none"], default="mla")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    model = fetch_model("smollm2-135m-instruct")
    kwargs = {"kv_cache_config": {"max_tokens": 8192}, "max_seq_len": 2048}
    drafter = DRAFTERS / f"smollm2-135m-dspark-{args.drafter}"
    if args.drafter != "none" and drafter.is_dir():
        kwargs["speculative_config"] = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
        print(f"DSpark drafter: {drafter.name}")
    elif args.drafter != "none":
        print(f"(no shipped drafter at {drafter}; running without speculation)")
    with LLM(str(model), **kwargs) as llm:
        report = llm.capacity_report
        for name, pool in report["pools"].items():
            print(f"KV pool {name}: {pool['shape_str']} ({pool['bytes_per_token']} B/token)")
        params = SamplingParams(max_tokens=args.max_tokens)
        total_tokens, t0 = 0, time.perf_counter()
        for q in PROMPTS:
            prompt = llm.apply_chat_template([{"role": "user", "content": q}])
            t = time.perf_counter()
            out = llm.generate(prompt, params)
            dt = time.perf_counter() - t
            n = len(out.outputs[0].token_ids)
            total_tokens += n
            print(f"\n>>> {q}\n{out.outputs[0].text.strip()}\n[{n} tokens, {n / dt:.1f} tok/s]")
        dt = time.perf_counter() - t0
        print(f"\nTotal: {total_tokens} tokens in {dt:.1f} s = {total_tokens / dt:.1f} tok/s (batch 1)")
        spec = llm.get_stats().get("speculative")
        if spec:
            print(f"DSpark acceptance length (AL): {spec['acceptance_length']:.2f} "
                  f"over {spec['request_steps']} request-steps")


if __name__ == "__main__":
    main()
