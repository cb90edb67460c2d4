"""Per-step cost of DSpark verification: the RejectionSampler over a step's requests.

    python -m tensorrt_llm.bench.verify_bench --batch 1 16 64 --drafts 8 --vocab 49152 [--device cuda]

Each row verifies B requests with K drafts the way the executor does in one step: one
`RejectionSampler.forward` over [B, K+1, V] target logits and one host copy of its [B, K+1] output.
Modes: "greedy" (argmax and running match), "sampled" (T > 0 rejection sampling; the drafter's
distributions q are the target's, perturbed, so that about half the drafts are accepted; drafts are
drawn from q). Prints ms per step and the mean accepted drafts per request; --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..sampling_params import SamplingParams
from .._torch.runtime.sampler import Sampler, processed_rows
from .._torch.speculative.rejection_sampler import RejectionSampler, SpecDecodeMetadata

MODES = ("greedy", "sampled")


def make_meta(mode: str, batch: int, drafts: int, vocab: int, device: torch.device, temperature: float,
              seed: int = 0) -> SpecDecodeMetadata:
    """One step's verify inputs on `device`."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch, drafts + 1, vocab, generator=g) * 4
    noisy = rows[:, :drafts] + torch.randn(batch, drafts, vocab, generator=g) * 0.7
    t = temperature if mode == "sampled" else 1.0
    q = processed_rows(noisy.reshape(-1, vocab), [SamplingParams(temperature=t)] * (batch * drafts))
    ids = torch.multinomial(q, 1, generator=g).view(batch, drafts)
    if mode == "greedy":
        params = [SamplingParams(max_tokens=1 << 20)] * batch
        probs = None
    else:
        params = [SamplingParams(max_tokens=1 << 20, temperature=temperature, seed=1000 + i) for i in range(batch)]
        probs = list(q.view(batch, drafts, vocab).to(device))
    return SpecDecodeMetadata(list(range(batch)), params, ids.to(device), torch.full((batch,), drafts, device=device),
                              rows.to(device), probs)


def bench(modes: Sequence[str], batches: Sequence[int], drafts: int, vocab: int, device: torch.device,
          temperature: float, iters: int) -> list[dict]:
    out = []
    for bsz in batches:
        for mode in modes:
            meta = make_meta(mode, bsz, drafts, vocab, device, temperature)
            sampler = RejectionSampler(Sampler(0, device))

            def step() -> int:
                rows = sampler.forward(meta).tolist()          # the executor's one host copy
                return sum(sum(t != -1 for t in r) - 1 for r in rows)
            for _ in range(3):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, acc = time.perf_counter(), 0
            for _ in range(iters):
                acc += step()
            ms = (time.perf_counter() - t0) / iters * 1e3
            out.append({"mode": mode, "batch": bsz, "drafts": drafts, "vocab": vocab, "device": str(device),
                        "ms_per_step": ms, "accepted_per_request": acc / (iters * bsz)})
            print(f"| {mode} | {bsz} | {ms:.2f} | {acc / (iters * bsz):.2f} |", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    print(f"verification per step, K={a.drafts}, V={a.vocab}, T={a.temperature}, {device}, {a.iters} steps each")
    print("| mode | batch | ms/step | accepted drafts/request |\n|---|---|---|---|")
    rows = bench(a.modes, a.batch, a.drafts, a.vocab, device, a.temperature, a.iters)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "python -m tensorrt_llm.bench.verify_bench",
                                            "args": vars(a), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
