"""The DSpark drafter's position-wise work as pure functions, optionally compiled by inductor.

The drafter's device step (`DraftGraphRunner.draft_rows`) is, per region::

    features        : fc GEMM -> hidden_norm                                     (context_features)
    gqa_project_kv  : k|v GEMM -> k_norm -> RoPE of k                              (write_context, per layer)
    mla_latent      : kv_a GEMM -> kv_a_layernorm | RoPE of k_pe                    (write_context, per layer)
    gqa_context_kv / mla_context_latents: the same for all layers at once, from stacked weights
                      (write_context when the draft pool's layers are one tensor: one GEMM, one write)
    gqa_attention_inputs: input_layernorm -> q|k|v GEMM -> q_norm, k_norm -> RoPE  (forward_block, per layer)
    qkv             : input_layernorm -> q|k|v GEMM, the target's region unrotated (forward_block on a
                      backend with `fused_rope_append`: the q / k norms and RoPE go in its KV append)
    mla_attention_parts: input_layernorm -> q (q_a, norm, q_b) -> q_nope | q_pe, and the raw
                      latent (kv_a GEMM; without q_lora one GEMM for both): the same backend forms
                      q_nope W_UK, norms, rotates and appends the rest, and takes the attention's
                      output through W_UV (with W_UK folded into q_b / q_proj, `mla_fold_query`,
                      q_lat | q_pe come out of the GEMM)
    mla_attention_inputs: input_layernorm -> q (q_a, norm, q_b) | latent -> RoPE -> q_nope W_UK
    output          : o_proj + residual -> norm -> gate|up SwiGLU -> down + residual (the target's region)
    output_then_qkv / mla_output_then_parts / output_then_norm: a layer's output joined to the next
                      layer's `qkv` (the target's `output_then_inputs`) / `mla_attention_parts`, or to the
                      final norm (forward_block on a backend with `fused_rope_append`: one region between
                      two attentions, so the residual add and the next norm are one kernel)
    greedy_drafts   : lm_head GEMM -> per draft: + Markov bias of the previous pick -> argmax (propose_greedy;
                      on CUDA the compiled regions run it as Triton launches: `dspark_markov_kernel`)
    (on CUDA gqa_context_kv / mla_context_latents and the scatter are one Triton launch after the
    stacked GEMM: `dspark_context_kernel`, `triton_context`)
    draft_addressing: the step's integer work: committed count and anchor per row, context and block
                      positions and slots from the block tables, the block's ids (draft_rows' head)

with attention (the backend) between the inputs and the output of a layer. Eagerly a region is up
to ~20 small kernels (the casts, norms, the rotation's slices and products, residual adds, a Markov
bias and argmax per draft); inductor fuses the work between the GEMMs into a few. The RoPE
tables go in whole with the positions, so their gather fuses into the rotation. Every weight is an
argument: one compiled graph serves all layers (guards are shapes and dtypes); token counts are
dynamic. `eps` is the drafter's rms_norm_eps, which every norm of a drafter layer has.

`DrafterRegions.eager()` runs the same functions uncompiled: what a loaded drafter runs by default
(set with its fused projections), bitwise its module path, and the reference of the compiled one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..attention_backend.interface import device_positions
from ..modules.compiled_regions import LayerRegions, attention_inputs, layer_output, output_then_inputs, \
    split_qkv
from ..modules.rms_norm import rms_norm
from ..modules.rotary_embedding import rope_rotate


def _rope(x: torch.Tensor, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor,
          interleaved: bool) -> torch.Tensor:
    """x [T, H, d] rotated at positions [T] (tables from `RotaryEmbedding.tables`), x's dtype."""
    return rope_rotate(x.float(), cos_t[positions][:, None, :], sin_t[positions][:, None, :], interleaved).to(x.dtype)


def features(target_hidden: torch.Tensor, fc_w: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """target_hidden [N, n * H_target] -> context features [N, H] (fc_w [H, n * H_target])."""
    return rms_norm(F.linear(target_hidden.to(norm_w.dtype), fc_w), norm_w, eps)


def gqa_project_kv(x: torch.Tensor, kv_w: torch.Tensor, kv_b: Optional[torch.Tensor], k_norm_w: torch.Tensor,
                   eps: float, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool,
                   num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> roped k [T, Hkv, D] (k_norm first), v [T, Hkv, D], the halves of one buffer (one
    cache write covers both: `attention_backend.interface.joint_kv`); kv_w [2 Hkv D, H] the k|v rows
    of the fused projection (`Attention.kv_weights`)."""
    t = x.shape[0]
    k, v = F.linear(x, kv_w, kv_b).view(t, 2 * num_kv_heads, head_dim).split(num_kv_heads, dim=1)
    kv = torch.cat((_rope(rms_norm(k, k_norm_w, eps), positions, cos_t, sin_t, interleaved), v), dim=1)
    return kv[:, :num_kv_heads], kv[:, num_kv_heads:]


def _rms_norm_per_layer(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, L, ..., d] normed over d with layer l's weight w[l] ([L, d]), float32 inside, x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float().view((1, w.shape[0]) + (1,) * (x.dim() - 3) + (w.shape[1],))).to(x.dtype)


def gqa_context_kv(x: torch.Tensor, kv_w: torch.Tensor, kv_b: Optional[torch.Tensor], k_norm_w: torch.Tensor,
                   eps: float, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool,
                   num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """`gqa_project_kv` of every layer at once: x [T, H] -> [T, L, 2 Hkv, D] (layer l: its roped,
    k-normed k heads, then its v heads; the draft pool's plane order). kv_w [L * 2 Hkv D, H] the
    layers' k|v rows stacked (kv_b likewise or None), k_norm_w [L, D]: one GEMM and one norm + RoPE
    for all layers (`DSparkForCausalLMBase.write_context`)."""
    t, layers = x.shape[0], k_norm_w.shape[0]
    kv = F.linear(x, kv_w, kv_b).view(t, layers, 2 * num_kv_heads, head_dim)
    k, v = kv.split(num_kv_heads, dim=2)
    k = _rms_norm_per_layer(k, k_norm_w, eps).reshape(t, layers * num_kv_heads, head_dim)
    k = _rope(k, positions, cos_t, sin_t, interleaved).view(t, layers, num_kv_heads, head_dim)
    return torch.cat((k, v), dim=2)


def mla_context_latents(x: torch.Tensor, kv_a_w: torch.Tensor, kv_norm_w: torch.Tensor, eps: float,
                        positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool,
                        kv_lora_rank: int) -> torch.Tensor:
    """`mla_latent` of every layer at once: x [T, H] -> [T, L, R + rope]; kv_a_w [L (R + rope), H] the
    layers' kv_a rows stacked, kv_norm_w [L, R]."""
    t, layers = x.shape[0], kv_norm_w.shape[0]
    lat = F.linear(x, kv_a_w).view(t, layers, -1)
    ckv, k_pe = lat.split([kv_lora_rank, lat.shape[-1] - kv_lora_rank], dim=-1)
    return torch.cat((_rms_norm_per_layer(ckv, kv_norm_w, eps), _rope(k_pe, positions, cos_t, sin_t, interleaved)),
                     dim=-1)


def gqa_attention_inputs(h: torch.Tensor, norm_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],
                         q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
                         cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool, num_heads: int,
                         num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, H] residual stream -> roped q [T, Hq, D], roped k [T, Hkv, D], v [T, Hkv, D], the views of
    one [T, Hq + 2 Hkv, D] buffer (`compiled_regions.split_qkv`): input_layernorm, the fused q|k|v
    GEMM (qkv_w [(Hq + 2 Hkv) D, H]), per-head q/k norms, one RoPE."""
    t = h.shape[0]
    qkv = F.linear(rms_norm(h, norm_w, eps), qkv_w, qkv_b)
    nqk = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :nqk].view(t, num_heads + num_kv_heads, head_dim)
    qk = torch.cat((rms_norm(qk[:, :num_heads], q_norm_w, eps), rms_norm(qk[:, num_heads:], k_norm_w, eps)), dim=1)
    qk = _rope(qk, positions, cos_t, sin_t, interleaved)
    return split_qkv(torch.cat((qk, qkv[:, nqk:].view(t, num_kv_heads, head_dim)), dim=1), num_heads, num_kv_heads)


def _latent_from_kv(kv: torch.Tensor, kv_norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
                    cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool, kv_lora_rank: int) -> torch.Tensor:
    """The kv_a GEMM's output [T, R + rope] = [c_kv | k_pe] -> latent [kv_a_layernorm(c_kv) | RoPE(k_pe)]."""
    ckv, k_pe = kv.split([kv_lora_rank, kv.shape[-1] - kv_lora_rank], dim=-1)
    k_pe = _rope(k_pe[:, None, :], positions, cos_t, sin_t, interleaved)[:, 0]
    return torch.cat((rms_norm(ckv, kv_norm_w, eps), k_pe), dim=-1)


def mla_latent(x: torch.Tensor, kv_a_w: torch.Tensor, kv_norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
               cos_t: torch.Tensor, sin_t: torch.Tensor, interleaved: bool, kv_lora_rank: int) -> torch.Tensor:
    """x [T, H] -> latent [T, R + rope] = [kv_a_layernorm(c_kv) | RoPE(k_pe)] (kv_a_w [R + rope, H])."""
    return _latent_from_kv(F.linear(x, kv_a_w), kv_norm_w, eps, positions, cos_t, sin_t, interleaved, kv_lora_rank)


def mla_attention_parts(h: torch.Tensor, norm_w: torch.Tensor, eps: float, q_a_w: Optional[torch.Tensor],
                        q_a_norm_w: Optional[torch.Tensor], q_w: torch.Tensor, kv_a_w: Optional[torch.Tensor],
                        heads: int, first: int, kv_lora_rank: int, rope_dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, H] residual stream -> (q_first [T, Hq, first], unrotated q_pe [T, Hq, rope], the raw latent
    [T, R + rope] = [c_kv | k_pe] before its norm and rotation): the projections of
    `mla_attention_inputs`, before the W_UK product, which a backend with `fused_rope_append` forms in
    its append (`forward_mla_rope`) with the rotations and the latent's norm.

    q_w: q_proj [Hq (first + rope), H], or q_b_proj after q_a_w / q_a_norm_w (q_lora; both None
    without); first = nope, or R once W_UK is folded into it (`MLAAttention.fold_query`). kv_a_w [R +
    rope, H], or None when q_w holds the kv_a rows after its own (one GEMM,
    `MLAAttention.fuse_projections`). The three are views of the GEMM outputs (contiguous last dims)."""
    t, x = h.shape[0], rms_norm(h, norm_w, eps)
    if kv_a_w is None:
        y = F.linear(x, q_w)
        nq = y.shape[1] - kv_lora_rank - rope_dim
        q, kv = y[:, :nq], y[:, nq:]
    else:
        qx = x if q_a_w is None else rms_norm(F.linear(x, q_a_w), q_a_norm_w, eps)
        q, kv = F.linear(qx, q_w), F.linear(x, kv_a_w)
    q_first, q_pe = q.view(t, heads, first + rope_dim).split([first, rope_dim], -1)
    return q_first, q_pe, kv


def mla_attention_inputs(h: torch.Tensor, norm_w: torch.Tensor, eps: float, q_a_w: Optional[torch.Tensor],
                         q_a_norm_w: Optional[torch.Tensor], q_w: torch.Tensor, kv_a_w: Optional[torch.Tensor],
                         heads: int, first: int, kv_lora_rank: int, rope_dim: int, w_uk: Optional[torch.Tensor],
                         kv_norm_w: torch.Tensor, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor,
                         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, H] residual stream -> (absorbed q [T, Hq, R + rope], latent [T, R + rope]) of an MLA layer:
    `mla_attention_parts` (weights and dims as there), q_nope W_UK (w_uk [Hq, nope, R]; None once
    folded), then the rotations and the latent's norm."""
    q_first, q_pe, kv = mla_attention_parts(h, norm_w, eps, q_a_w, q_a_norm_w, q_w, kv_a_w, heads, first,
                                            kv_lora_rank, rope_dim)
    q_lat = q_first if w_uk is None else torch.einsum("thn,hnr->thr", q_first, w_uk)
    q_pe = _rope(q_pe, positions, cos_t, sin_t, interleaved)
    latent = _latent_from_kv(kv, kv_norm_w, eps, positions, cos_t, sin_t, interleaved, kv_lora_rank)
    return torch.cat((q_lat, q_pe.to(q_lat.dtype)), dim=-1), latent


def mla_output_then_parts(h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                          gate_up_w: torch.Tensor, down_w: torch.Tensor, next_norm_w: torch.Tensor, next_eps: float,
                          q_a_w: Optional[torch.Tensor], q_a_norm_w: Optional[torch.Tensor], q_w: torch.Tensor,
                          kv_a_w: Optional[torch.Tensor], heads: int, first: int, kv_lora_rank: int, rope_dim: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's output (`layer_output`), then the next MLA layer's `mla_attention_parts` (its input norm
    next_norm_w / next_eps, weights and dims as there), as one region: compiled, the residual add and the
    next layer's RMSNorm are one kernel. Returns (h [T, H], q_first, q_pe, raw latent)."""
    h = layer_output(h, o, o_w, norm_w, eps, gate_up_w, down_w)
    return (h, *mla_attention_parts(h, next_norm_w, next_eps, q_a_w, q_a_norm_w, q_w, kv_a_w, heads, first,
                                    kv_lora_rank, rope_dim))


def output_then_norm(h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     gate_up_w: torch.Tensor, down_w: torch.Tensor, final_norm_w: torch.Tensor,
                     final_eps: float) -> torch.Tensor:
    """The last layer's output (`layer_output`) through the final RMSNorm, as one region: compiled, the
    residual add and the norm are one kernel -> final-normed hidden [T, H]."""
    return rms_norm(layer_output(h, o, o_w, norm_w, eps, gate_up_w, down_w), final_norm_w, final_eps)


def greedy_drafts(hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_w: torch.Tensor, lm_b: Optional[torch.Tensor],
                  markov_w1: Optional[torch.Tensor], markov_w2: Optional[torch.Tensor], block_size: int, first: int,
                  num_drafts: int) -> torch.Tensor:
    """The greedy `propose`, ids only: hidden [R * S, H] (S = block_size), anchor_ids [R] -> draft ids
    [R, n] int64 (n = num_drafts, slots first..first+n-1). The biased logits are not returned, so
    compiled they are never written out ([R, n, V] float32 per step; only sampling needs them).

    Draft j is the argmax of lm_head(slot j) + Markov bias of draft j-1 (the anchor for j = 0);
    markov_w1 [V, r] / markov_w2 [V, r] (both None without a Markov head)."""
    r = anchor_ids.shape[0]
    h = hidden.reshape(r, block_size, -1)[:, first:first + num_drafts].reshape(r * num_drafts, -1)
    logits = F.linear(h.to(lm_w.dtype), lm_w, lm_b).float().view(r, num_drafts, -1)
    prev, ids = anchor_ids, []
    for j in range(num_drafts):
        lj = logits[:, j]
        if markov_w1 is not None:
            lj = lj + F.linear(F.embedding(prev, markov_w1), markov_w2).float()
        prev = lj.argmax(-1)
        ids.append(prev)
    return torch.stack(ids, dim=1)


def draft_addressing(start: torch.Tensor, verified: torch.Tensor, block_tables: torch.Tensor, page_size: int,
                     block_size: int, mask_token_id: int, slot_out: torch.Tensor, lens_out: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
    """The device draft step's addressing: start [B] int64 first verified position, verified [B, q]
    int64 (-1 padded), block_tables [B, W] int32 -> (context positions [B, q], context slots [B*q],
    committed [B] (1..q), anchors [B], block positions [B, S], block ids [B, S] = [anchor, MASK x
    (S-1)]); the block's slots [B*S] and KV lengths [B] (start + committed + S) are written into
    slot_out [B*S] / lens_out [B] (the block metadata's: compiled, by the kernels that form them)."""
    ctx_pos, ctx_slots = device_positions(start, verified.shape[1], block_tables, page_size)
    committed = (verified >= 0).sum(1)
    anchors = verified.gather(1, (committed - 1)[:, None])[:, 0]
    new_ctx = start + committed
    blk_pos, blk_slots = device_positions(new_ctx, block_size, block_tables, page_size)
    slot_out.copy_(blk_slots)
    lens_out.copy_(new_ctx + block_size)
    first = torch.arange(block_size, device=start.device)[None, :] == 0
    blk_ids = torch.where(first, anchors[:, None], mask_token_id)
    return ctx_pos, ctx_slots, committed, anchors, blk_pos, blk_ids


@dataclass(frozen=True)
class DrafterRegions:
    """The region functions a drafter calls (eager, or compiled)."""

    features: Callable[..., torch.Tensor]
    gqa_project_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gqa_context_kv: Callable[..., torch.Tensor]
    mla_context_latents: Callable[..., torch.Tensor]
    gqa_attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    mla_latent: Callable[..., torch.Tensor]
    mla_attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    output: Callable[..., torch.Tensor]
    output_then_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    mla_output_then_parts: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    output_then_norm: Callable[..., torch.Tensor]
    greedy_drafts: Callable[..., torch.Tensor]
    draft_addressing: Callable[..., tuple[torch.Tensor, ...]]
    qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    mla_attention_parts: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    compiled: bool
    triton_chain: bool = False     # greedy_drafts is `dspark_markov_kernel.greedy_drafts_triton`
    # a GQA drafter writes the draft context of every layer with `dspark_context_kernel` (after the
    # stacked GEMM) instead of gqa_context_kv and a scatter
    triton_context: bool = False

    @staticmethod
    def eager(triton_chain: bool = False, triton_context: bool = False) -> "DrafterRegions":
        """The region functions uncompiled (bitwise the module path); triton_chain (CUDA): the greedy
        drafts' Markov chain as Triton launches (`dspark_markov_kernel`), as in `inductor`;
        triton_context (CUDA): the draft context write as one Triton launch."""
        drafts = greedy_drafts
        if triton_chain:
            from .dspark_markov_kernel import greedy_drafts_triton
            drafts = greedy_drafts_triton
        return DrafterRegions(features, gqa_project_kv, gqa_context_kv, mla_context_latents, gqa_attention_inputs,
                              mla_latent, mla_attention_inputs, layer_output, output_then_inputs,
                              mla_output_then_parts, output_then_norm, drafts, draft_addressing,
                              attention_inputs, mla_attention_parts, compiled=False, triton_chain=triton_chain,
                              triton_context=triton_context)

    @staticmethod
    def inductor(triton_chain: bool = False, triton_context: bool = False) -> "DrafterRegions":
        """Every region compiled by inductor (dynamic token count), once per process; the layer
        output is the target's compiled region (`LayerRegions.inductor`). triton_chain (CUDA): the
        greedy drafts' Markov chain runs as n + 1 Triton launches (`dspark_markov_kernel`) instead
        of three compiled kernels per draft; triton_context (CUDA): the draft context write as
        one Triton launch (`dspark_context_kernel`)."""
        return _inductor_regions(triton_chain, triton_context)


@functools.cache
def _inductor_regions(triton_chain: bool, triton_context: bool) -> DrafterRegions:
    from ..modules.inductor_passes import compile_region
    c = compile_region
    if triton_chain:
        from .dspark_markov_kernel import greedy_drafts_triton
        drafts = greedy_drafts_triton
    else:
        drafts = c(greedy_drafts)
    target = LayerRegions.inductor()
    return DrafterRegions(c(features), c(gqa_project_kv), c(gqa_context_kv), c(mla_context_latents),
                          c(gqa_attention_inputs), c(mla_latent),
                          c(mla_attention_inputs), target.output, target.output_then_inputs,
                          c(mla_output_then_parts), c(output_then_norm), drafts,
                          c(draft_addressing), target.attention_inputs, c(mla_attention_parts), compiled=True,
                          triton_chain=triton_chain, triton_context=triton_context)
