"""The page-bounded paged-KV append: a step's new K, V or MLA latents written into each request's
own pages, refusing (never writing) a slot whose page is not one of its request's.

    values       [T, H, D]  bf16 / fp16 / fp32 (heads and dims contiguous, any token stride)
    kv_cache     [pages, planes, H, P, D]  the values' dtype, or fp8 (e4m3 / e5m2: cast on write)
    slot_mapping [T] int64  page * P + offset; -1 = no write (skipped, not refused)
    block_tables [B, W] int32  request b's pages, BAD_PAGE_INDEX where unallocated
    qo_indptr    [B + 1] int32 (ragged), or None with tokens_per_seq = q (request b: tokens b*q..)
    refused      [1] int32  the caller's counter, += the writes whose page is not in the token's request
                 row (or outside the pool); never zeroed by the op, so a persistent counter costs no
                 fill per call and a CUDA-graph replay accumulates into it

The op is C++ (`cpp/dspark_ops.cpp`, CUDA kernel in `cpp/dspark_ops_kernels.cu`, registered as
`torch.ops.trtllm.dspark_paged_kv_append`; `cpp_ops.py` loads it). Without it, `paged_kv_append` runs `check_paged_kv_append`
(the C++ validation's messages, word for word) and `reference_paged_kv_append` (torch ops).
"""
from __future__ import annotations

from typing import Optional

import torch

from .cpp_ops import ops_loaded
from .interface import FP8_KV_DTYPES, write_slots

_C10_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float32: "Float", torch.float64: "Double",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
              torch.bool: "Bool", torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2"}


def dtype_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype (how the C++ messages print it)."""
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _list(xs) -> str:
    return "[" + ", ".join(str(int(x)) for x in xs) + "]"


def check_paged_kv_append(values: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor], tokens_per_seq: int,
                          plane: int, refused: torch.Tensor) -> None:
    """ValueError unless the inputs are valid (the C++ op's checks, in its order and words)."""
    def need(ok: bool, *msg) -> None:
        if not ok:
            raise ValueError("".join(str(m) for m in msg))
    need(values.dim() == 3, "DSpark values must be [T, H, D], got ", values.dim(), "-D")
    need(kv_cache.dim() == 5, "DSpark kv_cache must be [pages, planes, H, P, D], got ", kv_cache.dim(), "-D")
    vt, ct = values.dtype, kv_cache.dtype
    need(vt in (torch.bfloat16, torch.float16, torch.float32),
         "DSpark values dtype must be one of (BFloat16, Half, Float), got ", dtype_name(vt))
    need(ct == vt or ct in FP8_KV_DTYPES, "DSpark kv_cache dtype must be the values' (", dtype_name(vt),
         ") or one of (Float8_e4m3fn, Float8_e5m2), got ", dtype_name(ct))
    need(kv_cache.shape[0] > 0, "DSpark kv_cache must hold at least one page")
    need(kv_cache.stride(0) != 0, "DSpark kv_cache page stride must be non-zero, got strides ", _list(kv_cache.stride()))
    need(values.shape[1] == kv_cache.shape[2], "DSpark num_heads must be the cache's (", kv_cache.shape[2], "), got ",
         values.shape[1])
    need(values.shape[2] == kv_cache.shape[4], "DSpark head_dim must be the cache's (", kv_cache.shape[4], "), got ",
         values.shape[2])
    need(0 <= plane < kv_cache.shape[1], "DSpark plane must be in [0, ", kv_cache.shape[1], "), got ", plane)
    need(slot_mapping.dtype == torch.int64, "DSpark slot_mapping must be Long, got ", dtype_name(slot_mapping.dtype))
    need(slot_mapping.dim() == 1 and slot_mapping.shape[0] == values.shape[0], "DSpark slot_mapping must be [",
         values.shape[0], "], got ", _list(slot_mapping.shape))
    need(block_tables.dtype == torch.int32, "DSpark block_tables must be Int, got ", dtype_name(block_tables.dtype))
    need(block_tables.dim() == 2, "DSpark block_tables must be [B, max_pages], got ", block_tables.dim(), "-D")
    b = block_tables.shape[0]
    if qo_indptr is not None:
        need(qo_indptr.dtype == torch.int32, "DSpark qo_indptr must be Int, got ", dtype_name(qo_indptr.dtype))
        need(qo_indptr.dim() == 1 and qo_indptr.shape[0] == b + 1, "DSpark qo_indptr must be [", b + 1, "], got ",
             _list(qo_indptr.shape))
    else:
        need(tokens_per_seq > 0 and tokens_per_seq * b == values.shape[0], "DSpark tokens_per_seq must split the ",
             values.shape[0], " tokens over ", b, " requests without qo_indptr, got ", tokens_per_seq)
    need(refused.dtype == torch.int32, "DSpark refused must be Int, got ", dtype_name(refused.dtype))
    need(refused.dim() == 1 and refused.shape[0] == 1, "DSpark refused must be [1], got ", _list(refused.shape))
    dev = values.device
    for name, t in (("kv_cache", kv_cache), ("slot_mapping", slot_mapping), ("block_tables", block_tables),
                    ("qo_indptr", qo_indptr), ("refused", refused)):
        if t is not None:
            need(t.device == dev, "DSpark ", name, " must be on ", dev, " (the values' device), got ", t.device)
    need(values.stride(2) == 1 and values.stride(1) == values.shape[2],
         "DSpark values must have contiguous heads and dims (strides [*, ", values.shape[2], ", 1]), got ",
         _list(values.stride()))
    for name, t in (("kv_cache", kv_cache), ("slot_mapping", slot_mapping), ("block_tables", block_tables),
                    ("qo_indptr", qo_indptr)):
        if t is not None:
            need(t.is_contiguous(), "DSpark ", name, " must be contiguous")


def reference_paged_kv_append(values: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor], tokens_per_seq: int,
                              plane: int, refused: torch.Tensor) -> None:
    """The op's semantics in torch ops (inputs already checked): the owned slots written, refused
    [1] int32 += the others (-1 slots not counted)."""
    t_n, dev = values.shape[0], values.device
    pages, _, heads, p, _ = kv_cache.shape
    tok = torch.arange(t_n, device=dev)
    if qo_indptr is not None:
        owner = torch.searchsorted(qo_indptr[1:-1].long(), tok, right=True)
    else:
        owner = tok // tokens_per_seq
    page = torch.div(slot_mapping, p, rounding_mode="floor")
    wants = slot_mapping >= 0
    owned = wants & (block_tables.long()[owner] == page[:, None]).any(1) & (page < pages)
    write_slots(kv_cache[:, plane], values, torch.where(owned, slot_mapping, -1))
    refused.add_((wants & ~owned).sum().to(torch.int32))


def paged_kv_append(values: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, plane: int,
                    refused: torch.Tensor) -> None:
    """Write `values` into `kv_cache` (in place) at `slot_mapping`, refusing slots outside their
    request's pages and adding their count to `refused` [1] int32 (on the values' device, no sync).
    The C++ op when it is built, else the checked reference."""
    if ops_loaded():
        torch.ops.trtllm.dspark_paged_kv_append(values, kv_cache, slot_mapping, block_tables, qo_indptr,
                                                tokens_per_seq, plane, refused)
        return
    check_paged_kv_append(values, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, plane, refused)
    reference_paged_kv_append(values, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, plane, refused)
