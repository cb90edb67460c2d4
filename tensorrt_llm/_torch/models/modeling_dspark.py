"""DSpark drafters: DFlash block-draft backbone (GQA or MLA attention) + DSpark heads.

Per committed token the target's captured hidden states become one *context feature*
(fc + hidden_norm); every layer's K/V (GQA) or latent (MLA) of that feature is written
once into the draft pool (`write_context`). A draft block is then::

    tokens:    [anchor, MASK, MASK, ..., MASK]            (block_size B, target embedding)
    positions: ctx_len, ctx_len+1, ..., ctx_len+B-1
    keys:      [ context entries 0..ctx_len-1 (pool) | block entries (written transiently) ]

non-causal inside the block. Slot j predicts position ctx_len+1+j (shift_label) or
ctx_len+j (slots 1..B-1 only). The target's embedding and lm_head are shared and frozen:
they are bound by reference (`bind_target`), never parameters of the drafter.
"""
from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..attention_backend.interface import AttentionBackend, AttentionMetadata, stacked_layers, write_kv, \
    write_slots, write_slots_layers
from ..modules.attention import Attention
from ..modules.fp8_block import FP8BlockLinear
from ..modules.mla import MLAAttention
from ..modules.rms_norm import RMSNorm
from ..modules.rotary_embedding import RotaryEmbedding
from .dspark_context_weights import ContextWeights
from .dspark_layer import DSparkDecoderLayer
from .dspark_config import DSPARK_CONFIG_KEYS, GQA_ARCH, MLA_ARCH, DraftKVLayout, DSparkModelConfig
from .dspark_regions import DrafterRegions
from .checkpoint import load_state_dict_strict
from .modeling_llama import LlamaConfig

OPTIONAL_HEADS = ("markov_head",)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B]."""
    return logits.argmax(-1)


class MarkovHead(nn.Module):
    """Low-rank bigram bias: bias(prev) = w2(w1[prev]), w1: Embedding(V, r), w2: Linear(r, V)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [B] -> bias [B, V] float32."""
        return self.w2(self.w1(prev_ids)).float()


class DSparkForCausalLMBase(nn.Module, ABC):
    """Shared drafter body. Subclasses build the attention and say what a context entry is."""

    architecture: str = ""

    def __init__(self, cfg: DSparkModelConfig, max_positions: Optional[int] = None):
        super().__init__()
        if cfg.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} cannot build a {cfg.architecture} config")
        self.config = cfg
        rot_dim = cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        self.rotary = RotaryEmbedding(rot_dim, cfg.rope_theta, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_scaling, interleaved=cfg.rope_interleave)
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(cfg, self._make_attention(cfg))
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank > 0 else None
        self.regions: Optional[DrafterRegions] = None   # context features and propose; layers hold theirs
        # every layer's context projection stacked (`use_regions`; a derived copy, not in the state dict)
        self._context_weights: Optional[ContextWeights] = None
        # Plain tuple attribute: not a submodule, so not in state_dict(), parameters() or .to().
        self._target_refs: Optional[tuple[nn.Embedding, nn.Linear]] = None

    # ---- subclass hooks -----------------------------------------------------------------
    @abstractmethod
    def _make_attention(self, cfg: DSparkModelConfig) -> nn.Module:
        """One layer's attention module (forward(x, positions, kv_cache, md, backend))."""

    @abstractmethod
    def _stack_context_weights(self) -> "ContextWeights":
        """Every layer's context projection (GQA k|v rows, MLA kv_a) and its norm weight, stacked."""

    def _write_all_layers(self, features: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                          slot_mapping: torch.Tensor, r: DrafterRegions, slots_valid: bool,
                          backend: AttentionBackend) -> None:
        """Every layer's context entries of features [N, H] into pool [L, pages, ...] at slot_mapping."""
        write_slots_layers(pool, self._context_all_layers(features, positions, r), slot_mapping,
                           all_valid=slots_valid)

    @abstractmethod
    def _context_all_layers(self, features: torch.Tensor, positions: torch.Tensor, r: DrafterRegions) -> torch.Tensor:
        """features [N, H] -> every layer's pool entries [N, L, planes, heads, head_dim] (one region call)."""

    @abstractmethod
    def _context_planes(self, layer: DSparkDecoderLayer, features: torch.Tensor, positions: torch.Tensor,
                        r: Optional[DrafterRegions]) -> list[torch.Tensor]:
        """features [N, H] -> one [N, heads, head_dim] tensor per pool plane of `layer` (through the
        regions r, or its modules when r is None)."""

    @abstractmethod
    def kv_cache_layout(self) -> DraftKVLayout:
        """Layout of the draft KV pool (per layer and token), as the target's `kv_cache_layout`."""

    # ---- after loading ------------------------------------------------------------------
    def post_load_weights(self) -> None:
        """Once after the weights are loaded and placed, before any graph is captured: MLA layers
        keep their per-head W_UK / W_UV contiguous (the absorbed attention reads them every step),
        and with `quant_config` the projections (fc and every layer's linear layers, except MLA's
        kv_b_proj, which the absorbed path reads as W_UK / W_UV) become FP8 block-scaled; then
        `fuse_projections` (the eager regions)."""
        qc = self.config.quant_config
        for layer in self.layers:
            if isinstance(layer.self_attn, MLAAttention):
                layer.self_attn.post_load_weights()
            if qc is not None:
                for parent in list(layer.modules()):
                    for name, child in list(parent.named_children()):
                        if isinstance(child, nn.Linear) and name != "kv_b_proj":
                            setattr(parent, name, FP8BlockLinear.from_linear(child, qc))
        if qc is not None:
            self.fc = FP8BlockLinear.from_linear(self.fc, qc)
        self.fuse_projections()

    def fold_mla_output(self) -> None:
        """`MLAAttention.fold_output` on every layer (`DSparkDecodingConfig.mla_fold_output`), after
        `post_load_weights`, before any graph is captured. ValueError for a GQA drafter, or one with
        quant_config (its layers keep their FP8 block-scaled modules)."""
        for a in self._mla_to_fold("mla_fold_output", "W_UV into o_proj", "o_proj"):
            a.fold_output()

    def fold_mla_query(self) -> None:
        """`MLAAttention.fold_query` on every layer (`DSparkDecodingConfig.mla_fold_query`), as `fold_mla_output`."""
        for a in self._mla_to_fold("mla_fold_query", "W_UK into the q projection", "q projection"):
            a.fold_query()

    def _mla_to_fold(self, option: str, what: str, proj: str) -> list[MLAAttention]:
        """Every layer's attention, or ValueError naming `option`: a GQA drafter, or one with quant_config."""
        if not self.config.is_mla:
            raise ValueError(f"{option} folds an MLA drafter's {what}; this drafter is {self.config.architecture}")
        if self.config.quant_config is not None:
            raise ValueError(f"{option} needs a drafter without quant_config (its {proj} is FP8 block-scaled)")
        return [layer.self_attn for layer in self.layers]

    def fuse_projections(self) -> None:
        """Inference-time GEMM fusion (GQA q|k|v, MLA q|kv_a without q_lora, gate|up; the parameters
        become views, the state dict keeps its keys), then the eager regions (`use_regions` may give
        compiled ones); call after the final `.to(device, dtype)`. FP8 block-scaled projections are
        not fused: with quant_config fc and the layers keep their modules."""
        if self.config.quant_config is None:
            for layer in self.layers:
                layer.self_attn.fuse_projections()
                layer.mlp.fuse_projections()
        self.use_regions(DrafterRegions.eager())

    def use_regions(self, regions: DrafterRegions) -> None:
        """Run the drafter's position-wise work through `regions` (e.g. compiled by inductor): the
        context features, every layer's context K/V (latent), attention inputs and output, and the
        greedy `propose`. Needs the fused projections (`fuse_projections`). With FP8 block-scaled
        projections (quant_config) fc and the layers keep their modules; only `propose` takes them."""
        quantized = self.config.quant_config is not None
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            gqa_unfused = isinstance(a, Attention) and (a._qkv is None or a.q_norm is None)
            if not quantized and (layer.mlp._gate_up is None or gqa_unfused):
                raise ValueError(f"layer {i}: drafter regions need fused q|k|v (with q/k norms) and gate|up "
                                 "projections (fuse_projections)")
        self.regions = regions
        for layer in self.layers:
            layer.regions = None if quantized else regions
        self._context_weights = None if quantized else self._stack_context_weights()

    def regions_summary(self) -> str:
        """What the drafter runs: "inductor" | "eager" (every region; with " (Markov chain: Triton)" where
        the regions' `triton_chain` is set and " (context write: Triton)" where their
        `triton_context` is: an engine on CUDA), "modules" (no regions), or the regions' kind with the
        parts that keep their modules."""
        if self.regions is None:
            return "modules"
        kind = "inductor" if self.regions.compiled else "eager"
        if self.regions.triton_chain:
            kind += " (Markov chain: Triton)"
        if self.regions.triton_context:
            kind += " (context write: Triton)"
        if self.config.quant_config is not None:
            return f"{kind} (propose only: fc and the layers run their FP8 block-scaled modules)"
        return kind

    # ---- target binding -----------------------------------------------------------------
    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Share the target's (frozen) embedding and lm_head by reference."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, mod in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(mod.weight.shape) != want:
                raise ValueError(f"target {name} weight is {tuple(mod.weight.shape)}, drafter needs {want}")
        self._target_refs = (embed_tokens, lm_head)

    def _target(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._target_refs is None:
            raise ValueError("drafter has no target embedding/lm_head; call bind_target() first")
        return self._target_refs

    # ---- executor API -------------------------------------------------------------------
    def context_features(self, target_hidden: torch.Tensor, compiled: bool = True) -> torch.Tensor:
        """target_hidden [N, n * H_target] (captured layers concatenated) -> features [N, H].
        compiled=False: the eager regions where compiled ones are set (`_regions`)."""
        if target_hidden.shape[-1] != self.config.fc_in_features:
            raise ValueError(f"target hidden width {target_hidden.shape[-1]} != "
                             f"{len(self.config.target_layer_ids)} x {self.config.num_target_hidden}")
        n, r = self.hidden_norm, _regions(self.regions, compiled)
        if r is not None and isinstance(self.fc, nn.Linear):
            return r.features(target_hidden, self.fc.weight, n.weight, n.eps)
        return self.hidden_norm(self.fc(target_hidden.to(self.hidden_norm.weight.dtype)))

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_caches: Sequence[torch.Tensor], backend: AttentionBackend,
                      slots_valid: bool = False, compiled: bool = True) -> None:
        """Write every layer's context K/V (or latent) for committed tokens into the draft pool.

        features [N, H]; positions [N] absolute; slot_mapping [N] int64 (-1 skipped);
        kv_caches: one [num_pages, planes, heads, P, D] tensor per layer. The pool layout
        is the interface's, shared by every backend; `backend` is consulted only by an MLA drafter whose
        pool's layers are one tensor: with `cute_norm_rope` its latents go through the CuTe DSL kernel.
        slots_valid: every slot is >= 0 (no host sync: the CUDA-graph draft step). K and V that are
        one buffer's halves (the regions') go in with one write. compiled=False: the eager regions
        where compiled ones are set (`_regions`).
        """
        self._check_caches(kv_caches)
        r = _regions(self.regions, compiled)
        pool = stacked_layers(kv_caches) if r is not None and self._context_weights is not None else None
        if pool is not None:        # the pool's layers are one tensor: one projection, one write
            if not self._context_weights.current():     # a weight changed in place since use_regions
                self._context_weights = self._stack_context_weights()
            self._write_all_layers(features, positions, pool, slot_mapping, r, slots_valid, backend)
            return

        def write(cache: torch.Tensor, plane: int, values: torch.Tensor) -> None:
            write_slots(cache[:, plane], values, slot_mapping, all_valid=slots_valid)
        for layer, cache in zip(self.layers, kv_caches):
            planes = self._context_planes(layer, features, positions, _regions(layer.regions, compiled))
            if len(planes) == 2:
                write_kv(cache, *planes, write)
            else:
                write(cache, 0, planes[0])

    def forward_block(self, block_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                      kv_caches: Sequence[torch.Tensor], backend: AttentionBackend) -> torch.Tensor:
        """Run draft blocks: block_ids, positions [M] -> final-normed hidden [M, H].

        md: non-causal block metadata (num_cached = context lengths, seq_lens = block sizes,
        slot_mapping = where block entries are written transiently). Per-layer sliding
        windows from the config override md.sliding_window.
        """
        self._check_caches(kv_caches)
        self._check_backend(backend, md)
        embed, _ = self._target()
        h = embed.weight[block_ids].to(self.norm.weight.dtype)   # a gather, as the target's `embed`
        derived: dict[Optional[int], AttentionMetadata] = {md.sliding_window: md}
        # the block's rope tables gathered once, where the backend norms and rotates q / k in its append
        # (the layers share their attention type, regions and rotary: the first one answers for all; each
        # layer's `attention` checks its own again)
        rope = self.rotary.cos_sin(positions) if self.layers[0].fuses_rope_append(backend) else None
        # every layer fusing its append: cut at each attention, one region between two attentions (a layer's
        # output joined to the next layer's attention inputs, the last one's to the final norm)
        joined = rope is not None and all(layer.fuses_rope_append(backend) for layer in self.layers)
        parts = self.layers[0].attention_parts(h) if joined else None
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            window = self.config.layer_sliding_window(i)
            if window not in derived:
                # Fresh extras: backend plan state depends on the mask, so plan this variant too.
                derived[window] = dataclasses.replace(md, sliding_window=window, extras={})
                backend.prepare(derived[window])
            if not joined:
                h = layer(h, positions, cache, derived[window], backend, rope)
                continue
            o = layer.attend_parts(parts, rope, cache, derived[window], backend)
            if i == last:
                return layer.output_then_norm(h, o, self.norm)
            h, parts = layer.output_then_parts(h, o, self.layers[i + 1])
        return self.norm(h)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> logits [M, V] float32 through the target's lm_head."""
        _, lm_head = self._target()
        return lm_head(hidden.to(lm_head.weight.dtype)).float()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, num_drafts: int,
                pick: Callable[[torch.Tensor], torch.Tensor] = greedy_pick
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose drafts left to right, adding the Markov bias of the previous choice.

        hidden [R * S, H] (R requests, S = block_size slots each, from forward_block);
        anchor_ids [R] (the block's first token); pick: logits [R, V] -> ids [R] (argmax,
        or a sampler at T > 0). Returns draft_ids [R, num_drafts] int64 and the (biased)
        draft_logits [R, num_drafts, V] float32. Slots used: 0..n-1 with shift_label, else 1..n.
        The engine's greedy drafts go through `propose_greedy` (ids only).
        """
        first = self._check_propose(hidden, anchor_ids, num_drafts)
        r, s = anchor_ids.shape[0], self.config.block_size
        h = hidden.reshape(r, s, -1)[:, first:first + num_drafts]
        logits = self.draft_logits(h.reshape(r * num_drafts, -1)).view(r, num_drafts, -1)
        prev, ids, out = anchor_ids, [], []
        for j in range(num_drafts):
            lj = logits[:, j]
            if self.markov_head is not None:
                lj = lj + self.markov_head(prev)
            prev = pick(lj).long()
            ids.append(prev)
            out.append(lj)
        return torch.stack(ids, dim=1), torch.stack(out, dim=1)

    def propose_greedy(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """`propose` with argmax picks, ids only ([R, num_drafts] int64): through the regions'
        `greedy_drafts` when the drafter has them (compiled, the biased logits are never written)."""
        if self.regions is None:
            return self.propose(hidden, anchor_ids, num_drafts)[0]
        first = self._check_propose(hidden, anchor_ids, num_drafts)
        _, lm_head = self._target()
        mh = self.markov_head
        w1, w2 = (None, None) if mh is None else (mh.w1.weight, mh.w2.weight)
        return self.regions.greedy_drafts(hidden, anchor_ids, lm_head.weight, lm_head.bias, w1, w2,
                                          self.config.block_size, first, num_drafts)

    def _check_propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, num_drafts: int) -> int:
        """Validate propose's inputs; returns the first slot used (0 with shift_label, else 1)."""
        cfg = self.config
        r, s = anchor_ids.shape[0], cfg.block_size
        if hidden.shape[0] != r * s:
            raise ValueError(f"hidden has {hidden.shape[0]} rows, expected {r} x block_size {s}")
        if not 1 <= num_drafts <= cfg.num_drafts:
            raise ValueError(f"num_drafts {num_drafts} outside [1, {cfg.num_drafts}]")
        return 0 if cfg.shift_label else 1

    # ---- checks -------------------------------------------------------------------------
    def _check_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} draft KV tensors for {len(self.layers)} layers")

    def _check_backend(self, backend: AttentionBackend, md: AttentionMetadata) -> None:
        caps, cfg = backend.capabilities, self.config
        if not md.causal and not caps.non_causal_block:
            raise ValueError(f"attention backend {backend.name} cannot run non-causal draft blocks")
        if cfg.is_mla and not caps.mla:
            raise ValueError(f"attention backend {backend.name} does not support MLA")
        windows = {cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)}
        if windows != {None} and not caps.sliding_window:
            raise ValueError(f"attention backend {backend.name} does not support sliding windows")

    # ---- checkpoints --------------------------------------------------------------------
    def module_groups(self) -> dict[str, list[str]]:
        """Top-level module (and each layer) -> its state-dict keys."""
        groups: dict[str, list[str]] = {}
        for k in self.state_dict():
            parts = k.split(".")
            prefix = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            groups.setdefault(prefix, []).append(k)
        return groups

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Strict load: all required tensors, no extra ones, shapes equal, heads all-or-nothing."""
        groups = self.module_groups()
        optional = [k for name in OPTIONAL_HEADS for k in groups.get(name, [])]
        load_state_dict_strict(self, state, source, optional=optional, module_groups=groups)
        for name in OPTIONAL_HEADS:
            keys = groups.get(name, [])
            if keys and not any(k in state for k in keys):
                raise ValueError(f"{source}: config declares {name} but the checkpoint has none of {keys}")

    def save_pretrained(self, folder: str | Path) -> None:
        """Write config.json and model.safetensors (the drafter's own tensors only)."""
        d = Path(folder)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def random_init(cls, kind: str, target_config: LlamaConfig, seed: int = 0, absorb: bool = True,
                    **overrides: Any) -> "DSparkForCausalLMBase":
        """Random drafter matching `target_config`: the init of `trtllm-train-dspark`
        (`tools/train_dspark.build_drafter`), small by default for tests. Weights ~ N(0, 0.02), norms 1.

        kind: "gqa" | "mla"; overrides: config.json keys, dspark_config keys included flat.
        """
        if kind not in ("gqa", "mla"):
            raise ValueError(f"kind must be 'gqa' or 'mla', got {kind!r}")
        t = target_config
        n = t.num_hidden_layers
        cfg: dict[str, Any] = {
            "architectures": [GQA_ARCH if kind == "gqa" else MLA_ARCH], "hidden_size": t.hidden_size,
            "intermediate_size": 2 * t.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
            "max_position_embeddings": t.max_position_embeddings,
        }
        if kind == "gqa":
            cfg.update(num_key_value_heads=2, head_dim=16)
        else:
            cfg.update(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        ds: dict[str, Any] = {
            "block_size": 4, "mask_token_id": t.vocab_size - 1, "num_target_hidden": t.hidden_size,
            "target_layer_ids": sorted({min(1, n - 1), n // 2, max(n - 2, 0)}),
        }
        for k, v in overrides.items():
            (ds if k in DSPARK_CONFIG_KEYS else cfg)[k] = v
        cfg["dspark_config"] = ds
        config = DSparkModelConfig.from_dict(cfg, "random_init")
        model = (MLADSparkForCausalLM(config, absorb=absorb) if kind == "mla"
                 else GQADSparkForCausalLM(config))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    continue                        # RMSNorm weights stay at 1
                if name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.eval()


class GQADSparkForCausalLM(DSparkForCausalLMBase):
    """DFlash-style drafter with GQA attention (q/k norm, RoPE)."""

    architecture = GQA_ARCH

    def _make_attention(self, cfg: DSparkModelConfig) -> nn.Module:
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         self.rotary, bias=cfg.attention_bias, qk_norm=True, rms_norm_eps=cfg.rms_norm_eps)

    def _context_planes(self, layer: DSparkDecoderLayer, features: torch.Tensor, positions: torch.Tensor,
                        r: Optional[DrafterRegions]) -> list[torch.Tensor]:
        a = layer.self_attn
        if r is None:
            return list(a.project_kv(features, positions))      # [N, Hkv, D] each
        return list(r.gqa_project_kv(features, *a.kv_weights(), a.k_norm.weight, a.k_norm.eps, positions,
                                     *a.rotary.tables(positions.device), a.rotary.interleaved, a.num_kv_heads,
                                     a.head_dim))

    def _stack_context_weights(self) -> "ContextWeights":
        attns = [layer.self_attn for layer in self.layers]
        ws, bs = zip(*(a.kv_weights() for a in attns))
        return ContextWeights.stack(ws, bs, [a.k_norm.weight for a in attns], attns[0].k_norm.eps)

    def _write_all_layers(self, features: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                          slot_mapping: torch.Tensor, r: DrafterRegions, slots_valid: bool,
                          backend: AttentionBackend) -> None:
        if not r.triton_context:
            return super()._write_all_layers(features, positions, pool, slot_mapping, r, slots_valid, backend)
        from .dspark_context_kernel import write_gqa_context
        cw = self._context_weights
        write_gqa_context(F.linear(features, cw.weight, cw.bias), cw.norm_weight, cw.eps, positions,
                          *self.rotary.tables(positions.device), pool, slot_mapping)

    def _context_all_layers(self, features: torch.Tensor, positions: torch.Tensor, r: DrafterRegions) -> torch.Tensor:
        cw, a = self._context_weights, self.layers[0].self_attn
        kv = r.gqa_context_kv(features, cw.weight, cw.bias, cw.norm_weight, cw.eps, positions,
                              *self.rotary.tables(positions.device), self.rotary.interleaved, a.num_kv_heads,
                              a.head_dim)
        return kv.view(kv.shape[0], kv.shape[1], 2, a.num_kv_heads, a.head_dim)

    def kv_cache_layout(self) -> DraftKVLayout:
        c = self.config
        return DraftKVLayout("gqa", c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim)


class MLADSparkForCausalLM(DSparkForCausalLMBase):
    """DSpark drafter with DeepSeek-V2 MLA attention; `absorb=False` selects the reference path."""

    architecture = MLA_ARCH

    def __init__(self, cfg: DSparkModelConfig, max_positions: Optional[int] = None, absorb: bool = True):
        self._absorb = absorb
        super().__init__(cfg, max_positions)

    def _make_attention(self, cfg: DSparkModelConfig) -> nn.Module:
        return MLAAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.v_head_dim, self.rotary, q_lora_rank=cfg.q_lora_rank,
                            rms_norm_eps=cfg.rms_norm_eps, rope_scaling=cfg.rope_scaling,
                            absorb=self._absorb)

    def _context_planes(self, layer: DSparkDecoderLayer, features: torch.Tensor, positions: torch.Tensor,
                        r: Optional[DrafterRegions]) -> list[torch.Tensor]:
        a = layer.self_attn
        if r is None:
            latent = a.project_latent(features, positions)
        else:
            latent = r.mla_latent(features, a.kv_a_proj_with_mqa.weight, a.kv_a_layernorm.weight, a.kv_a_layernorm.eps,
                                  positions, *a.rotary.tables(positions.device), a.rotary.interleaved, a.kv_lora_rank)
        return [latent[:, None, :]]                             # [N, 1, R + rope]

    def _stack_context_weights(self) -> "ContextWeights":
        attns = [layer.self_attn for layer in self.layers]
        return ContextWeights.stack([a.kv_a_proj_with_mqa.weight for a in attns], [None],
                                    [a.kv_a_layernorm.weight for a in attns], attns[0].kv_a_layernorm.eps)

    def _write_all_layers(self, features: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                          slot_mapping: torch.Tensor, r: DrafterRegions, slots_valid: bool,
                          backend: AttentionBackend) -> None:
        cute = backend.capabilities.cute_norm_rope
        if not (cute or r.triton_context):
            return super()._write_all_layers(features, positions, pool, slot_mapping, r, slots_valid, backend)
        cw = self._context_weights
        kv = F.linear(features, cw.weight)                                           # [N, L * (R + r)]
        if not cute:
            from .dspark_context_kernel import write_mla_context
            return write_mla_context(kv, cw.norm_weight, cw.eps, positions, *self.rotary.tables(positions.device),
                                     pool, slot_mapping)
        from ..attention_backend.cute_norm_rope import norm_rope
        kv = kv.view(features.shape[0], cw.norm_weight.shape[0], -1)                  # [N, L, R + r]
        cos, sin = self.rotary.cos_sin(positions)
        lat = norm_rope(kv, cos[:, 0], sin[:, 0], torch.empty_like(kv), norm_dim=self.config.kv_lora_rank,
                        weight=cw.norm_weight, eps=cw.eps)       # each layer's kv_a_layernorm on its rows
        write_slots_layers(pool, lat[:, :, None, None, :], slot_mapping, all_valid=slots_valid)

    def _context_all_layers(self, features: torch.Tensor, positions: torch.Tensor, r: DrafterRegions) -> torch.Tensor:
        cw = self._context_weights
        lat = r.mla_context_latents(features, cw.weight, cw.norm_weight, cw.eps, positions,
                                    *self.rotary.tables(positions.device), self.rotary.interleaved,
                                    self.config.kv_lora_rank)
        return lat[:, :, None, None, :]                         # [N, L, 1, 1, R + rope]

    def kv_cache_layout(self) -> DraftKVLayout:
        c = self.config
        return DraftKVLayout("mla", c.num_hidden_layers, 1, 1, c.kv_lora_rank + c.qk_rope_head_dim)


def _regions(regions: Optional[DrafterRegions], compiled: bool) -> Optional[DrafterRegions]:
    """The regions a call runs: the set ones, or their eager functions for a call that asks for them
    (compiled=False). A context write outside any CUDA graph with a new token count per call (a
    prompt's) spent ~0.38 ms of host time per compiled region call on the H200 (`spec_profile`'s
    cProfile of prompt steps: 2.2 of their 3.4 ms of draft-context writing), for kernels that are a
    few microseconds either way."""
    if regions is None or compiled or not regions.compiled:
        return regions
    return DrafterRegions.eager()
