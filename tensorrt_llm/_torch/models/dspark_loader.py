"""Loading a DSpark drafter from its checkpoint folder: the architecture registry, the checks against
the target it drafts for, and the strict weight load."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from .checkpoint import read_config, read_safetensors
from .dspark_config import DSPARK_CONFIG_KEYS, GQA_ARCH, MLA_ARCH, DSparkModelConfig
from .modeling_dspark import DSparkForCausalLMBase, GQADSparkForCausalLM, MLADSparkForCausalLM
from .modeling_llama import LlamaConfig

DRAFTER_REGISTRY: dict[str, type[DSparkForCausalLMBase]] = {
    GQA_ARCH: GQADSparkForCausalLM, MLA_ARCH: MLADSparkForCausalLM}


def check_against_target(cfg: DSparkModelConfig, target: LlamaConfig, source: str) -> None:
    """The drafter shares the target's embedding/lm_head and reads its hidden states."""
    pairs = (("hidden_size", cfg.hidden_size, "hidden_size", target.hidden_size),
             ("vocab_size", cfg.vocab_size, "vocab_size", target.vocab_size),
             ("dspark_config.num_target_hidden", cfg.num_target_hidden, "hidden_size", target.hidden_size))
    for name, mine, tname, theirs in pairs:
        if mine != theirs:
            raise ValueError(f"{source}: drafter {name} {mine} does not match the target's {tname} {theirs}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_hidden_layers]
    if bad:
        raise ValueError(f"{source}: dspark_config.target_layer_ids {list(cfg.target_layer_ids)} name layers "
                         f"{bad} but the target has {target.num_hidden_layers} layers")


def load_drafter(folder: str | Path, target_config: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 overrides: Optional[Mapping[str, Any]] = None,
                 max_positions: Optional[int] = None, for_inference: bool = True) -> DSparkForCausalLMBase:
    """Build the drafter named by `folder/config.json` and load its weights strictly.

    overrides: dspark_config keys to replace (e.g. mask_token_id, target_layer_ids from
    DSparkDecodingConfig); None values are skipped. The caller binds the target afterwards.
    max_positions: rope positions the engine may reach (the target's table: max_seq_len plus the
    draft lookahead), when more than either config's max_position_embeddings.
    for_inference: run `post_load_weights` (derived weights, FP8 quantization per quant_config, fused
    projections and the eager regions); False keeps exactly the checkpoint's parameters (a training init).
    """
    source = str(Path(folder) / "config.json")
    cfg_dict = read_config(folder)
    ov = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(ov) - set(DSPARK_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown drafter overrides {unknown}; known: {list(DSPARK_CONFIG_KEYS)}")
    if ov and isinstance(cfg_dict.get("dspark_config"), dict):
        cfg_dict = {**cfg_dict, "dspark_config": {**cfg_dict["dspark_config"], **ov}}
    cfg = DSparkModelConfig.from_dict(cfg_dict, source)
    check_against_target(cfg, target_config, source)
    max_pos = max(cfg.max_position_embeddings, target_config.max_position_embeddings, max_positions or 0)
    model = DRAFTER_REGISTRY[cfg.architecture](cfg, max_pos)
    model.load_checkpoint_state(read_safetensors(folder), str(folder))
    model = model.to(device=device, dtype=dtype).eval()
    if for_inference:
        model.post_load_weights()
    return model
