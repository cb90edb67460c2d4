"""KV pool specs and the one-budget -> pools split (dtype-true, token parity)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "fp8": torch.float8_e4m3fn}


def kv_dtype_from_name(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """KvCacheConfig.dtype -> torch dtype ('auto' = the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name not in _DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; known: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class KVCacheSpec:
    """One paged pool: `num_layers` tensors of shape (num_pages, planes, heads, P, head_dim).

    GQA: planes=2 (K, V), heads=num_kv_heads. MLA: planes=1, heads=1, head_dim=kv_lora_rank+rope.
    `dtype` is the dtype the pool is really allocated at, which is what it is charged at.
    """

    name: str
    kind: Literal["gqa", "mla"]
    num_layers: int
    planes: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.planes * self.heads * self.head_dim * itemsize

    def page_bytes(self, tokens_per_block: int) -> int:
        return self.bytes_per_token * tokens_per_block

    def layer_shape(self, num_pages: int, tokens_per_block: int) -> tuple[int, ...]:
        return (num_pages, self.planes, self.heads, tokens_per_block, self.head_dim)

    def describe(self, num_pages: int, tokens_per_block: int) -> str:
        return f"{self.num_layers} x {self.layer_shape(num_pages, tokens_per_block)} {str(self.dtype).replace('torch.', '')}"


def split_budget(budget_bytes: int, specs: Sequence[KVCacheSpec], tokens_per_block: int,
                 fixed_bytes: int = 0) -> int:
    """Pages per pool so every pool holds the same tokens (token parity) within the budget.

    Token-independent state (`fixed_bytes`) is subtracted first; each pool is charged at
    its own allocated dtype. Returns num_pages (>= 1) shared by all pools.
    """
    per_page = sum(s.page_bytes(tokens_per_block) for s in specs)
    avail = budget_bytes - fixed_bytes
    if per_page <= 0:
        raise ValueError("KV specs have zero bytes per page")
    pages = avail // per_page
    if pages < 1:
        raise ValueError(f"KV budget {budget_bytes} B (minus {fixed_bytes} B fixed) is smaller than one "
                         f"page of all pools ({per_page} B at tokens_per_block={tokens_per_block})")
    return int(pages)
