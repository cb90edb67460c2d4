"""Llama and Qwen2 causal LMs over the paged KV cache.

The forward takes packed tokens and explicit per-step metadata, and can capture the
residual-stream output (hidden + residual) of chosen decoder layers for a drafter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..attention_backend.interface import AttentionBackend, AttentionMetadata
from ..modules.attention import Attention
from ..modules.compiled_regions import LayerRegions
from ..modules.gated_mlp import GatedMLP
from ..modules.rms_norm import RMSNorm
from ..modules.rotary_embedding import RotaryEmbedding
from .checkpoint import require


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of an HF Llama/Qwen2 config.json this engine uses."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: Optional[int]
    eos_token_id: Optional[int | list[int]]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str) -> "LlamaConfig":
        arch = cfg.get("architectures", [None])[0]
        heads = require(cfg, "num_attention_heads", source)
        hidden = require(cfg, "hidden_size", source)
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers >= 5 writes `rope_parameters` ({rope_theta, rope_type, scaling fields})
        # instead of top-level rope_theta / rope_scaling; read both spellings.
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(
            architecture=arch,
            vocab_size=require(cfg, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size", source),
            num_hidden_layers=require(cfg, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, rotary, bias=cfg.attention_bias,
                                   rms_norm_eps=cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.regions: Optional[LayerRegions] = None   # set with the fused projections (`use_regions`)

    def attention_inputs(self, h: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                         rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T, hidden] residual stream -> (q [T, Hq, D], k, v [T, Hkv, D]) of this layer; q and k
        unrotated when not `rotate` (layer regions only: the backend rotates them, `fused_rope_append`)."""
        a, r = self.self_attn, self.regions
        if r is not None:
            n, cs = self.input_layernorm, (rope if rotate else (None, None))
            return r.attention_inputs(h, n.weight, n.eps, *a._qkv, *cs, a.num_heads, a.num_kv_heads, a.head_dim)
        if not rotate:
            raise ValueError("unrotated q and k need the layer regions (use_regions)")
        return a.qkv(self.input_layernorm(h), positions, rope)

    def output(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] residual stream, o: [T, Hq * D] attention output -> the layer's output."""
        r = self.regions
        if r is not None:
            n = self.post_attention_layernorm
            return r.output(h, o, self.self_attn.o_proj.weight, n.weight, n.eps, self.mlp._gate_up,
                            self.mlp.down_proj.weight)
        h = h + self.self_attn.o_proj(o)
        return h + self.mlp(self.post_attention_layernorm(h))

    def output_then_inputs(self, h: torch.Tensor, o: torch.Tensor, nxt: "LlamaDecoderLayer",
                           positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotate: bool = True
                           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This layer's output, then `nxt`'s attention inputs: one region when both layers run
        regions (`compiled_regions.output_then_inputs`). Returns (h [T, hidden], (q, k, v) of nxt);
        `rotate` as in `attention_inputs`."""
        r = self.regions
        if r is None or nxt.regions is None:
            h = self.output(h, o)
            return h, nxt.attention_inputs(h, positions, rope, rotate)
        n, m, a = self.post_attention_layernorm, nxt.input_layernorm, nxt.self_attn
        cs = rope if rotate else (None, None)
        h, q, k, v = r.output_then_inputs(h, o, self.self_attn.o_proj.weight, n.weight, n.eps, self.mlp._gate_up,
                                          self.mlp.down_proj.weight, m.weight, m.eps, *a._qkv, *cs, a.num_heads,
                                          a.num_kv_heads, a.head_dim)
        return h, (q, k, v)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, backend: AttentionBackend,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h: [T, hidden] residual stream in -> out."""
        q, k, v = self.attention_inputs(h, positions, rope)
        return self.output(h, self.self_attn.core(q, k, v, kv_cache, md, backend))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Target model. Weights use HF names; `lm_head` is tied to `embed_tokens` when configured."""

    def __init__(self, cfg: LlamaConfig, max_positions: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta,
                                      max_positions or cfg.max_position_embeddings, cfg.rope_scaling)
        self.model = LlamaModel(cfg, self.rotary)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_key_rules(self) -> dict[str, list[str]]:
        """Keys accepted-but-ignored (a tied lm_head) for strict loading."""
        tied = ["lm_head.weight"] if self.config.tie_word_embeddings else []
        return {"ignore": tied, "optional": tied}

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the target KV pool."""
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                md: AttentionMetadata, backend: AttentionBackend,
                capture_layer_ids: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [T] -> (final-normed hidden [T, H], captured [T, H] per capture id).

        A captured tensor is the residual stream after that decoder layer (hidden + residual).
        The same computation, cut at each attention, is what the piecewise CUDA graphs capture
        (`embed`, `decoder_layers[0].attention_inputs`, `decoder_layers[i].output_then_inputs`, the
        last layer's `output`, `final_norm`).
        """
        h, rope = self.embed(input_ids, positions)
        captured: dict[int, torch.Tensor] = {}
        want = set(capture_layer_ids)
        layers = self.model.layers
        # a backend that rotates q and k in its KV append gets them unrotated (one launch fewer per layer)
        fused = backend.capabilities.fused_rope_append and all(layer.regions is not None for layer in layers)
        in_attention = rope if fused else None
        qkv = layers[0].attention_inputs(h, positions, rope, not fused)
        for i, layer in enumerate(layers):     # cut at each attention (`output_then_inputs` between two)
            o = layer.self_attn.core(*qkv, kv_caches[i], md, backend, in_attention)
            if i + 1 < len(layers):
                h, qkv = layer.output_then_inputs(h, o, layers[i + 1], positions, rope, not fused)
            else:
                h = layer.output(h, o)
            if i in want:
                captured[i] = h
        return self.final_norm(h), [captured[i] for i in capture_layer_ids]

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids, positions [T] -> (embeddings [T, H], rope (cos, sin) for every layer). The rows are
        gathered by indexing, the same values as `nn.Embedding` (whose index_select kernel took 5 us for a
        9-token verify on an H200)."""
        return self.model.embed_tokens.weight[input_ids], self.rotary.cos_sin(positions)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def fuse_projections(self) -> None:
        """Inference-time GEMM fusion (q|k|v, gate|up); call after the final `.to(device, dtype)`.
        The layers then run the region functions over the fused weights (eager until `use_regions`
        gives them compiled ones)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        self.use_regions(LayerRegions.eager())

    def use_regions(self, regions: LayerRegions) -> None:
        """Run every decoder layer's position-wise halves through `regions` (e.g. compiled by
        inductor); needs the fused projections (`fuse_projections`) and half-rotation RoPE."""
        if self.rotary.interleaved or self.rotary.rot_dim != self.config.head_dim:
            raise ValueError("compiled layer regions need half-rotation RoPE over the whole head")
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            if a._qkv is None or layer.mlp._gate_up is None or a.q_norm is not None:
                raise ValueError(f"layer {i}: compiled regions need fused q|k|v and gate|up projections "
                                 "(fuse_projections, no q/k norm, no MLP bias)")
        for layer in self.model.layers:
            layer.regions = regions

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] float32 (float32=False: the lm_head's dtype, e.g. for an
        argmax, which the widening cannot change)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (config `attention_bias` defaults to true)."""
