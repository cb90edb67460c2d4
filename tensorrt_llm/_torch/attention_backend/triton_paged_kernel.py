"""Paged attention with the KV lengths read on the device (Triton): no host plan, so a step whose
lengths are only known on the GPU (the draft block placed after a verify step's acceptance)
can be launched, and captured in a CUDA graph, before the host learns them.

One program per (request, KV head, block of query rows); a row is (query i, q head g of the KV
head's group), so MLA (one latent "KV head" shared by all heads) packs queries x heads into
rows. It walks the request's pages through its block-table row up to kv_lens[b]; keys past the
length, in an unallocated page (BAD_PAGE_INDEX: its writes were skipped), and for causal steps
past the query's own position, are masked (and never loaded)::

    query i of request b sits at position kv_lens[b] - n_q[b] + i
    causal     : it sees keys at positions <= its own
    non-causal : it sees every key < kv_lens[b] (a DSpark draft block)

Queries are packed request-major: uniform (n_q[b] = q_per_seq, the decode / verify / draft-block
shapes) or ragged (request b's rows are qo_indptr[b]..qo_indptr[b+1]-1: prompt chunks).

Split KV (flash-decoding): when (request, KV head, row block) programs are too few to fill the GPU
(a small batch), each also takes one of `num_splits` page ranges (a split of the request's pages,
sized on the device from kv_lens[b]), writes its unnormalised output with its running max and sum
to a workspace, and a second kernel merges the splits. The split count depends on the launch
shape only, so a captured graph keeps it.

The page walk is software-pipelined (up to three stages: the next pages' tiles load while this one
is used) as far as the tiles and the queries fit the GPU's shared memory; rows per program, warps
and stages per launch shape come from `launch_config` (on an H200, 64-row blocks and three stages
took a 9-token verify at batch 64 from 12.1 to 9.1 us and the MLA draft block from ~58 to 30 us).

GQA cache [pages, 2, Hkv, P, D]: K = plane 0, V = plane 1, value width D.
MLA cache [pages, 1, 1, P, R + r]: K = the whole latent (scores over the R latent dims plus the
r rope dims), V = its first R dims.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cp, stride_cplane, stride_ch,
                            stride_cs, bt_ptr, stride_bt, lens_ptr, qo_ptr, out_ptr, stride_ot, stride_oh, scale,
                            qps, ws_acc_ptr, ws_ml_ptr, n_tok, n_heads, G: tl.constexpr, DV: tl.constexpr,
                            DR: tl.constexpr, K_PLANE: tl.constexpr, V_PLANE: tl.constexpr, PAGE: tl.constexpr,
                            BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, RAGGED: tl.constexpr,
                            SPLIT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) % SPLIT
    rows = (tl.program_id(2) // SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    head = kvh * G + rows % G
    if RAGGED:
        q_begin = tl.load(qo_ptr + b)
        n_q = tl.load(qo_ptr + b + 1) - q_begin
    else:
        q_begin = b * qps
        n_q = qps
    row_ok = rows < n_q * G
    tok = q_begin + qi
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    qpos = kv_len - n_q + qi
    d = tl.arange(0, DV)
    q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
    if DR > 0:
        dr = tl.arange(0, DR)
        q_r = tl.load(q_rows + DV + dr[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    offs = tl.arange(0, PAGE)
    n_pages = tl.cdiv(kv_len, PAGE)
    first_row = (tl.program_id(2) // SPLIT) * BLOCK_M
    if CAUSAL:   # pages past the block's last query position hold only masked keys: not walked
        last_q = tl.minimum((first_row + BLOCK_M - 1) // G, n_q - 1)
        n_pages = tl.minimum(n_pages, tl.cdiv(kv_len - n_q + last_q + 1, PAGE))
    n_pages = tl.where(first_row < n_q * G, n_pages, 0)     # a block without query rows walks nothing
    per_split = tl.cdiv(n_pages, SPLIT)
    j_end = tl.minimum(n_pages, (split + 1) * per_split)
    for j in range(split * per_split, j_end):
        page = tl.load(bt_ptr + b * stride_bt + j).to(tl.int64)
        n = j * PAGE + offs
        key_ok = n < tl.where(page >= 0, kv_len, 0)   # an unallocated page (BAD_PAGE_INDEX) is never read
        slot = cache_ptr + page * stride_cp + kvh * stride_ch + offs[:, None] * stride_cs
        k = tl.load(slot + K_PLANE * stride_cplane + d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        if DR > 0:
            k_r = tl.load(slot + K_PLANE * stride_cplane + DV + dr[None, :], mask=key_ok[:, None], other=0.0)
            s += tl.dot(q_r, tl.trans(k_r))
        s = s * scale
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (n[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)     # no key seen yet: keep 0 / 0 out
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PLANE == K_PLANE:    # MLA: the value is the latent's first DV dims, the tile just loaded
            v = k
        else:
            v = tl.load(slot + V_PLANE * stride_cplane + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLIT == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:   # partials: [SPLIT, T, Hq, DV] unnormalised output, [SPLIT, T, Hq, 2] (max, sum)
        at = (split * n_tok + tok) * n_heads + head
        tl.store(ws_acc_ptr + at[:, None] * DV + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_ml_ptr + at * 2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + at * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, stride_ot, stride_oh, n_tok, n_heads,
                         DV: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (token, head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLIT)
    at = (sp * n_tok + t) * n_heads + h
    m = tl.load(ws_ml_ptr + at * 2)
    l = tl.load(ws_ml_ptr + at * 2 + 1)
    m_max = tl.max(m, 0)
    empty = m == float("-inf")                                 # a split without keys weighs nothing
    w = tl.where(empty, 0.0, tl.exp(tl.where(empty, m_max, m) - m_max))
    d = tl.arange(0, DV)
    acc = tl.load(ws_acc_ptr + at[:, None] * DV + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(w * l, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _mla_value_proj_kernel(lat_ptr, stride_lt, stride_lh, wuv_ptr, out_ptr, stride_ot, stride_oh, n_tok,
                           R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, RC: tl.constexpr, VC: tl.constexpr,
                           F32_DOT: tl.constexpr):
    """Program (token block, head h, value block): out[t, h, vb] = o_lat[t, h] W_UV[h, vb]^T for the block's
    tokens (o_lat [BT, R], the attention's output; float32 accumulation). F32_DOT: the dot's operands
    in float32 (the CPU interpreter, whose 16-bit dot is wrong)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    v = tl.program_id(2) * VC + tl.arange(0, VC)
    ok = t < n_tok
    out = tl.zeros([BT, VC], tl.float32)
    for r0 in tl.static_range(0, R, RC):
        rc = r0 + tl.arange(0, RC)
        lat = tl.load(lat_ptr + t[:, None] * stride_lt + h * stride_lh + rc[None, :], mask=ok[:, None], other=0.0)
        w_t = tl.load(wuv_ptr + h * (V * R) + v[None, :] * R + rc[:, None])          # W_UV[h, vb]^T [RC, VC]
        if F32_DOT:
            lat, w_t = lat.to(tl.float32), w_t.to(tl.float32)
        out += tl.dot(lat, w_t)
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


MAX_SPLITS = 16


@functools.cache
def _gpu_limits(index: int) -> tuple[int, int]:
    """(SMs, opt-in shared memory bytes per program) of CUDA device `index`, read once per process
    (every launch sizes its grid and stages from them)."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def default_num_splits(programs: int, device: torch.device) -> int:
    """Splits that bring `programs` (request x KV head x row block) up to about the number of SMs:
    a power of two <= MAX_SPLITS, 1 when the programs fill the GPU already (CPU: 1)."""
    if device.type != "cuda":
        return 1
    sms = _gpu_limits(_cuda_index(device))[0]
    n = 1
    while n < MAX_SPLITS and programs * n * 2 <= sms:
        n *= 2
    return n


@dataclass(frozen=True)
class LaunchConfig:
    """How one launch shape runs: query rows per program, warps per program, pipeline stages of
    the page walk (`launch_config`)."""

    block_m: int
    num_warps: int
    num_stages: int


CPU_SMEM_BUDGET = 160 * 1024    # the interpreter has no shared memory; a fixed budget keeps configs deterministic


def smem_budget(device: torch.device) -> int:
    """Bytes of shared memory the page tiles and q may take: 85% of what one program may opt into
    on this GPU (H100 / H200: 227 KiB -> 193 KiB), leaving room for the kernel's other buffers."""
    if device.type != "cuda":
        return CPU_SMEM_BUDGET
    return int(0.85 * _gpu_limits(_cuda_index(device))[1])


def _num_stages(page_size: int, width: int, block_m: int, itemsize: int, budget: int) -> int:
    """The most stages (3, 2, else 1) whose page tiles ([page, width] each) plus the [block_m,
    width] queries fit in `budget` bytes: the next pages' tiles load while this one is used."""
    for stages in (3, 2):
        if (stages * page_size + block_m) * width * itemsize <= budget:
            return stages
    return 1


def launch_config(programs_per_block_row: int, rows: int, page_size: int, width: int, itemsize: int, mla: bool,
                  device: torch.device) -> LaunchConfig:
    """The kernel's config for `rows` query rows per (request, KV head) and `programs_per_block_row`
    = requests x KV heads. Up to 16 rows take one 16-row block. More rows take the largest block
    of 64 / 32 / 16 whose programs still reach half the GPU's SMs and whose queries fit the shared
    memory budget beside one page tile: on an H200 a 64-row block was the fastest even where the
    rows are fewer (a 9-token verify's 27 rows of a 3-head group), a small batch wants smaller
    blocks for more programs. MLA (576-wide latent tiles) runs 8 warps, GQA 4. Stages:
    `_num_stages` under `smem_budget` (`examples/gpu/attention_bench.py --configs`)."""
    sms = _gpu_limits(_cuda_index(device))[0] if device.type == "cuda" else 1
    budget = smem_budget(device)
    block_m = 16
    if rows > 16:
        for bm in (64, 32):   # (a block whose queries and one page tile overflow the budget is not taken)
            if programs_per_block_row * triton.cdiv(rows, bm) * 2 >= sms and \
                    (page_size + bm) * width * itemsize <= budget:
                block_m = bm
                break
    return LaunchConfig(block_m, 8 if mla else 4, _num_stages(page_size, width, block_m, itemsize, budget))


def shape_support(v_dim: int, rope_dim: int, page_size: int) -> str:
    """'' when the kernel runs these widths, else why not (value and rope widths and the page size
    must be powers of two, the value width and page size >= 16, a rope width 0 or >= 16)."""
    for name, n in (("value width", v_dim), ("rope width", rope_dim), ("page size", page_size)):
        if n and n & (n - 1):
            return f"{name} {n} is not a power of two"
    if page_size < 16 or v_dim < 16 or 0 < rope_dim < 16:
        return f"page size {page_size}, value width {v_dim} and rope width {rope_dim} must be >= 16 (rope: or 0)"
    return ""


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float, causal: bool, v_dim: int, mla: bool, qo_indptr: Optional[torch.Tensor] = None,
                    max_q: int = 0, num_splits: Optional[int] = None,
                    config: Optional[LaunchConfig] = None, v_proj: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, Hq, Dqk] (packed request-major; any token and head strides, a contiguous last dim: a
    view of a layer's q|k|v buffer is read in place) over the pages of kv_cache (module doc) ->
    [T, Hq, v_dim] in q's dtype. num_splits: KV splits per program (a power of two <= MAX_SPLITS;
    default `default_num_splits`); config: rows per program, warps and stages (default
    `launch_config`; block_m a power of two >= 16).

    Uniform (qo_indptr None): T = B * q_per_seq. Ragged: qo_indptr [B+1] int32 on q's device and
    max_q >= the most rows any request has. block_tables [B, max_pages] int32 and kv_lens [B]
    (int32 / int64) on q's device; every page a request reads (kv_lens[b] / P rounded up) must be
    a real page of it, and kv_lens[b] >= its query rows.

    MLA with v_proj (W_UV [Hq, v, v_dim] contiguous, q's dtype): the output [T, Hq, v] is each head's
    latent-space output through W_UV, formed by one launch after the attention (`mla_value_projection`)
    instead of a batched GEMM and its layout copies.
    """
    b = kv_lens.shape[0]
    t, hq, dqk = q.shape
    pages, planes, hkv, page_size, width = kv_cache.shape
    if qo_indptr is not None:
        if qo_indptr.shape != (b + 1,) or max_q < 1:
            raise ValueError(f"ragged queries need qo_indptr [{b + 1}] and max_q >= 1, got "
                             f"{tuple(qo_indptr.shape)} and {max_q}")
    elif b == 0 or t % b:
        raise ValueError(f"{t} query rows do not split evenly over {b} requests")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    dr = dqk - v_dim
    if mla:
        if planes != 1 or hkv != 1 or width != dqk:
            raise ValueError(f"MLA needs a [pages, 1, 1, P, {dqk}] cache, got {tuple(kv_cache.shape)}")
    elif planes != 2 or width != dqk or dr != 0:
        raise ValueError(f"GQA needs a [pages, 2, Hkv, P, {dqk}] cache and v_dim {dqk}, got "
                         f"{tuple(kv_cache.shape)}, v_dim {v_dim}")
    if v_proj is not None and (not mla or v_proj.dim() != 3 or v_proj.shape[0] != hq or v_proj.shape[2] != v_dim
                               or not v_proj.is_contiguous() or v_proj.dtype != q.dtype or v_proj.shape[1] < 16
                               or v_proj.shape[1] & (v_proj.shape[1] - 1) or v_dim < 16):
        raise ValueError(f"v_proj must be MLA's W_UV [{hq}, v, {v_dim}] (v a power of two >= 16), contiguous "
                         f"{q.dtype}, got {None if v_proj is None else (tuple(v_proj.shape), v_proj.dtype)}"
                         f"{'' if mla else ' on a GQA cache'}")
    why = shape_support(v_dim, dr, page_size)
    if why:
        raise ValueError(why)
    if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV cache need a contiguous last dimension")
    ragged = qo_indptr is not None
    qps, g = (max_q if ragged else t // b), hq // hkv
    cfg = config or launch_config(b * hkv, qps * g, page_size, dqk, q.element_size(), mla, q.device)
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1) or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"config needs a power-of-two block_m >= 16 and positive warps and stages, got {cfg}")
    row_blocks = triton.cdiv(qps * g, cfg.block_m)
    splits = default_num_splits(b * hkv * row_blocks, q.device) if num_splits is None else num_splits
    if splits < 1 or splits > MAX_SPLITS or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {splits}")
    out = torch.empty(t, hq, v_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        ws_acc = torch.empty(splits, t, hq, v_dim, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(splits, t, hq, 2, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out
    _paged_attention_kernel[(b, hkv, row_blocks * splits)](
        q, q.stride(0), q.stride(1), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables, block_tables.stride(0), kv_lens, qo_indptr if ragged else kv_lens,
        out, out.stride(0), out.stride(1), float(scale), qps, ws_acc, ws_ml, t, hq, G=g, DV=v_dim, DR=dr,
        K_PLANE=0, V_PLANE=0 if mla else 1, PAGE=page_size, BLOCK_M=cfg.block_m, CAUSAL=causal, RAGGED=ragged,
        SPLIT=splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _merge_splits_kernel[(t, hq)](ws_acc, ws_ml, out, out.stride(0), out.stride(1), t, hq, DV=v_dim,
                                      SPLIT=splits, num_warps=4)
    return out if v_proj is None else mla_value_projection(out, v_proj)


def mla_block_tokens(n_tok: int) -> int:
    """Tokens per program of the absorbed-MLA launches that take one head's rows as a matrix (the W_UK
    product in `triton_rope_append.mla_rope_append`, W_UV in `mla_value_projection`): 16, or 64 past
    256 tokens so a large batch reads each head's weight fewer times."""
    return 16 if n_tok <= 256 else 64


def mla_value_projection(lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """lat [T, H, R] (the attention's latent-space output, any token / head strides, contiguous dims),
    w_uv [H, v, R] -> [T, H, v] = lat W_UV^T per head, one launch (programs per token block, head and,
    up to 256 tokens, 16-wide value block: a small batch still spreads over the GPU)."""
    t, hq, rank = lat.shape
    v = w_uv.shape[1]
    out = torch.empty(t, hq, v, dtype=lat.dtype, device=lat.device)
    if t == 0:
        return out
    bt = mla_block_tokens(t)
    vc = 16 if t <= 256 else v
    _mla_value_proj_kernel[(triton.cdiv(t, bt), hq, v // vc)](
        lat, lat.stride(0), lat.stride(1), w_uv, out, out.stride(0), out.stride(1), t, R=rank, V=v, BT=bt,
        RC=min(rank, 128), VC=vc, F32_DOT=lat.device.type != "cuda", num_warps=4)
    return out
