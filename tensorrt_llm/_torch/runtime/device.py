"""Device and dtype names of the args -> torch objects; which errors are device faults, and
running a batch so that a non-fatal error fails only the items it belongs to."""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")
Item = TypeVar("Item")

_MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: Optional[str]) -> torch.device:
    """None -> CUDA when available, else CPU; an explicit CUDA device without CUDA raises ValueError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA, float32 on CPU; else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _MODEL_DTYPES:
        raise ValueError(f"dtype {name!r} unknown; known: auto, {', '.join(_MODEL_DTYPES)}")
    return _MODEL_DTYPES[name]


def is_device_fault(e: BaseException) -> bool:
    """An error that leaves the device in an unknown state (out of memory, a CUDA error): the
    executor fails every in-flight request; no component may recover from it on its own."""
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "CUDA error" in str(e) \
        or type(e).__name__ == "AcceleratorError"


def isolated(fn: Callable[[list[Item]], T], items: list[Item], fail: Callable[[Item, Exception], None]) -> list[T]:
    """[fn(items)]; if that fails (not a device fault), [fn([item]) for each item that succeeds
    alone], calling fail(item, error) for each item that fails alone. A device fault propagates."""
    try:
        return [fn(items)]
    except Exception as e:
        if is_device_fault(e):
            raise
        if len(items) == 1:
            fail(items[0], e)
            return []
    out = []
    for item in items:
        try:
            out.append(fn([item]))
        except Exception as e:
            if is_device_fault(e):
                raise
            fail(item, e)
    return out
