"""The greedy drafts' Markov chain in n + 1 Triton launches (CUDA; Triton's interpreter on a CPU test).

Draft j of a request is the argmax over the vocabulary of its slot's LM-head logits plus the Markov
bias of draft j-1 (the anchor for j = 0), bias = w2 @ w1[prev] (`MarkovHead`, rank r). Done with
torch ops, each draft is three kernels (the embedding row, a [R, r] x [r, V] GEMM, a fused add +
argmax that a small batch runs on one block per row): ~13.5 us per draft on an H200 at batch 1.

Here launch j (grid: blocks of up to 16 rows x vocabulary tiles of 512) first finishes draft j-1:
a program reduces, for all its rows at once, the per-tile maxima that launch j-1 left (lowest index
among equal maxima, as `torch.argmax`) to the previous picks, and tile 0 stores them. Then it adds
the bias over its vocabulary tile (one tensor-core dot of the rows' Markov rows [16, r] and the tile's
[512, r] weights, read as one block each: float32 accumulation of exact products; rounded to the
weights' dtype as the torch GEMM's output is) to the rows' logits tile and leaves each row's tile
maximum and its index. F32_DOT: the dot in float32 (`ieee`): the CPU interpreter, whose 16-bit dot is
wrong, and float32 weights (no tf32). A last launch reduces the final draft. The rows are
one [rows, tile] block, so a program's dependent loads (previous maxima, Markov rows) are issued
once, not once per row.
The partials alternate between two buffers, so launch j reads what launch j-1 wrote.

`markov_greedy_chain` is the reference-checked entry point: the ids equal `dspark_regions.
greedy_drafts` (torch ops) wherever a row's top two biased logits differ by more than rounding
(`tests/unittest/_torch/models/test_dspark_markov_kernel.py`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_BLOCK_R = 16      # rows per program (they share the program's tile of Markov weights)
BLOCK_V = 512         # vocabulary entries per program
NO_INDEX = tl.constexpr(2 ** 31 - 1)   # a global a Triton kernel reads must be a constexpr


@triton.jit
def _markov_draft_kernel(logits_ptr, stride_lr, stride_lj, anchors_ptr, w1_ptr, stride_w1, w2_ptr, stride_w2,
                         pval_ptr, pidx_ptr, ids_ptr, stride_ir, R, V, NT, j, rank,
                         HAS_MARKOV: tl.constexpr, FIRST: tl.constexpr, SCAN: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
                         RANK_P: tl.constexpr, F32_DOT: tl.constexpr):
    tile = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    if FIRST:
        prev = tl.load(anchors_ptr + rows, mask=rmask, other=0)
    else:       # draft j-1's pick per row: the lowest index among its tiles' equal maxima
        ts = tl.arange(0, BLOCK_T)
        src = ((j - 1) % 2) * R * NT + rows[:, None] * NT + ts[None, :]
        pmask = rmask[:, None] & (ts < NT)[None, :]
        pv = tl.load(pval_ptr + src, mask=pmask, other=float("-inf"))
        pi = tl.load(pidx_ptr + src, mask=pmask, other=NO_INDEX)
        prev = tl.min(tl.where(pv == tl.max(pv, axis=1)[:, None], pi, NO_INDEX), axis=1)
        if tile == 0:
            tl.store(ids_ptr + rows * stride_ir + (j - 1), prev.to(tl.int64), mask=rmask)
    if SCAN:
        lptr = logits_ptr + rows[:, None].to(tl.int64) * stride_lr + j * stride_lj + cols[None, :]
        lj = tl.load(lptr, mask=rmask[:, None] & cmask[None, :], other=float("-inf")).to(tl.float32)
        if HAS_MARKOV:
            # bias [rows, tile] = w1[prev] @ w2[tile]^T: one dot over the rank (zero-padded to RANK_P) with
            # float32 accumulation of the weights' exact products, then rounded to their dtype as the torch
            # GEMM's output is
            k = tl.arange(0, RANK_P)
            kmask = k < rank
            e = tl.load(w1_ptr + tl.where(rmask, prev, 0).to(tl.int64)[:, None] * stride_w1 + k[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * stride_w2 + k[None, :],
                        mask=cmask[:, None] & kmask[None, :], other=0.0)
            if F32_DOT:
                bias = tl.dot(e.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                bias = tl.dot(e, tl.trans(w))
            lj = lj + bias.to(w2_ptr.dtype.element_ty).to(tl.float32)
        best, arg = tl.max(lj, axis=1, return_indices=True, return_indices_tie_break_left=True)
        dst = (j % 2) * R * NT + rows * NT + tile
        tl.store(pval_ptr + dst, best, mask=rmask)
        tl.store(pidx_ptr + dst, arg + tile * BLOCK_V, mask=rmask)


def markov_greedy_chain(logits: torch.Tensor, anchor_ids: torch.Tensor, w1: Optional[torch.Tensor],
                        w2: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [R, n, V] (any float dtype; last dim contiguous), anchor_ids [R] int64, Markov weights
    w1 [V, r] / w2 [V, r] (both None without a Markov head) -> draft ids [R, n] int64 (module doc)."""
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [R, n, V] with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    r, n, v = logits.shape
    if anchor_ids.shape != (r,):
        raise ValueError(f"anchor_ids must be [{r}], got {tuple(anchor_ids.shape)}")
    if (w1 is None) != (w2 is None):
        raise ValueError("the Markov weights w1 and w2 come together (both None without a Markov head)")
    if w1 is not None and (w1.dim() != 2 or w1.shape != w2.shape or w1.shape[0] != v or w1.stride(-1) != 1
                           or w2.stride(-1) != 1 or w1.dtype != w2.dtype):
        raise ValueError(f"Markov weights must both be [{v}, r] of one dtype with a contiguous last dim, got "
                         f"{tuple(w1.shape)} {w1.dtype} and {tuple(w2.shape)} {w2.dtype}")
    ids = torch.empty(r, n, dtype=torch.int64, device=logits.device)
    if r == 0 or n == 0:
        return ids
    nt = triton.cdiv(v, BLOCK_V)
    pval = torch.empty(2, r, nt, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(2, r, nt, dtype=torch.int32, device=logits.device)
    markov = w1 is not None
    rank = w1.shape[1] if markov else 0
    wa, wb = (w1, w2) if markov else (logits, logits)
    # the bias dot needs 16 rows (tensor cores); the argmax alone spreads few rows over small blocks
    block_r = MAX_BLOCK_R if markov else min(MAX_BLOCK_R, max(2, triton.next_power_of_2(r)))
    f32_dot = logits.device.type != "cuda" or (markov and w1.dtype == torch.float32)
    common = dict(HAS_MARKOV=markov, BLOCK_R=block_r, BLOCK_V=BLOCK_V, BLOCK_T=max(16, triton.next_power_of_2(nt)),
                  RANK_P=max(16, triton.next_power_of_2(rank)), F32_DOT=f32_dot,
                  num_warps=8 if block_r > 4 else 4)
    rb = triton.cdiv(r, block_r)
    anchors = anchor_ids.contiguous()
    for j in range(n + 1):
        scan = j < n
        _markov_draft_kernel[(rb, nt if scan else 1)](
            logits, logits.stride(0), logits.stride(1), anchors, wa, wa.stride(0), wb, wb.stride(0), pval, pidx,
            ids, ids.stride(0), r, v, nt, j, rank, FIRST=j == 0, SCAN=scan, **common)
    return ids


def greedy_drafts_triton(hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_w: torch.Tensor,
                         lm_b: Optional[torch.Tensor], markov_w1: Optional[torch.Tensor],
                         markov_w2: Optional[torch.Tensor], block_size: int, first: int,
                         num_drafts: int) -> torch.Tensor:
    """`dspark_regions.greedy_drafts` with the Markov chain in Triton: the LM-head GEMM (logits in the
    weights' dtype, never widened to float32 in memory), then `markov_greedy_chain`."""
    r = anchor_ids.shape[0]
    h = hidden.reshape(r, block_size, -1)[:, first:first + num_drafts].reshape(r * num_drafts, -1)
    logits = F.linear(h.to(lm_w.dtype), lm_w, lm_b).view(r, num_drafts, -1)
    return markov_greedy_chain(logits, anchor_ids, markov_w1, markov_w2)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] (any float dtype, e.g. the target's bf16 logits) -> [N] int64, `torch.argmax(x, -1)`
    (lowest index among equal maxima; a NaN is not a maximum here, where torch would pick it) as two
    launches over vocabulary tiles: one program per 8 rows and tile, so a few rows still spread over
    the GPU (torch reduces a row on one block)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, V], got {tuple(x.shape)}")
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return markov_greedy_chain(rows.unsqueeze(1), torch.zeros(rows.shape[0], dtype=torch.int64, device=x.device),
                               None, None)[:, 0]
