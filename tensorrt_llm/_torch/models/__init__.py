"""Model registry: `architectures[0]` of config.json -> class."""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import load_state_dict_strict, read_config, read_safetensors
from .modeling_llama import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM}


def load_target_model(folder: str | Path, dtype: torch.dtype, device: torch.device,
                      max_positions: int | None = None) -> LlamaForCausalLM:
    """Build the model named by the checkpoint's `architectures` and load weights strictly."""
    cfg_dict = read_config(folder)
    source = str(Path(folder) / "config.json")
    archs = cfg_dict.get("architectures") or []
    if not archs or archs[0] not in MODEL_REGISTRY:
        raise ValueError(f"{source}: unsupported architectures {archs}; supported: {sorted(MODEL_REGISTRY)}")
    cfg = LlamaConfig.from_dict(cfg_dict, source)
    model = MODEL_REGISTRY[archs[0]](cfg, max_positions)
    state = read_safetensors(folder)
    rules = model.checkpoint_key_rules()
    load_state_dict_strict(model, state, str(folder), ignore=rules["ignore"], optional=rules["optional"])
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse_projections()
    return model
