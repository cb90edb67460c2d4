"""DSpark drafter config.json: validated, frozen view of the drafter checkpoint's config.

A drafter folder holds an HF-style config.json plus a `dspark_config` block::

    {"architectures": ["GQADSparkForCausalLM"],          # or MLADSparkForCausalLM
     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
     "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64, ...,
     "dspark_config": {"block_size": 8, "mask_token_id": 0, "target_layer_ids": [1, 14, 27],
                       "num_target_hidden": 576, "markov_rank": 0, "shift_label": true}}

Unknown top-level keys are ignored (HF configs carry many); unknown `dspark_config`
keys are rejected (they are ours, so an unknown one is a typo). A retired key still loads
at its retired value (older checkpoints carry it) and raises at any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..modules.fp8_block import FP8BlockQuantConfig
from .checkpoint import require


@dataclass(frozen=True)
class DraftKVLayout:
    """The drafter's KV per layer and token: GQA stores K and V planes of `heads` x `head_dim`;
    MLA one plane of one 576-wide latent (kv_lora_rank + rope dim)."""

    kind: str           # "gqa" | "mla"
    num_layers: int
    planes: int         # 2 (K, V) or 1 (latent)
    heads: int
    head_dim: int

GQA_ARCH = "GQADSparkForCausalLM"
MLA_ARCH = "MLADSparkForCausalLM"
DSPARK_ARCHITECTURES = (GQA_ARCH, MLA_ARCH)
LAYER_TYPES = ("full_attention", "sliding_attention")
DSPARK_CONFIG_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_hidden",
                "markov_rank", "shift_label")
# Older checkpoints carry `confidence_head` (a head that was saved but never read): it loads
# when false, and raises when true rather than silently dropping trained weights.
RETIRED_DSPARK_CONFIG_KEYS = ("confidence_head",)


def _optional(cfg: dict[str, Any], key: str, source: str, kind: type, default: Any) -> Any:
    """Like `require`, but an absent (or null) key gives `default`."""
    if cfg.get(key, None) is None:
        return default
    return require(cfg, key, source, kind)


def _int_list(cfg: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    v = require(cfg, key, source, list)
    if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{source}: key {key!r} must be a non-empty list of ints >= 0, got {v!r}")
    return tuple(v)


@dataclass(frozen=True)
class DSparkModelConfig:
    """Drafter architecture + DSpark head settings (validated, never mutated)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int             # GQA; equals num_attention_heads for MLA
    head_dim: int                        # GQA head dim; MLA: qk_nope + qk_rope (informational)
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    rope_interleave: bool                # adjacent-pair RoPE layout
    max_position_embeddings: int
    attention_bias: bool
    sliding_window: Optional[int]
    layer_types: Optional[tuple[str, ...]]
    # MLA (0 / None for GQA)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]
    # dspark_config
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_hidden: int
    markov_rank: int
    shift_label: bool
    # `quant_config` of config.json: FP8 (e4m3) block-scaled projections, quantized at load
    quant_config: Optional[FP8BlockQuantConfig] = None

    @property
    def is_mla(self) -> bool:
        return self.architecture == MLA_ARCH

    @property
    def num_drafts(self) -> int:
        """Drafts one block proposes: block_size with shift_label, else block_size - 1."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def fc_in_features(self) -> int:
        """Width of the concatenated captured target hidden states."""
        return len(self.target_layer_ids) * self.num_target_hidden

    def layer_sliding_window(self, layer: int) -> Optional[int]:
        """Sliding window of drafter layer `layer` (None = full attention)."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str) -> "DSparkModelConfig":
        """Validate a config.json dict; ValueError names `source` and the offending key."""
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not archs or archs[0] not in DSPARK_ARCHITECTURES:
            raise ValueError(f"{source}: unknown drafter architectures {archs!r}; "
                             f"supported: {list(DSPARK_ARCHITECTURES)}")
        arch = archs[0]
        mla = arch == MLA_ARCH
        hidden = require(cfg, "hidden_size", source)
        layers = require(cfg, "num_hidden_layers", source)
        heads = require(cfg, "num_attention_heads", source)
        for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads)):
            if v < 1:
                raise ValueError(f"{source}: key {k!r} must be >= 1, got {v}")
        if mla:
            kv_heads = heads
            kv_lora = require(cfg, "kv_lora_rank", source)
            rope = require(cfg, "qk_rope_head_dim", source)
            nope = require(cfg, "qk_nope_head_dim", source)
            v_dim = require(cfg, "v_head_dim", source)
            q_lora = _optional(cfg, "q_lora_rank", source, int, None)
            head_dim = nope + rope
            if rope % 2 or min(kv_lora, rope, nope, v_dim) < 1:
                raise ValueError(f"{source}: MLA dims must be >= 1 and qk_rope_head_dim even, got "
                                 f"kv_lora_rank={kv_lora} qk_rope_head_dim={rope} "
                                 f"qk_nope_head_dim={nope} v_head_dim={v_dim}")
        else:
            kv_heads = require(cfg, "num_key_value_heads", source)
            head_dim = _optional(cfg, "head_dim", source, int, hidden // heads)
            kv_lora = rope = nope = v_dim = 0
            q_lora = None
            if kv_heads < 1 or heads % kv_heads:
                raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                                 f"num_key_value_heads {kv_heads}")
        rope_scaling = _optional(cfg, "rope_scaling", source, dict, None)
        sliding = _optional(cfg, "sliding_window", source, int, None)
        layer_types = cfg.get("layer_types")
        if layer_types is not None:
            if (not isinstance(layer_types, list) or len(layer_types) != layers
                    or any(t not in LAYER_TYPES for t in layer_types)):
                raise ValueError(f"{source}: key 'layer_types' must list {layers} entries from "
                                 f"{list(LAYER_TYPES)}, got {layer_types!r}")
            layer_types = tuple(layer_types)
            if "sliding_attention" in layer_types and sliding is None:
                raise ValueError(f"{source}: key 'sliding_window' is required when layer_types "
                                 "has sliding_attention layers")
        if sliding is not None and sliding < 1:
            raise ValueError(f"{source}: key 'sliding_window' must be >= 1, got {sliding}")

        dsrc = f"{source}: dspark_config"
        ds = require(cfg, "dspark_config", source, dict)
        unknown = sorted(set(ds) - set(DSPARK_CONFIG_KEYS) - set(RETIRED_DSPARK_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"{dsrc}: unknown keys {unknown}; known: {list(DSPARK_CONFIG_KEYS)}")
        if _optional(ds, "confidence_head", dsrc, bool, False):
            raise ValueError(f"{dsrc}: key 'confidence_head' is true, but the confidence head was removed "
                             "(no code read it); only checkpoints with it false or absent load")
        block_size = require(ds, "block_size", dsrc)
        shift_label = _optional(ds, "shift_label", dsrc, bool, True)
        markov_rank = _optional(ds, "markov_rank", dsrc, int, 0)
        vocab = require(cfg, "vocab_size", source)
        mask_id = require(ds, "mask_token_id", dsrc)
        if block_size < (1 if shift_label else 2):
            raise ValueError(f"{dsrc}: key 'block_size' {block_size} leaves no draft slot "
                             f"(shift_label={shift_label})")
        if not 0 <= mask_id < vocab:
            raise ValueError(f"{dsrc}: key 'mask_token_id' {mask_id} outside vocab [0, {vocab})")
        if markov_rank < 0:
            raise ValueError(f"{dsrc}: key 'markov_rank' must be >= 0, got {markov_rank}")
        return cls(
            architecture=arch, hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size", source),
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, vocab_size=vocab,
            rms_norm_eps=_optional(cfg, "rms_norm_eps", source, float, 1e-6),
            rope_theta=_optional(cfg, "rope_theta", source, float,
                                 float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            rope_interleave=_optional(cfg, "rope_interleave", source, bool, False),
            max_position_embeddings=_optional(cfg, "max_position_embeddings", source, int, 2048),
            attention_bias=_optional(cfg, "attention_bias", source, bool, False),
            sliding_window=sliding, layer_types=layer_types,
            kv_lora_rank=kv_lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim,
            q_lora_rank=q_lora,
            block_size=block_size, mask_token_id=mask_id,
            target_layer_ids=_int_list(ds, "target_layer_ids", dsrc),
            num_target_hidden=require(ds, "num_target_hidden", dsrc),
            markov_rank=markov_rank, shift_label=shift_label,
            quant_config=(FP8BlockQuantConfig.from_dict(cfg["quant_config"], source)
                          if cfg.get("quant_config") is not None else None),
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict that `from_dict` reads back to an equal config."""
        out: dict[str, Any] = {
            "architectures": [self.architecture], "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "sliding_window": self.sliding_window,
        }
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.is_mla:
            out.update(kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                       qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
                       q_lora_rank=self.q_lora_rank)
        else:
            out.update(num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim)
        out["dspark_config"] = {
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "num_target_hidden": self.num_target_hidden, "markov_rank": self.markov_rank,
            "shift_label": self.shift_label,
        }
        if self.quant_config is not None:
            out["quant_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "scale_fmt": "ue8m0",
                                   "weight_block_size": list(self.quant_config.weight_block_size)}
        return out
