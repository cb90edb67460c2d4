"""One DSpark drafter layer (pre-norm attention + gated MLP), GQA or MLA attention, run through the
drafter's regions when they are set (`dspark_regions`), with its attention inputs handed unnormed and
unrotated to a backend with `fused_rope_append` (`DSparkDecoderLayer.attention`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..attention_backend.interface import AttentionBackend, AttentionMetadata
from ..modules.gated_mlp import GatedMLP
from ..modules.mla import MLAAttention
from ..modules.rms_norm import RMSNorm
from .dspark_config import DSparkModelConfig
from .dspark_regions import DrafterRegions


@dataclass(frozen=True)
class AttentionParts:
    """A layer's attention inputs as its region hands them to a backend with `fused_rope_append`
    (unnormed, unrotated): GQA (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]), views of the q|k|v GEMM's
    output; absorbed MLA (q_first [T, Hq, first], q_pe [T, Hq, rope], raw latent [T, R + rope])."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
        return r.output(*self._output_args(h, self.attention(h, positions, kv_cache, md, backend, rope)))

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
        if rope is not None:
            if not self.fuses_rope_append(backend):
                raise ValueError(f"a fused RoPE append needs a layer with regions (GQA: q / k norms; MLA: absorbed) "
                                 f"on a backend with fused_rope_append ({backend.name})")
            return self.attend_parts(self.attention_parts(h), rope, kv_cache, md, backend)
        tables = a.rotary.tables(positions.device)
        if isinstance(a, MLAAttention):
            if not a.absorb:
                return a.attend(n(h), positions, kv_cache, md, backend)
            q, latent = r.mla_attention_inputs(h, *self._parts_args(), a.absorbed_w_uk(), a.kv_a_layernorm.weight,
                                               positions, *tables, a.rotary.interleaved)
            return a.attend_absorbed(q, latent, kv_cache, md, backend)
        q, k, v = r.gqa_attention_inputs(h, n.weight, *a._qkv, a.q_norm.weight, a.k_norm.weight, n.eps, positions,
                                         *tables, a.rotary.interleaved, a.num_heads, a.num_kv_heads, a.head_dim)
        return a.core(q, k, v, kv_cache, md, backend)

    # ---- the fused-append path, cut at each attention (`DSparkForCausalLM.forward_block`) ----------
    def attention_parts(self, h: torch.Tensor) -> AttentionParts:
        """h [T, hidden] residual stream -> this layer's `AttentionParts` (a `fuses_rope_append` layer)."""
        r = self.regions
        region = r.mla_attention_parts if isinstance(self.self_attn, MLAAttention) else r.qkv
        return AttentionParts(region(h, *self._parts_args()))

    def attend_parts(self, parts: AttentionParts, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                     md: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The backend's fused norm + RoPE + append, then attention -> the heads' outputs [T, Hq * Dv]."""
        a = self.self_attn
        if isinstance(a, MLAAttention):
            return a.attend_absorbed_rope(*parts.tensors, rope, kv_cache, md, backend)
        return a.core(*parts.tensors, kv_cache, md, backend, rope, a.head_norms())

    def output_then_parts(self, h: torch.Tensor, o: torch.Tensor, nxt: "DSparkDecoderLayer"
                          ) -> tuple[torch.Tensor, AttentionParts]:
        """This layer's output, then `nxt`'s `AttentionParts`, as one region (`output_then_qkv` /
        `mla_output_then_parts`): h [T, hidden], o [T, Hq * Dv] -> (h [T, hidden], nxt's parts)."""
        r = self.regions
        region = r.mla_output_then_parts if isinstance(nxt.self_attn, MLAAttention) else r.output_then_qkv
        h, *p = region(*self._output_args(h, o), *nxt._parts_args())
        return h, AttentionParts(tuple(p))

    def output_then_norm(self, h: torch.Tensor, o: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The last layer's output through the final `norm`, as one region -> final-normed hidden [T, hidden]."""
        return self.regions.output_then_norm(*self._output_args(h, o), norm.weight, norm.eps)

    def _output_args(self, h: torch.Tensor, o: torch.Tensor) -> tuple:
        """`layer_output`'s arguments: (h, o, o_w, norm_w, eps, gate_up_w, down_w)."""
        a, n = self.self_attn, self.post_attention_layernorm
        o_w = a.output_weight() if isinstance(a, MLAAttention) else a.o_proj.weight
        return h, o, o_w, n.weight, n.eps, self.mlp._gate_up, self.mlp.down_proj.weight

    def _parts_args(self) -> tuple:
        """The parts region's arguments after h (`mla_attention_parts` / `qkv`; the joined regions take the
        same after the output's): (norm_w, eps, projection weights..., dims...)."""
        a, n = self.self_attn, self.input_layernorm
        if isinstance(a, MLAAttention):
            return n.weight, n.eps, *a.projection_weights(), *self._mla_dims()
        return n.weight, n.eps, *a._qkv, None, None, a.num_heads, a.num_kv_heads, a.head_dim

    def _mla_dims(self) -> tuple[int, int, int, int]:
        """(heads, q_first_dim, kv_lora_rank, qk_rope_head_dim) of an MLA layer."""
        a = self.self_attn
        return a.num_heads, a.q_first_dim, a.kv_lora_rank, a.qk_rope_head_dim
