"""Checkpoint folder reading: config.json and strict safetensors loading."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors import safe_open
from torch import nn


def read_config(folder: str | Path) -> dict[str, Any]:
    """Read `folder/config.json`, raising ValueError naming the file on any problem."""
    d = Path(folder)
    if not d.is_dir():
        raise ValueError(f"checkpoint folder not found: {d}")
    f = d / "config.json"
    if not f.is_file():
        raise ValueError(f"checkpoint folder {d} has no config.json")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: invalid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: top level must be an object")
    return cfg


def require(cfg: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    """Fetch a required config key, naming the file and key when it is absent or mistyped."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{source}: missing required key {key!r}")
    v = cfg[key]
    if kind is float and isinstance(v, int):
        v = float(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValueError(f"{source}: key {key!r} must be {kind.__name__}, got {v!r}")
    return v


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Load every `*.safetensors` file of a folder into one CPU state dict; a floating-point
    tensor holding NaN or Inf raises (naming file and tensor) instead of loading silently."""
    d = Path(folder)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint folder {d} has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in out:
                        raise ValueError(f"{f}: tensor {k!r} appears in more than one file")
                    out[k] = sf.get_tensor(k)
                    _check_finite(out[k], f, k)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{f}: cannot read safetensors: {e}") from e
    return out


def _check_finite(t: torch.Tensor, file: Path, name: str) -> None:
    if not t.is_floating_point():
        return
    finite = torch.isfinite(t if t.element_size() > 1 else t.float())   # fp8: no isfinite kernel
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(f"{file}: tensor {name!r} has {bad} non-finite value(s) (NaN/Inf) of {t.numel()}")


def load_state_dict_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str,
                           optional: Iterable[str] = (), ignore: Iterable[str] = (),
                           module_groups: Optional[dict[str, list[str]]] = None) -> None:
    """Copy `state` into `model`; every expected tensor present, none unexpected, shapes equal.

    optional: keys that may be absent (left at their init). ignore: checkpoint keys that are
    accepted and dropped (e.g. a tied lm_head). module_groups: prefix -> its keys; a group
    that is partially present is rejected even when all its keys are optional.
    """
    expected = dict(model.state_dict())
    optional, ignore = set(optional), set(ignore)
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unexpected = sorted(k for k in state if k not in expected and k not in ignore)
    if missing:
        raise ValueError(f"{source}: missing tensors: {missing[:10]}" +
                         (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors: {unexpected[:10]}" +
                         (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
    for prefix, keys in (module_groups or {}).items():
        present = [k for k in keys if k in state]
        if present and len(present) != len(keys):
            absent = sorted(set(keys) - set(present))
            raise ValueError(f"{source}: module {prefix!r} is partially present; missing {absent}")
    bad = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items()
           if k in state and state[k].shape != v.shape]
    if bad:
        k, got, want = bad[0]
        raise ValueError(f"{source}: shape mismatch for {k!r}: checkpoint {got}, model expects {want}")
    with torch.no_grad():
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        for k, t in state.items():
            if k in expected:
                params[k].copy_(t.to(params[k].dtype))
