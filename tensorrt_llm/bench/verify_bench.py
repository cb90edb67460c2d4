"""Per-step cost of DSpark verification at T > 0: the rejection samplers side by side.

    python -m tensorrt_llm.bench.verify_bench --batch 1 16 64 --drafts 8 --vocab 49152 [--device cuda]

Each arm verifies B sampling requests with K drafts the way the executor does in one step: one
`DSparkWorker.accept` per request ("torch", "flashinfer"), or one `DSparkWorker.verify_batch` and
then the `accept`s ("batched"). Inputs per request: target logits [K+1, V], the drafter's
distributions q [K, V] (the target's, perturbed, so that about half the drafts are accepted) and
drafts drawn from q. Prints ms per step and the mean accepted drafts per request (the samplers
share one distribution, so those should agree); --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import DSparkDecodingConfig, SamplingParams
from .._torch.attention_backend.resolver import Resolution
from .._torch.attention_backend.vanilla import VanillaAttention
from .._torch.models.modeling_dspark import DSparkForCausalLMBase
from .._torch.models.modeling_llama import LlamaConfig
from .._torch.pyexecutor.llm_request import LlmRequest
from .._torch.pyexecutor.sampler import Sampler, processed_rows
from .._torch.speculative.dspark_worker import DSparkWorker


def make_worker(sampler: str, device: torch.device, vocab: int, drafts: int) -> DSparkWorker:
    """A DSpark worker whose verification path is real (its drafter is a small random one that
    verification never runs)."""
    tc = LlamaConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
                                "tie_word_embeddings": True}, "verify_bench")
    drafter = DSparkForCausalLMBase.random_init("gqa", tc, block_size=drafts)   # shift_label: K = block
    worker = DSparkWorker(DSparkDecodingConfig(speculative_model="unused"), drafter, VanillaAttention(),
                          Resolution("VANILLA", "verify_bench"), device, torch.float32, "verify_bench",
                          rejection_sampler=sampler)
    worker.sampler = Sampler(0, device)
    return worker


def make_inputs(batch: int, drafts: int, vocab: int, device: torch.device, temperature: float, seed: int = 0):
    """(rows [B, K+1, V] target logits, q [B, K, V], draft ids [B, K]) on `device`."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch, drafts + 1, vocab, generator=g) * 4
    noisy = rows[:, :drafts] + torch.randn(batch, drafts, vocab, generator=g) * 0.7
    q = processed_rows(noisy.reshape(-1, vocab), [SamplingParams(temperature=temperature)] * (batch * drafts))
    ids = torch.multinomial(q, 1, generator=g).view(batch, drafts)
    return rows.to(device), q.view(batch, drafts, vocab).to(device), ids


def step(worker: DSparkWorker, reqs: list[LlmRequest], rows: torch.Tensor, q: torch.Tensor,
         ids: torch.Tensor) -> int:
    """One executor step of verification -> accepted drafts over all requests."""
    for b, r in enumerate(reqs):
        r.draft_tokens, r.draft_probs = ids[b].tolist(), q[b]
    verified = worker.verify_batch([(r, rows[b]) for b, r in enumerate(reqs)])
    return sum(len(worker.accept(r, rows[b], None, verified.get(r.request_id))) - 1 for b, r in enumerate(reqs))


def bench(samplers: Sequence[str], batches: Sequence[int], drafts: int, vocab: int, device: torch.device,
          temperature: float, iters: int) -> list[dict]:
    out = []
    for bsz in batches:
        rows, q, ids = make_inputs(bsz, drafts, vocab, device, temperature)
        for name in samplers:
            worker = make_worker(name, device, vocab, drafts)
            params = SamplingParams(max_tokens=1 << 20, temperature=temperature, seed=1)
            reqs = [LlmRequest(i, [1, 2, 3], params.model_copy(update={"seed": 1000 + i})) for i in range(bsz)]
            for _ in range(3):
                step(worker, reqs, rows, q, ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, acc = time.perf_counter(), 0
            for _ in range(iters):
                acc += step(worker, reqs, rows, q, ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ms = (time.perf_counter() - t0) / iters * 1e3
            out.append({"sampler": name, "batch": bsz, "drafts": drafts, "vocab": vocab, "device": str(device),
                        "ms_per_step": ms, "accepted_per_request": acc / (iters * bsz)})
            print(f"| {name} | {bsz} | {ms:.2f} | {acc / (iters * bsz):.2f} |", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", nargs="+", default=None, choices=["torch", "flashinfer", "batched"],
                    help="default: torch and batched, plus flashinfer on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    samplers = a.samplers or (["torch", "flashinfer", "batched"] if device.type == "cuda" else ["torch", "batched"])
    print(f"verification per step, K={a.drafts}, V={a.vocab}, T={a.temperature}, {device}, {a.iters} steps each")
    print("| sampler | batch | ms/step | accepted drafts/request |\n|---|---|---|---|")
    rows = bench(samplers, a.batch, a.drafts, a.vocab, device, a.temperature, a.iters)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "python -m tensorrt_llm.bench.verify_bench",
                                            "args": vars(a), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
