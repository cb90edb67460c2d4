"""The DSpark C++ ops (`cpp/`, `torch.ops.trtllm.*`): loaded from the library `setup.py` builds next
to the package (`tensorrt_llm/_dspark_ops.so`, only where a CUDA torch and nvcc are present).

    dspark_paged_kv_append  page-bounded K/V / latent writes (`paged_append.py`)
    dspark_quantize_ue8m0   per-token 1 x G UE8M0 FP8 quantization (`modules/fp8_block.py`)

Each has a torch reference that runs where the library is not built.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

LIBRARY_GLOB = "_dspark_ops*.so"
_loaded: Optional[bool] = None


def ops_loaded() -> bool:
    """Whether the ops are registered in this process (loading the built library on the first call)."""
    global _loaded
    if _loaded is None:
        for lib in sorted(Path(__file__).resolve().parents[2].glob(LIBRARY_GLOB)):
            torch.ops.load_library(str(lib))
            break
        _loaded = hasattr(torch.ops.trtllm, "dspark_paged_kv_append")
    return _loaded

