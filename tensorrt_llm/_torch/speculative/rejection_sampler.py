"""RejectionSampler: the one verification path of speculative decoding, every request of a step at once.

For request b with drafts d_1..d_n (n = num_draft_tokens[b] <= K) the target scored the verify
segment [anchor, d_1..d_n] (rows 0..n of its logits). The output row of b is::

    [ d_1 .. d_a | t | -1 ... -1 ]      a = accepted drafts, t = one token from the target
      accepted     ^ recovered (at the first rejection, a < n) or bonus (a == n)

* greedy rows: d_i is accepted while it equals the target's argmax at row i-1; t is the argmax at
  row a (so the committed tokens are exactly what greedy decoding without drafts commits);
* random rows (Leviathan et al. / Chen et al.): d_i is accepted iff q_i(d_i) > 0 and
  u_i * q_i(d_i) < p_i(d_i); the recovered token is drawn from norm(max(p_a - q_a, 0)) (from p_a
  when that has no mass), the bonus from p_n. The committed sequence is distributed exactly as
  sampling the target. A request drafted without probabilities (a deterministic proposal) has
  q = one-hot on its draft, which is the same rule.

A draft id outside [0, V) is never accepted (it is rejected and the target's token is taken
there). Randomness is the counter-based hash noise of `runtime/sampler.py`: per verify step a
random request takes two keys from its own "verify" stream, one for its accept uniforms, one
for its drawn token, so its tokens depend only on its seed and its number of verify steps, never
on which other requests share the step. The sampler runs on the logits' device with no sync; the
caller copies the [B, K+1] output to the host once per step.

The inverse-CDF draw runs in float64 with a 48-bit uniform (a tenth of the exponential race's
cost on a CPU for 64 x 49,152).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from ...sampling_params import SamplingParams
from ..attention_backend.interface import host_ints
from ..runtime.sampler import Sampler, mix32, processed_rows

_POS_MUL, _POS_ADD = 0x85EBCA6B, 0x165667B1   # position hash constants (other than the vocab hash's)
_M32 = 0xFFFFFFFF
_FINE_SALT = 0x27220A95


def accept_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B] int64 -> uniforms [B, n] float32 in (0, 1), one per (key, position).

    23-bit, (m + 0.5) / 2**23: every value is exact in float32 and strictly below 1 (a 24-bit
    grid's top value rounds to 1.0)."""
    pos = mix32((torch.arange(n, dtype=torch.int64, device=keys.device) * _POS_MUL + _POS_ADD) & _M32)
    h = mix32(keys[:, None] ^ pos[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def fine_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """keys [B] int64 -> uniforms [B] float64 in (0, 1) with 48 random bits (two hashes of the key)."""
    h1 = mix32(keys ^ _FINE_SALT)
    h2 = mix32(h1 ^ _POS_ADD)
    return ((h1 >> 8).double() + ((h2 >> 8).double() + 0.5) * (1.0 / (1 << 24))) * (1.0 / (1 << 24))


def batched_rejection_accept(draft_ids: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor,
                          target_probs: torch.Tensor, accept_keys: torch.Tensor, residual_keys: torch.Tensor,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of B requests at once, on their device, without a sync.

    draft_ids [B, K] int64 (entries at or past num_drafts[b] are ignored), num_drafts [B] int64
    (0..K), draft_probs [B, K, V] (the distributions the drafts were drawn from), target_probs
    [B, K+1, V] (the target's processed distributions at the anchor and after each draft; rows
    past num_drafts[b] are ignored), accept_keys / residual_keys [B] int64.
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
    # a draft id outside [0, V) is never accepted (its row is rejected; the target's token is taken)
    valid = ((torch.arange(k, device=dev)[None, :] < num_drafts[:, None])
             & (draft_ids >= 0) & (draft_ids < v))
    d = draft_ids.clamp(0, v - 1)[..., None]
    p_d = p[:, :k].gather(-1, d).squeeze(-1)
    q_d = q.gather(-1, d).squeeze(-1)
    ok = valid & (q_d > 0) & (accept_uniforms(accept_keys, k) * q_d < p_d)
    accepted = ok.long().cumprod(-1).sum(-1)                     # leading accepted drafts
    rows = torch.arange(b, device=dev)
    p_n = p[rows, accepted]
    if k:   # no draft at n (all accepted, or none proposed): q_n = 0, so the draw is from p_n
        q_n = q[rows, accepted.clamp(max=k - 1)] * (accepted < num_drafts)[:, None]
    else:
        q_n = torch.zeros_like(p_n)
    resid = (p_n - q_n).clamp(min=0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)
    # inverse CDF in float64 with a 48-bit uniform: the first token whose cumulative mass exceeds
    # u * total (a token without mass never does; u < 1 keeps the point inside the last bin)
    cdf = resid.double().cumsum(-1)
    point = fine_uniforms(residual_keys) * cdf[:, -1]
    token = torch.searchsorted(cdf, point[:, None], right=True).squeeze(-1).clamp(max=v - 1)
    return accepted, token


@dataclass
class SpecDecodeMetadata:
    """The verify inputs of one step's B generation requests (all tensors on one device)."""

    request_ids: list[int]                  # [B]
    params: list[SamplingParams]            # [B]
    draft_token_ids: torch.Tensor           # [B, K] int64, entries past num_draft_tokens[b] ignored
    num_draft_tokens: torch.Tensor          # [B] int64, 0..K
    target_logits: torch.Tensor             # [B, K+1, V] float32, rows past num_draft_tokens[b] ignored
    draft_probs: Optional[list[Optional[torch.Tensor]]] = None   # [B] of [n_b, V] or None (greedy draft)

    def __post_init__(self) -> None:
        b, k = self.draft_token_ids.shape
        if (self.target_logits.dim() != 3 or self.target_logits.shape[:2] != (b, k + 1)
                or tuple(self.num_draft_tokens.shape) != (b,) or len(self.request_ids) != b
                or len(self.params) != b or (self.draft_probs is not None and len(self.draft_probs) != b)):
            raise ValueError(f"SpecDecodeMetadata shapes: draft_token_ids {tuple(self.draft_token_ids.shape)} "
                             f"[B, K], num_draft_tokens {tuple(self.num_draft_tokens.shape)} [B], target_logits "
                             f"{tuple(self.target_logits.shape)} [B, K+1, V], {len(self.request_ids)} requests")


class RejectionSampler:
    """Verifies a step's drafts, greedy and random rows together (module docstring: the rule)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def forward(self, meta: SpecDecodeMetadata) -> torch.Tensor:
        """-> output token ids [B, K+1] int64 on the logits' device: the accepted drafts, one recovered
        or bonus token, then -1 padding. No sync."""
        logits, ids, n = meta.target_logits, meta.draft_token_ids, meta.num_draft_tokens
        b, k1, v = logits.shape
        k = k1 - 1
        dev = logits.device
        cols = torch.arange(k1, device=dev)
        # greedy rows (every row, overwritten below for random ones): running match with the argmax
        target = logits.argmax(-1)                                           # [B, K+1]
        match = (ids == target[:, :k]) & (cols[None, :k] < n[:, None])
        accepted = match.long().cumprod(-1).sum(-1)                          # [B]
        token = target.gather(1, accepted[:, None]).squeeze(1)
        rand = [i for i, p in enumerate(meta.params) if not p.greedy]
        if rand:
            accepted, token = self._random_rows(meta, rand, accepted, token)
        out = torch.where(cols[None, :] < accepted[:, None], torch.cat([ids, ids.new_zeros(b, 1)], 1),
                          torch.full_like(target, -1))
        out.scatter_(1, accepted[:, None], token[:, None])
        return out

    def _random_rows(self, meta: SpecDecodeMetadata, rand: list[int], accepted: torch.Tensor,
                     token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, (_, k1, v) = meta.target_logits, meta.target_logits.shape
        k, dev = k1 - 1, logits.device
        params = [meta.params[i] for i in rand]
        rids = [meta.request_ids[i] for i in rand]
        at = host_ints(rand, dev)
        # [R, K+1, V] processed target distributions (one SamplingParams per row)
        p = processed_rows(logits[at].reshape(-1, v), [x for x in params for _ in range(k1)]).view(-1, k1, v)
        ids = meta.draft_token_ids[at]
        q = torch.zeros(len(rand), k, v, dtype=torch.float32, device=dev)
        drafted = [meta.draft_probs[i] if meta.draft_probs is not None else None for i in rand]
        with_q = [j for j, x in enumerate(drafted) if x is not None]
        if with_q:   # the drafter's slot distributions, zero past each request's own drafts
            stacked = pad_sequence([drafted[j].float() for j in with_q], batch_first=True)    # [Q, <=K, V]
            q[host_ints(with_q, dev), :stacked.shape[1]] = stacked
        one_hot = [j for j, x in enumerate(drafted) if x is None]
        if one_hot and k:   # a deterministic proposal: q is one-hot on the draft (out-of-vocab ids stay 0)
            oh = host_ints(one_hot, dev)
            d = ids[oh]                                                                      # [O, K]
            q[oh] = torch.zeros(len(one_hot), k, v, device=dev).scatter_(
                2, d.clamp(0, v - 1)[..., None], ((d >= 0) & (d < v)).float()[..., None])
        akeys = self.sampler.stream_keys(rids, params, "verify", dev)
        rkeys = self.sampler.stream_keys(rids, params, "verify", dev)
        a, t = batched_rejection_accept(ids, meta.num_draft_tokens[at], q, p, akeys, rkeys)
        return accepted.index_put((at,), a), token.index_put((at,), t)


def stack_verify_rows(logits: torch.Tensor, offsets: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """logits [N, V] and per request (first row, rows) -> [B, K+1, V] with K+1 = max(counts); a
    request's rows past its own count repeat its last row (they are ignored by the sampler)."""
    k1 = max(counts)
    if all(c == k1 for c in counts) and list(offsets) == list(range(offsets[0], offsets[0] + k1 * len(counts), k1)):
        return logits[offsets[0]:offsets[0] + k1 * len(counts)].view(len(counts), k1, -1)
    idx = [o + min(j, c - 1) for o, c in zip(offsets, counts) for j in range(k1)]
    sel = host_ints(idx, logits.device)
    return logits.index_select(0, sel).view(len(counts), k1, -1)
