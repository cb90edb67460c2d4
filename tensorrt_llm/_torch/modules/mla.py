"""Multi-head latent attention (DeepSeek-V2 style) over a paged latent cache.

Each token stores ONE latent row in the pool (shared by all heads)::

    latent = [ kv_a_layernorm(c_kv) (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim) ]

and `kv_b_proj` (kv_lora_rank -> H * (qk_nope + v_head_dim)) decompresses it per head into
W_UK (keys, no-RoPE part) and W_UV (values). Two equivalent paths:

* absorbed (fast): q_nope @ W_UK -> q in latent space, MQA over the latents through
  `backend.forward_mla` (value = latent[:, :kv_lora_rank]), then W_UV and o_proj. For inference
  W_UK can be folded into the q projection (`fold_query`) and W_UV into o_proj (`fold_output`).
* un-absorbed (reference): decompress K/V per head from the gathered latents and run
  standard masked attention per request. Used by tests against the absorbed path.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ..attention_backend.interface import (BAD_PAGE_INDEX, AttentionBackend, AttentionMetadata,
                                           write_slots)
from .rms_norm import RMSNorm
from .rotary_embedding import RotaryEmbedding, yarn_get_mscale


def mla_softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int,
                      rope_scaling: Optional[dict[str, Any]]) -> float:
    """mscale^2 / sqrt(qk_nope + qk_rope), mscale = yarn_get_mscale(factor, mscale_all_dim).

    The scale follows the *un-absorbed* head dim (nope + rope), not the latent width the
    absorbed kernel sees. mscale is 1 unless a YaRN rope_scaling sets `mscale_all_dim`.
    """
    scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        if kind == "yarn" and mscale_all_dim:
            m = yarn_get_mscale(float(rope_scaling["factor"]), float(mscale_all_dim))
            scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V2 MLA: weights use HF names (q_proj | q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, rotary: RotaryEmbedding,
                 q_lora_rank: Optional[int] = None, rms_norm_eps: float = 1e-6,
                 rope_scaling: Optional[dict[str, Any]] = None, absorb: bool = True):
        super().__init__()
        if rotary.rot_dim != qk_rope_head_dim:
            raise ValueError(f"rotary dim {rotary.rot_dim} != qk_rope_head_dim {qk_rope_head_dim}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, self.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.rotary = rotary
        self.scale = mla_softmax_scale(qk_nope_head_dim, qk_rope_head_dim, rope_scaling)
        self.absorb = absorb
        # contiguous W_UK / W_UV, set by post_load_weights (not in the state dict; follow .to())
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        # o_proj through W_UV, [hidden, H * kv_lora_rank], set by fold_output (absorbed path only)
        self.register_buffer("w_o_abs", None, persistent=False)
        # the q projection through W_UK, [H * (kv_lora_rank + rope), q input], set by fold_query (absorbed only)
        self.register_buffer("w_q_abs", None, persistent=False)
        # [q projection rows | kv_a rows] as one weight, set by fuse_projections (no q_lora)
        self._q_kv: Optional[torch.Tensor] = None

    # ---- projections -------------------------------------------------------------------
    def project_latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden], positions: [T] -> latent [T, kv_lora_rank + qk_rope_head_dim]."""
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = self.rotary(k_pe[:, None, :], positions)[:, 0]      # one rope key shared by heads
        return torch.cat((self.kv_a_layernorm(ckv), k_pe), dim=-1)

    def _q_input(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> the q projection's input: x itself for q_proj, q_a_layernorm(q_a_proj(x))
        [T, q_lora_rank] for q_b_proj."""
        return x if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))

    def _q_out_proj(self) -> nn.Module:
        """The module that maps `_q_input` to the heads' q: q_proj, or q_b_proj with q_lora."""
        return self.q_proj if self.q_lora_rank is None else self.q_b_proj

    def project_q(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (q_nope [T, H, nope], roped q_pe [T, H, rope])."""
        q = self._q_out_proj()(self._q_input(x)).view(x.shape[0], self.num_heads, self.q_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, self.rotary(q_pe, positions)

    def project_q_absorbed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> the absorbed attention's q [T, H, kv_lora_rank + rope] = [q_nope W_UK |
        roped q_pe]: the q projection then the per-head W_UK product, or one GEMM once folded (`fold_query`)."""
        if self.w_q_abs is None:
            q_nope, q_pe = self.project_q(x, positions)
            q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk_uv()[0])    # [T, H, R]
        else:
            q = torch.nn.functional.linear(self._q_input(x), self.w_q_abs).view(x.shape[0], self.num_heads, -1)
            q_lat, q_pe = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            q_pe = self.rotary(q_pe, positions)
        return torch.cat((q_lat, q_pe.to(q_lat.dtype)), dim=-1)

    def q_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
                                 Optional[torch.Tensor]]:
        """The absorbed q path's weights: (q_a_proj, q_a_layernorm, q_b_proj, W_UK [H, nope, R]) with q_lora,
        else (None, None, q_proj, W_UK); once folded (`fold_query`) the third is the folded [H (R + rope),
        q input] weight and W_UK is None (already in it)."""
        q_a = (None, None) if self.q_lora_rank is None else (self.q_a_proj.weight, self.q_a_layernorm.weight)
        if self.w_q_abs is not None:
            return *q_a, self.w_q_abs, None
        return *q_a, self._q_out_proj().weight, self.w_uk_uv()[0]

    def fuse_projections(self) -> None:
        """One GEMM for the q projection and kv_a_proj_with_mqa, which both read the normed x (without
        q_lora only; with q_lora, or FP8 block-scaled projections, nothing changes): the weights
        become views of the fused one (`projection_weights`). After `fold_query` the fused q rows are
        the folded weight's; `fold_query` after this fuses again."""
        proj, kv_a = self._q_out_proj(), self.kv_a_proj_with_mqa
        if self.q_lora_rank is not None or not isinstance(proj, nn.Linear) or not isinstance(kv_a, nn.Linear):
            return
        q_w = self.w_q_abs if self.w_q_abs is not None else proj.weight.data
        w = torch.cat((q_w, kv_a.weight.data), 0)
        n = q_w.shape[0]
        if self.w_q_abs is not None:
            self.w_q_abs = w[:n]
        else:
            proj.weight.data = w[:n]
        kv_a.weight.data = w[n:]
        self._q_kv = w

    def projection_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
                                          Optional[torch.Tensor]]:
        """The weights `dspark_regions.mla_attention_parts` takes: (q_a_proj, q_a_layernorm, q weight,
        kv_a_proj_with_mqa) as `q_weights` without W_UK, or (None, None, [q rows | kv_a rows], None) once
        fused (`fuse_projections`)."""
        if self._q_kv is not None:
            return None, None, self._q_kv, None
        return *self.q_weights()[:3], self.kv_a_proj_with_mqa.weight

    @property
    def q_first_dim(self) -> int:
        """Width of each head's first q part: q_nope (qk_nope_head_dim), or q_lat (kv_lora_rank) once
        W_UK is folded into the q projection (`fold_query`)."""
        return self.kv_lora_rank if self.w_q_abs is not None else self.qk_nope_head_dim

    def absorbed_w_uk(self) -> Optional[torch.Tensor]:
        """W_UK [H, nope, R] (contiguous) for the absorbed q, or None once folded into the q projection."""
        return None if self.w_q_abs is not None else self.w_uk_uv()[0].contiguous()

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, R], W_UV [H, v_head_dim, R] (the contiguous copies
        `post_load_weights` made, else views of kv_b_proj)."""
        if self.w_uk is not None:
            return self.w_uk, self.w_uv
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                       self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def post_load_weights(self) -> None:
        """Keep W_UK / W_UV as contiguous buffers (not in the state dict; they follow `.to()`), so the
        absorbed attention does not re-slice kv_b_proj every step. Call after loading, for inference."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                                self.kv_lora_rank)
        self.w_uk = w[:, :self.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, self.qk_nope_head_dim:].contiguous()

    def fold_output(self) -> None:
        """Fold W_UV into o_proj, once after `post_load_weights`, for inference: one [hidden, H x
        kv_lora_rank] weight (`output_weight`) takes the absorbed attention's latent-space output to
        the hidden size in one GEMM, instead of the per-head W_UV product (with its layout copies) and
        then o_proj. Computed in float32, stored in o_proj's dtype. Absorbed attention only."""
        if not self.absorb:
            raise ValueError("fold_output folds W_UV into o_proj for the absorbed attention; this one is "
                             "un-absorbed")
        w_uv = self.w_uk_uv()[1].float()                                      # [H, v, R]
        wo = self.o_proj.weight.float().view(-1, self.num_heads, self.v_head_dim)   # [hidden, H, v]
        self.w_o_abs = torch.einsum("dhv,hvr->dhr", wo, w_uv).reshape(wo.shape[0], -1).to(self.o_proj.weight.dtype)

    def fold_query(self) -> None:
        """Fold W_UK into the q projection, once after `post_load_weights`, for inference: one [H x (R +
        rope), q input] weight (`q_weights`; R = kv_lora_rank) takes the q projection's input (x, or the
        normed q_a output with q_lora) to each head's [q_nope W_UK | q_pe] in one GEMM, instead of the q
        GEMM and then the per-head W_UK product (with its layout copies). Per head the nope rows become
        W_UK^T Wq_nope ([R, q input]), the rope rows stay. Computed in float32, stored in the q
        projection's dtype. Absorbed attention with plain (not FP8 block-scaled) q weights only."""
        if not self.absorb:
            raise ValueError("fold_query folds W_UK into the q projection for the absorbed attention; this one is "
                             "un-absorbed")
        proj = self._q_out_proj()
        if not isinstance(proj, nn.Linear):
            raise ValueError(f"fold_query needs a plain nn.Linear q projection, got {type(proj).__name__}")
        w_uk = self.w_uk_uv()[0].detach().float()                                         # [H, nope, R]
        wq = proj.weight.detach().float().view(self.num_heads, self.q_head_dim, -1)       # [H, nope + rope, in]
        w_lat = torch.einsum("hnr,hni->hri", w_uk, wq[:, :self.qk_nope_head_dim])        # [H, R, in]
        w = torch.cat((w_lat, wq[:, self.qk_nope_head_dim:]), dim=1)                     # [H, R + rope, in]
        self.w_q_abs = w.reshape(-1, wq.shape[-1]).to(proj.weight.dtype)
        if self._q_kv is not None:
            self.fuse_projections()

    def output_weight(self) -> torch.Tensor:
        """The weight that takes `attend`'s output to the hidden size: [hidden, H * kv_lora_rank] once
        folded (`fold_output`), else o_proj's [hidden, H * v_head_dim]."""
        return self.w_o_abs if self.w_o_abs is not None else self.o_proj.weight

    # ---- attention ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, backend: AttentionBackend,
                latent: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (`attend`, then o_proj, or the folded weight: `fold_output`)."""
        o = self.attend(x, positions, kv_cache, md, backend, latent)
        return torch.nn.functional.linear(o, self.w_o_abs) if self.w_o_abs is not None else self.o_proj(o)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata, backend: AttentionBackend,
               latent: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [T, hidden] -> the heads' outputs [T, H * v_head_dim] before o_proj ([T, H * kv_lora_rank]
        in latent space once folded, `fold_output`).

        kv_cache: [num_pages, 1, 1, P, kv_lora_rank + rope]. The new tokens' latents
        (`latent` [T, Dl], or projected from x) are written at md.slot_mapping first.
        """
        if latent is None:
            latent = self.project_latent(x, positions)
        if self.absorb:
            return self.attend_absorbed(self.project_q_absorbed(x, positions), latent, kv_cache, md, backend)
        q_nope, q_pe = self.project_q(x, positions)
        write_slots(kv_cache[:, 0], latent[:, None, :], md.slot_mapping)
        o = self._attend_unabsorbed(q_nope, q_pe, kv_cache, md)
        return o.reshape(x.shape[0], self.num_heads * self.v_head_dim)

    def attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                        backend: AttentionBackend) -> torch.Tensor:
        """The absorbed path from latent space: q [T, H, R + rope] (q_nope W_UK | roped q_pe), the new
        tokens' latents [T, R + rope] (written first) -> [T, H * v_head_dim], before o_proj."""
        return self._from_latent(backend.forward_mla(q, latent, kv_cache, md, self.scale, self.kv_lora_rank))

    def attend_absorbed_rope(self, q_first: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                             rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, md: AttentionMetadata,
                             backend: AttentionBackend) -> torch.Tensor:
        """`attend_absorbed` from unrotated pieces (q_first [T, H, nope] (q_lat [T, H, R] once W_UK is
        folded, `fold_query`), q_pe [T, H, rope], the raw latent kv [T, R + rope]) on a backend with
        `fused_rope_append`: one launch forms q_nope W_UK, rotates, norms (kv_a_layernorm) and appends,
        and the attention's output comes back through W_UV (as it is once folded, `fold_output`).
        rope: (cos, sin) from `rotary.cos_sin`. -> [T, H * v_head_dim] ([T, H * R] once folded)."""
        n = self.kv_a_layernorm
        w_uv = None if self.w_o_abs is not None else self.w_uk_uv()[1].contiguous()
        o = backend.forward_mla_rope(q_first, q_pe, kv, *rope, n.weight, n.eps, kv_cache, md, self.scale,
                                     self.kv_lora_rank, w_uk=self.absorbed_w_uk(), w_uv=w_uv)
        return o.reshape(o.shape[0], -1).to(self.output_weight().dtype)

    def _from_latent(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, H, R] attention output in latent space -> [T, H * v_head_dim] through W_UV, or
        [T, H * R] as it is once W_UV is folded into the output weight (`fold_output`)."""
        if self.w_o_abs is not None:
            return o_lat.reshape(o_lat.shape[0], -1).to(self.w_o_abs.dtype)
        w_uv = self.w_uk_uv()[1]
        o = torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype), w_uv)          # [T, H, v]
        return o.reshape(o_lat.shape[0], self.num_heads * self.v_head_dim)

    def _attend_unabsorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           md: AttentionMetadata) -> torch.Tensor:
        """Reference: per request, decompress every cached latent to per-head K/V.

        q_nope [T, H, nope], q_pe [T, H, rope] -> [T, H, v_head_dim] (float32 math).
        """
        p = kv_cache.shape[3]
        r, nope = self.kv_lora_rank, self.qk_nope_head_dim
        outs, start = [], 0
        for b, (cached, s) in enumerate(zip(md.num_cached, md.seq_lens)):
            kv_len = cached + s
            pages = md.block_tables[b, :math.ceil(kv_len / p)].long()
            if bool((pages == BAD_PAGE_INDEX).any()):
                raise ValueError(f"request {b}: block table has no page for some of its {kv_len} tokens")
            lat = kv_cache[pages, 0, 0].reshape(-1, self.latent_dim)[:kv_len].float()   # [L, Dl]
            kv = torch.nn.functional.linear(lat[:, :r], self.kv_b_proj.weight.float())
            kv = kv.view(kv_len, self.num_heads, nope + self.v_head_dim)
            k = torch.cat((kv[..., :nope], lat[:, None, r:].expand(-1, self.num_heads, -1)), dim=-1)
            v = kv[..., nope:]                                                  # [L, H, v]
            q = torch.cat((q_nope[start:start + s], q_pe[start:start + s]), dim=-1).float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale            # [H, s, L]
            q_pos = cached + torch.arange(s, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            valid = torch.ones(s, kv_len, dtype=torch.bool, device=q.device)
            if md.causal:
                valid &= k_pos <= q_pos
            if md.sliding_window is not None:
                valid &= k_pos > q_pos - md.sliding_window
            probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khv->qhv", probs, v))
            start += s
        return torch.cat(outs, dim=0).to(q_nope.dtype)
