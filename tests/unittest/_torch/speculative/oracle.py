"""Test oracles: one request at a time, plain Python loops (the batched runtime must match these)."""
from __future__ import annotations

from typing import Optional

import torch

V, K = 8, 3
CHI2_P999 = {3: 16.27, 5: 20.52, 7: 24.32}   # chi-square 99.9% quantiles by degrees of freedom


def greedy_accept(draft_ids: list[int], target_logits: torch.Tensor) -> list[int]:
    """target_logits [K+1, V] for [anchor, d1..dK] -> the longest prefix of drafts equal to the
    target's argmax, then the target's own token there."""
    target = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(draft_ids):
        if d != target[i]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def rejection_accept(draft_ids: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: Optional[torch.Generator]) -> list[int]:
    """Lossless speculative sampling of one request: draft i is accepted with probability
    min(1, p(d)/q(d)); on rejection the token is drawn from norm(max(p - q, 0)); after K
    acceptances a bonus token is drawn from p[K]."""
    k = len(draft_ids)
    u = torch.rand(k, generator=generator) if k else None
    out: list[int] = []
    for i, d in enumerate(draft_ids):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and float(u[i]) < min(1.0, p / q):
            out.append(d)
            continue
        resid = (target_probs[i] - draft_probs[i]).clamp(min=0)
        s = float(resid.sum())
        dist = resid / s if s > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator).item()))
    return out


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of observed counts against probabilities."""
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp.clamp(min=1e-9)).sum())


def dists(device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed target p [K+1, V] and drafter q [K, V]."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    return p.to(device), q.to(device)


def emitted_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[K+1] P(n drafts accepted): alpha_i = sum min(p_i, q_i); P(n) = prod_{i<n} alpha_i (1 - alpha_n)."""
    alpha = torch.minimum(p[:K], q).sum(-1).double().cpu()
    out = torch.empty(K + 1, dtype=torch.float64)
    run = 1.0
    for n in range(K):
        out[n] = run * (1 - alpha[n])
        run *= float(alpha[n])
    out[K] = run
    return out


def histograms(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committed rows -> (first-token counts [V], second-token counts [V], accepted-count counts [K+1])."""
    first, second, acc = torch.zeros(V), torch.zeros(V), torch.zeros(K + 1)
    for r in rows:
        first[r[0]] += 1
        if len(r) > 1:
            second[r[1]] += 1
        acc[len(r) - 1] += 1
    return first, second, acc
