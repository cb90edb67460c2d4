"""Draft verification: greedy longest-prefix acceptance and lossless rejection sampling."""
from __future__ import annotations

from typing import Optional

import torch


def greedy_accept(draft_ids: list[int], target_logits: torch.Tensor) -> list[int]:
    """target_logits [K+1, V] for inputs [anchor, d1..dK] -> committed tokens.

    Accept the longest prefix where d_i equals the target's argmax, then append the
    target's own token at the first mismatch (or the bonus token after all K).
    """
    return greedy_accept_ids(draft_ids, target_logits.argmax(-1).tolist())


def greedy_accept_ids(draft_ids: list[int], target: list[int]) -> list[int]:
    """Same as `greedy_accept` with the target's argmax ids [K+1] already on the host."""
    out = []
    for i, d in enumerate(draft_ids):
        if d != target[i]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def rejection_accept(draft_ids: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: Optional[torch.Generator]) -> list[int]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    draft_probs [K, V]: the distributions the drafts were sampled from; target_probs
    [K+1, V]: the target's processed distributions. Draft i is accepted with probability
    min(1, p(d)/q(d)); on rejection the token is drawn from norm(max(p - q, 0)); after K
    acceptances a bonus token is drawn from p[K]. The committed sequence is distributed
    exactly as sampling from the target.
    """
    k = len(draft_ids)
    dev = target_probs.device
    u = torch.rand(k, generator=generator, device=dev) if k else None
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
