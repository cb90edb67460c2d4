"""Dense, batched training forward of a DSpark drafter: many anchors per sequence in one pass.

For S sequences (padded to L tokens, captured target hidden of every position) and A anchor
positions a per sequence, anchor i's draft block is ``[t_a, MASK x (B-1)]`` at positions
``a .. a+B-1``. Every drafter layer attends over one key axis per sequence::

    keys:   [ context entries 0 .. L-1 (from context features) | A*B block entries ]
    query (i, j) sees context p  iff  p < a_i        (strictly: t_a enters as block token 0)
                 sees block keys  of anchor i only    (non-causal inside the block)

which is, per anchor, exactly the engine's paged path (``write_context`` of positions
``0..a-1`` + ``forward_block`` of one block); `test_train_dspark.py` checks the two agree.
The drafter's own submodules compute everything (no weights are copied), so gradients land
in the drafter that `save_pretrained` writes. Labels (shift_label): slot j predicts
``t[a+1+j]``; the Markov head sees the true previous token ``t[a+j]`` (teacher forcing).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


# ---- reference mask and labels ----------------------------------------------------------
def build_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int,
                     sliding_window: Optional[int] = None) -> torch.Tensor:
    """Boolean attention mask of the dense training forward.

    anchors: [S, A] int64 anchor positions. Returns [S, A*B, ctx_len + A*B] bool (True = may
    attend); query row ``i*B + j`` is slot j of anchor i; key columns are the ctx_len context
    entries, then the A*B block entries in the same (anchor, slot) order. A sliding window W
    additionally hides keys at positions <= query position - W (the backends' rule).
    """
    s, a = anchors.shape
    dev = anchors.device
    q_pos = (anchors[:, :, None] + torch.arange(block_size, device=dev)).reshape(s, a * block_size)
    ctx_pos = torch.arange(ctx_len, device=dev)
    anchor_of_row = anchors.repeat_interleave(block_size, dim=1)                     # [S, N]
    ctx_vis = ctx_pos[None, None, :] < anchor_of_row[:, :, None]                     # [S, N, L]
    block_of = torch.arange(a, device=dev).repeat_interleave(block_size)             # [N]
    blk_vis = (block_of[:, None] == block_of[None, :]).expand(s, -1, -1)             # [S, N, N]
    if sliding_window is not None:
        ctx_vis = ctx_vis & (ctx_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
        blk_vis = blk_vis & (q_pos[:, None, :] > q_pos[:, :, None] - sliding_window)
    return torch.cat((ctx_vis, blk_vis), dim=-1)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tokens and positions. input_ids [S, L], anchors [S, A] -> ([S, A, B], [S, A, B])."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long,
                     device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return ids, pos


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int, shift_label: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of each block slot and the Markov head's (teacher-forced) previous token.

    input_ids [S, L]; anchors, anchor_valid [S, A]; seq_lens [S]. Returns (labels, prev_ids),
    both [S, A, B] int64. shift_label: slot j predicts ``t[a+1+j]``; otherwise ``t[a+j]`` and
    slot 0 is unused. prev_ids = the token right before each label (slot 0: the anchor).
    Labels past the sequence end, of unused slots or of invalid anchors are IGNORE_INDEX.
    """
    length = input_ids.shape[1]
    pos = anchors[..., None] + (1 if shift_label else 0) + torch.arange(block_size, device=anchors.device)
    valid = (pos < seq_lens[:, None, None]) & anchor_valid[..., None]
    if not shift_label:
        valid[..., 0] = False
    flat = lambda p: p.clamp(0, length - 1).reshape(p.shape[0], -1)   # noqa: E731
    labels = input_ids.gather(1, flat(pos)).view(pos.shape)
    prev = input_ids.gather(1, flat(pos - 1)).view(pos.shape)
    return labels.masked_fill(~valid, IGNORE_INDEX), prev


def sample_anchors(prompt_len: int, seq_len: int, num: int, generator: torch.Generator,
                   full_block: int = 0) -> list[int]:
    """Up to `num` distinct anchors in the response region [prompt_len, seq_len - 2 - full_block].

    An anchor needs at least one label (a + 1 < seq_len); full_block = B - 1 keeps only anchors
    whose whole block of labels lies inside the sequence (held-out acceptance).
    """
    lo, hi = prompt_len, seq_len - 2 - full_block
    if hi < lo:
        return []
    n = hi - lo + 1
    if n <= num:
        return list(range(lo, hi + 1))
    return sorted((torch.randperm(n, generator=generator)[:num] + lo).tolist())


# ---- dense forward -----------------------------------------------------------------------
def _gqa_attention(attn, x, blk_pos, feats, ctx_pos, mask):
    """x [S, N, H] block inputs (normed), feats [S, L, H] context features -> [S, N, H]."""
    s, n, _ = x.shape
    length = feats.shape[1]
    q = attn.q_proj(x).view(s * n, attn.num_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    q = attn.rotary(q, blk_pos.reshape(-1)).view(s, n, attn.num_heads, attn.head_dim)
    kb, vb = attn.project_kv(x.reshape(s * n, -1), blk_pos.reshape(-1))
    kc, vc = attn.project_kv(feats.reshape(s * length, -1), ctx_pos.reshape(-1))
    shape_c, shape_b = (s, length, attn.num_kv_heads, attn.head_dim), (s, n, attn.num_kv_heads, attn.head_dim)
    k = torch.cat((kc.view(shape_c), kb.view(shape_b)), dim=1).transpose(1, 2)
    v = torch.cat((vc.view(shape_c), vb.view(shape_b)), dim=1).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype),
                                       attn_mask=mask[:, None], scale=attn.scale,
                                       enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(o.transpose(1, 2).reshape(s, n, attn.num_heads * attn.head_dim))


def _mla_attention(attn, x, blk_pos, feats, ctx_pos, mask):
    """Un-absorbed MLA (equal to the engine's absorbed kernel): per-head K/V from the latents."""
    s, n, _ = x.shape
    length = feats.shape[1]
    r, nope, heads = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.num_heads
    q_nope, q_pe = attn.project_q(x.reshape(s * n, -1), blk_pos.reshape(-1))
    lat_b = attn.project_latent(x.reshape(s * n, -1), blk_pos.reshape(-1)).view(s, n, -1)
    lat_c = attn.project_latent(feats.reshape(s * length, -1), ctx_pos.reshape(-1)).view(s, length, -1)
    lat = torch.cat((lat_c, lat_b.to(lat_c.dtype)), dim=1)                           # [S, K, R + rope]
    kv = attn.kv_b_proj(lat[..., :r]).view(s, length + n, heads, nope + attn.v_head_dim)
    k_pe = lat[..., None, r:].expand(-1, -1, heads, -1).to(kv.dtype)
    k = torch.cat((kv[..., :nope], k_pe), dim=-1)                                      # [S, K, H, nope+rope]
    v = kv[..., nope:]
    q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1).view(s, n, heads, attn.q_head_dim)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                       v.transpose(1, 2).to(q.dtype), attn_mask=mask[:, None],
                                       scale=attn.scale)
    return attn.o_proj(o.transpose(1, 2).reshape(s, n, heads * attn.v_head_dim))


def train_forward(drafter, features: torch.Tensor, block_ids: torch.Tensor,
                  anchors: torch.Tensor) -> torch.Tensor:
    """Final-normed drafter hidden of every block slot.

    drafter: a DSpark drafter bound to its target (`bind_target`); features [S, L, H] =
    ``drafter.context_features(captured)``; block_ids [S, A, B] (`block_inputs`); anchors
    [S, A]. Returns [S, A, B, H] (drafter dtype, or the autocast dtype).
    """
    cfg = drafter.config
    s, length, _ = features.shape
    a, b = anchors.shape[1], cfg.block_size
    if block_ids.shape != (s, a, b):
        raise ValueError(f"block_ids {tuple(block_ids.shape)} != (S, A, block_size) {(s, a, b)}")
    dev = features.device
    ctx_pos = torch.arange(length, device=dev).expand(s, length)
    blk_pos = (anchors[..., None] + torch.arange(b, device=dev)).reshape(s, a * b)
    if int(blk_pos.max()) >= drafter.rotary.max_positions:
        raise ValueError(f"block position {int(blk_pos.max())} beyond the drafter's rotary table "
                         f"({drafter.rotary.max_positions})")
    embed, _ = drafter._target()
    h = embed(block_ids.reshape(s, a * b)).to(drafter.norm.weight.dtype)
    attend = _mla_attention if cfg.is_mla else _gqa_attention
    masks: dict[Optional[int], torch.Tensor] = {}
    for i, layer in enumerate(drafter.layers):
        window = cfg.layer_sliding_window(i)
        if window not in masks:
            masks[window] = build_block_mask(anchors, length, b, window)
        x = layer.input_layernorm(h)
        h = h + attend(layer.self_attn, x, blk_pos, features, ctx_pos, masks[window])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(s, a, b, -1)


# ---- loss and acceptance -----------------------------------------------------------------
def slot_weights(block_size: int, gamma: float, shift_label: bool = True) -> torch.Tensor:
    """[B] position-decay weights exp(-k / gamma), k = 0 for the first used slot."""
    k = torch.arange(block_size, dtype=torch.float32) - (0 if shift_label else 1)
    w = torch.exp(-k.clamp(min=0) / gamma)
    if not shift_label:
        w[0] = 0.0
    return w


def block_logits(drafter, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
    """hidden [M, H], prev_ids [M] -> logits [M, V] float32 (target lm_head + Markov bias)."""
    logits = drafter.draft_logits(hidden)
    if drafter.markov_head is not None:
        logits = logits + drafter.markov_head(prev_ids)
    return logits


def teacher_positions(anchors: torch.Tensor, block_size: int, shift_label: bool = True) -> torch.Tensor:
    """anchors [S, A] -> [S, A, B]: the position whose target output predicts each slot's label
    (the label position minus one: ``a + j`` with shift_label, else ``a + j - 1``)."""
    return anchors[..., None] + (0 if shift_label else -1) + torch.arange(block_size, device=anchors.device)


def block_loss(drafter, hidden: torch.Tensor, labels: torch.Tensor, prev_ids: torch.Tensor,
               gamma: float, teacher_hidden: Optional[torch.Tensor] = None,
               kd_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Position-decayed cross-entropy over valid slots, optionally mixed with distillation.

    hidden [S, A, B, H]; labels, prev_ids [S, A, B]; teacher_hidden [S, A, B, H]: the target's
    final-normed hidden state predicting each label (`teacher_positions`). Returns (scalar loss,
    stats: 0-d tensors "ce", "acc" and, with distillation, "kl") with
    loss = sum_w((1 - kd) CE + kd KL(target || drafter)) / sum(w) over valid slots,
    w = exp(-slot / gamma). Only valid rows reach the (vocab-wide) lm_head, so padding costs no logits.
    """
    cfg = drafter.config
    w = slot_weights(cfg.block_size, gamma, cfg.shift_label).to(hidden.device)
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()):
        raise ValueError("batch has no valid label (all anchors at the sequence end?)")
    logits = block_logits(drafter, hidden[valid], prev_ids[valid])
    logp = F.log_softmax(logits, dim=-1)                 # shared by CE and KL (one vocab-wide pass)
    ce = F.nll_loss(logp, labels[valid], reduction="none")
    per_slot, stats = ce, {}
    if kd_weight > 0:
        got = None if teacher_hidden is None else tuple(teacher_hidden.shape)
        if got is None or got[:3] != tuple(labels.shape):
            raise ValueError(f"distillation needs teacher_hidden [S, A, B, H] matching labels "
                             f"{tuple(labels.shape)}, got {got}")
        with torch.no_grad():
            t_logp = F.log_softmax(drafter.draft_logits(teacher_hidden[valid]), dim=-1)
        kl = (t_logp.exp() * (t_logp - logp)).sum(-1)
        per_slot = (1 - kd_weight) * ce + kd_weight * kl
        stats["kl"] = kl.detach().mean()
    wv = w.expand_as(labels)[valid]
    loss = (wv * per_slot).sum() / wv.sum()
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels[valid]).float().mean()
        return loss, {"ce": ce.detach().mean(), "acc": acc, **stats}     # 0-d tensors: the caller syncs once


def expected_accept_length(pred: torch.Tensor, labels: torch.Tensor, anchor_valid: torch.Tensor,
                           shift_label: bool = True) -> tuple[float, int]:
    """Greedy acceptance estimate: mean over valid anchors of 1 + sum_k prod_{j<=k} [pred_j == label_j].

    pred, labels [S, A, B] (an IGNORE_INDEX label never matches); anchor_valid [S, A].
    Returns (mean accepted length per verify step, number of anchors). With teacher-forced
    Markov inputs this equals the engine's greedy acceptance: while every earlier draft is
    right, the drafted previous token is the true one.
    """
    first = 0 if shift_label else 1
    hit = ((pred == labels) & (labels != IGNORE_INDEX))[..., first:].long()
    al = 1 + hit.cumprod(dim=-1).sum(-1)                                             # [S, A]
    n = int(anchor_valid.sum())
    return (float(al[anchor_valid].float().mean()) if n else math.nan), n
