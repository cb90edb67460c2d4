"""One DSpark drafter layer (pre-norm attention + gated MLP), GQA or MLA attention, run through the
drafter's regions when they are set (`dspark_regions`), with its attention inputs handed unnormed and
unrotated to a backend with `fused_rope_append` (`DSparkDecoderLayer.attention`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..attention_backend.interface import AttentionBackend, AttentionMetadata
from ..modules.gated_mlp import GatedMLP
from ..modules.mla import MLAAttention
from ..modules.rms_norm import RMSNorm
from .dspark_config import DSparkModelConfig
from .dspark_regions import DrafterRegions


class DSparkDecoderLayer(nn.Module):
    """Pre-norm: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))."""

    def __init__(self, cfg: DSparkModelConfig, self_attn: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.regions: Optional[DrafterRegions] = None   # set with the fused projections (`use_regions`)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, backend: AttentionBackend,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; rope as in `attention`."""
        r = self.regions
        if r is None:
            h = h + self.self_attn(self.input_layernorm(h), positions, kv_cache, md, backend)
            return h + self.mlp(self.post_attention_layernorm(h))
        n, a = self.post_attention_layernorm, self.self_attn
        o_w = a.output_weight() if isinstance(a, MLAAttention) else a.o_proj.weight
        return r.output(h, self.attention(h, positions, kv_cache, md, backend, rope), o_w,
                        n.weight, n.eps, self.mlp._gate_up, self.mlp.down_proj.weight)

    def fuses_rope_append(self, backend: AttentionBackend) -> bool:
        """Whether this layer hands `backend` its attention inputs unnormed and unrotated: a layer with
        regions and half-rotation RoPE on a backend with `fused_rope_append`; GQA with q / k norms
        over the whole head, absorbed MLA with power-of-two latent and rope widths."""
        a = self.self_attn
        if not backend.capabilities.fused_rope_append or self.regions is None or a.rotary.interleaved:
            return False
        if isinstance(a, MLAAttention):
            return a.absorb and all(n >= 2 and not n & (n - 1) for n in (a.kv_lora_rank, a.qk_rope_head_dim))
        return a.q_norm is not None and a.rotary.rot_dim == a.head_dim

    def attention(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                  md: AttentionMetadata, backend: AttentionBackend,
                  rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """h: [T, hidden] residual stream -> the heads' outputs [T, Hq * Dv] (before o_proj), the
        attention inputs through the regions (un-absorbed MLA, the reference, through its module).
        rope: the block's (cos, sin) (`RotaryEmbedding.cos_sin`) where `fuses_rope_append`: the
        backend norms, rotates and appends in one launch (`forward_rope` / `forward_mla_rope`)."""
        a, r, n = self.self_attn, self.regions, self.input_layernorm
        if rope is not None and not self.fuses_rope_append(backend):
            raise ValueError(f"a fused RoPE append needs a layer with regions (GQA: q / k norms; MLA: absorbed) "
                             f"on a backend with fused_rope_append ({backend.name})")
        tables = a.rotary.tables(positions.device)
        if isinstance(a, MLAAttention):
            if not a.absorb:
                return a.attend(n(h), positions, kv_cache, md, backend)
            w = (h, n.weight, n.eps, *a.projection_weights(), a.num_heads, a.q_first_dim, a.kv_lora_rank,
                 a.qk_rope_head_dim)
            if rope is not None:
                return a.attend_absorbed_rope(*r.mla_attention_parts(*w), rope, kv_cache, md, backend)
            q, latent = r.mla_attention_inputs(*w, a.absorbed_w_uk(), a.kv_a_layernorm.weight, positions, *tables,
                                               a.rotary.interleaved)
            return a.attend_absorbed(q, latent, kv_cache, md, backend)
        if rope is not None:
            q, k, v = r.qkv(h, n.weight, n.eps, *a._qkv, None, None, a.num_heads, a.num_kv_heads, a.head_dim)
            return a.core(q, k, v, kv_cache, md, backend, rope, a.head_norms())
        q, k, v = r.gqa_attention_inputs(h, n.weight, *a._qkv, a.q_norm.weight, a.k_norm.weight, n.eps, positions,
                                         *tables, a.rotary.interleaved, a.num_heads, a.num_kv_heads, a.head_dim)
        return a.core(q, k, v, kv_cache, md, backend)
