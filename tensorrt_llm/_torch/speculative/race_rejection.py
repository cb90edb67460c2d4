"""Batched, seed-stable lossless rejection sampling (the "batched" rejection sampler).

One pass verifies the drafts of every sampling request of a step. The randomness is the
counter-based hash noise of `pyexecutor/sampler.py`: each verify step a request takes two keys
from its own "verify" stream, one for its accept uniforms and one for the token it draws at the
first rejection (or after accepting every draft). A request's committed tokens therefore depend
only on its seed and on how many verify steps it has made, never on which other requests share
the step, and the step needs a single device-to-host copy (the per-request samplers, "torch"
and "flashinfer", sync once per request).

The rule is `verification.rejection_accept`'s: draft i is accepted iff q_i(d_i) > 0 and
u_i * q_i(d_i) < p_i(d_i); at the first rejection n the token is drawn from max(p_n - q_n, 0)
(from p_n when that has no mass); after K acceptances from p_K. The draw is the exponential race
argmax r / E with E ~ Exp(1), which samples r / sum(r) without normalising r.
"""
from __future__ import annotations

import torch

from ..pyexecutor.sampler import mix32, race_noise

_POS_MUL, _POS_ADD = 0x85EBCA6B, 0x165667B1   # position hash constants (other than the vocab hash's)
_M32 = 0xFFFFFFFF


def accept_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B] int64 -> uniforms [B, n] float32 in (0, 1), 24-bit, one per (key, position)."""
    pos = mix32((torch.arange(n, dtype=torch.int64, device=keys.device) * _POS_MUL + _POS_ADD) & _M32)
    h = mix32(keys[:, None] ^ pos[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def race_rejection_accept(draft_ids: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor,
                          target_probs: torch.Tensor, accept_keys: torch.Tensor, residual_keys: torch.Tensor,
                          vocab_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of B requests at once, on their device, without a sync.

    draft_ids [B, K] int64 (entries at or past num_drafts[b] are ignored), num_drafts [B] int64
    (0..K), draft_probs [B, K, V] (the distributions the drafts were drawn from), target_probs
    [B, K+1, V] (the target's processed distributions at the anchor and after each draft; rows
    past num_drafts[b] are ignored), accept_keys / residual_keys [B] int64, vocab_hash [V] int64.
    Returns (accepted [B] int64, token [B] int64): request b commits draft_ids[b, :accepted[b]]
    and then `token[b]`.
    """
    b, k, v = draft_probs.shape
    if draft_ids.shape != (b, k) or target_probs.shape != (b, k + 1, v) or num_drafts.shape != (b,):
        raise ValueError(f"shapes: draft_ids {tuple(draft_ids.shape)} [B, K], num_drafts "
                         f"{tuple(num_drafts.shape)} [B], draft_probs {tuple(draft_probs.shape)} [B, K, V], "
                         f"target_probs {tuple(target_probs.shape)} [B, K+1, V]")
    dev = target_probs.device
    p = target_probs.float()
    q = draft_probs.float()
    valid = torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
    d = draft_ids.clamp(0, v - 1)[..., None]
    p_d = p[:, :k].gather(-1, d).squeeze(-1)
    q_d = q.gather(-1, d).squeeze(-1)
    ok = valid & (q_d > 0) & (accept_uniforms(accept_keys, k) * q_d < p_d)
    accepted = ok.long().cumprod(-1).sum(-1)                     # leading accepted drafts
    rows = torch.arange(b, device=dev)
    p_n = p[rows, accepted]
    q_pad = torch.cat([q, q.new_zeros(b, 1, v)], 1)
    q_n = q_pad[rows, accepted] * (accepted < num_drafts)[:, None]   # no draft at n: draw from p_n
    resid = (p_n - q_n).clamp(min=0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)
    token = (resid / race_noise(residual_keys, vocab_hash)).argmax(-1)
    return accepted, token
