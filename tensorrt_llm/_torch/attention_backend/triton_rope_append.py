"""RoPE of q and k fused with the page-bounded paged-KV append (Triton): one launch per layer
instead of a rotation kernel and an append kernel (and, with `HeadNorms`, the per-head q / k
RMSNorms before the rotation: the DSpark drafter's GQA layers).

One program per token t:
    q_out[t]  = rope(norm_q(q[t]))                       (every query head)
    cache[slot[t] // P, 0, :, slot[t] % P] = rope(norm_k(k[t])),   plane 1 = v[t]
where rope is the half rotation with the full-width signed tables of `RotaryEmbedding.cos_sin`
(x * cos + [x2 | x1] * sin in float32, then the output dtype), exactly the rotation
`compiled_regions.attention_inputs` applies, and norm_q / norm_k are the identity or `rms_norm`
over each head (float32 statistics; the normed value rounded to x's dtype, times the weight,
rounded again: `modules.rms_norm`'s order). The absorbed-MLA form (`mla_rope_append`, the MLA
drafter's layers) builds q_out[t] = [q_lat[t] | rope(q_pe[t])] and appends the latent
[rms_norm(c_kv[t]) | rope(k_pe[t])] as the cache's one plane; given W_UK it forms q_lat[t] = q_nope[t]
W_UK itself (one dot per head, 128-wide column chunk and block of tokens), so the layer needs no batched
GEMM and layout copies for it. Its programs are (token block, head x column chunk) plus one per token for
the appends.

The write is bounded as `paged_append.py`'s op: a slot of -1 is skipped; a slot whose page is not
in its request's block-table row (or is outside the pool) is refused, never written, and counted
into `refused` [1] int32 (one per token: both planes are one write). A token's request is
t // tokens_per_seq (uniform steps) or the request whose rows qo_indptr[b]..qo_indptr[b+1]-1 hold
it (ragged; rows past qo_indptr[B], a captured step's padding, are the last request's).

    q [T, Hq, D], k / v [T, Hkv, D]   heads and dims contiguous, any token stride (views of one
                                      q|k|v GEMM output are read in place)
    cos / sin [T, 1, D] float32       any token stride
    kv_cache [pages, 2, Hkv, P, D]    the values' dtype (MLA: [pages, 1, 1, P, R + r])
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .interface import HeadNorms
from .rope_append_checks import check_mla_rope_append, check_rope_append
from .triton_paged_kernel import mla_block_tokens


@triton.jit
def _normed(x, w_ptr, idx, r, NORM: tl.constexpr):
    """x [H, D] float32 times r [H] (the rows' rsqrt statistic), rounded to w's dtype, times the
    weight at idx, rounded again; x as is without NORM."""
    if NORM:
        dt = w_ptr.dtype.element_ty
        w = tl.load(w_ptr + idx).to(tl.float32)
        return ((x * r[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
    return x


@triton.jit
def _rotate(x_ptr, heads, n_heads, d, dsw, cos, sin, w_ptr, eps, D: tl.constexpr, NORM: tl.constexpr):
    """rope (after the per-head norm with weight w_ptr when NORM) of the rows x_ptr + heads * D + d
    (masked past n_heads), float32."""
    ok = heads[:, None] < n_heads
    x = tl.load(x_ptr + heads[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xs = tl.load(x_ptr + heads[:, None] * D + dsw[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    return _normed(x, w_ptr, d, r, NORM) * cos[None, :] + _normed(xs, w_ptr, dsw, r, NORM) * sin[None, :]


@triton.jit
def _owns(t, page, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages, RAGGED: tl.constexpr,
          BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr):
    """Whether `page` is in token t's request's block-table row (and in the pool): t's request is
    t // qps, or (ragged) the count of requests whose rows end at or before t; rows past the last
    request's (padding) are the last request's, as in the C++ op."""
    if RAGGED:
        owner = 0
        for b0 in range(0, n_req, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ends = tl.load(qo_ptr + 1 + b, mask=b < n_req, other=2147483647)
            owner += tl.sum((ends <= t).to(tl.int32))
        owner = tl.minimum(owner, n_req - 1)
    else:
        owner = t // qps
    found = 0
    for j0 in range(0, width, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)
        row = tl.load(bt_ptr + owner * stride_bt + j, mask=j < width, other=-1)
        found += tl.sum((row == page).to(tl.int32))
    return (found > 0) & (page < pages)


@triton.jit
def _rope_append_kernel(q_ptr, stride_qt, k_ptr, stride_kt, v_ptr, stride_vt, cos_ptr, stride_cos, sin_ptr,
                        stride_sin, out_ptr, cache_ptr, stride_cp, stride_cplane, slots_ptr, bt_ptr, stride_bt,
                        width, qo_ptr, n_req, qps, pages, refused_ptr, qn_ptr, kn_ptr, eps,
                        NORM: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr,
                        HKV_P: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, RAGGED: tl.constexpr, BLOCK_W: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, D)
    dsw = (d + D // 2) % D
    cos = tl.load(cos_ptr + t * stride_cos + d)
    sin = tl.load(sin_ptr + t * stride_sin + d)
    hq = tl.arange(0, HQ_P)
    q = _rotate(q_ptr + t * stride_qt, hq, HQ, d, dsw, cos, sin, qn_ptr, eps, D, NORM)
    tl.store(out_ptr + t * HQ * D + hq[:, None] * D + d[None, :], q.to(out_ptr.dtype.element_ty),
             mask=hq[:, None] < HQ)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        page = slot // PAGE
        if _owns(t, page, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages, RAGGED, BLOCK_W, BLOCK_B):
            hk = tl.arange(0, HKV_P)
            cell = cache_ptr + page * stride_cp + hk[:, None] * (PAGE * D) + (slot % PAGE) * D + d[None, :]
            ok = hk[:, None] < HKV
            k = _rotate(k_ptr + t * stride_kt, hk, HKV, d, dsw, cos, sin, kn_ptr, eps, D, NORM)
            tl.store(cell, k.to(cache_ptr.dtype.element_ty), mask=ok)
            v = tl.load(v_ptr + t * stride_vt + hk[:, None] * D + d[None, :], mask=ok, other=0.0)
            tl.store(cell + stride_cplane, v.to(cache_ptr.dtype.element_ty), mask=ok)
        else:
            tl.atomic_add(refused_ptr, 1)


@triton.jit
def _mla_rope_append_kernel(qf_ptr, stride_qft, stride_qfh, wuk_ptr, qp_ptr, stride_qpt, stride_qph, kv_ptr, stride_kvt,
                            cos_ptr, stride_cos, sin_ptr, stride_sin, norm_ptr, eps, out_ptr, cache_ptr, stride_cp,
                            slots_ptr, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages, refused_ptr, n_tok,
                            H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, NOPE: tl.constexpr,
                            ABSORB: tl.constexpr, BT: tl.constexpr, RC: tl.constexpr, NC: tl.constexpr,
                            PAGE: tl.constexpr,
                            RAGGED: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr,
                            F32_DOT: tl.constexpr, IEEE: tl.constexpr):
    """Program (token block tb, h): h < H * NC builds columns c*RC.. (c = h % NC) of head h // NC's q rows
    of tokens tb*BT.. (q_nope W_UK[head] by one dot with ABSORB, else q_lat copied; c = 0 also rope(q_pe)),
    so the R-wide product spreads over NC programs per head; h = H * NC + i appends token tb*BT + i's latent.
    F32_DOT: the dot's operands in float32 (the CPU interpreter, whose 16-bit dot is wrong); IEEE: a float32
    model's product in full float32 (tl.dot's default for float32 operands is TF32)."""
    tb = tl.program_id(0)
    h = tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    tok = (t < n_tok)[:, None]
    if h < H * NC:
        dt = out_ptr.dtype.element_ty
        head = h // NC
        rc = (h % NC) * RC + tl.arange(0, RC)
        row = out_ptr + t[:, None] * (H * (R + DR)) + head * (R + DR)
        qf = qf_ptr + t[:, None] * stride_qft + head * stride_qfh
        if ABSORB:     # q_lat[:, rc] = q_nope [BT, NOPE] @ W_UK[head][:, rc], float32 accumulation
            n = tl.arange(0, NOPE)
            q_nope = tl.load(qf + n[None, :], mask=tok, other=0.0)
            w = tl.load(wuk_ptr + head * (NOPE * R) + n[:, None] * R + rc[None, :])
            if F32_DOT:
                q_nope, w = q_nope.to(tl.float32), w.to(tl.float32)
            if IEEE:
                lat = tl.dot(q_nope, w, input_precision="ieee")
            else:
                lat = tl.dot(q_nope, w)
            tl.store(row + rc[None, :], lat.to(dt), mask=tok)
        else:
            tl.store(row + rc[None, :], tl.load(qf + rc[None, :], mask=tok, other=0.0).to(dt), mask=tok)
        if h % NC == 0:
            d = tl.arange(0, DR)
            dsw = (d + DR // 2) % DR
            cos = tl.load(cos_ptr + t[:, None] * stride_cos + d[None, :], mask=tok, other=0.0)
            sin = tl.load(sin_ptr + t[:, None] * stride_sin + d[None, :], mask=tok, other=0.0)
            qp = qp_ptr + t[:, None] * stride_qpt + head * stride_qph
            x = tl.load(qp + d[None, :], mask=tok, other=0.0).to(tl.float32)
            xs = tl.load(qp + dsw[None, :], mask=tok, other=0.0).to(tl.float32)
            tl.store(row + R + d[None, :], (x * cos + xs * sin).to(dt), mask=tok)
    else:                  # one program per token of the block: the appends' dependent loads in parallel
        ti = tb * BT + h - H * NC
        if ti < n_tok:
            _mla_append_one(ti, kv_ptr, stride_kvt, cos_ptr, stride_cos, sin_ptr, stride_sin, norm_ptr, eps,
                            cache_ptr, stride_cp, slots_ptr, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages,
                            refused_ptr, R, DR, PAGE, RAGGED, BLOCK_W, BLOCK_B)


@triton.jit
def _mla_append_one(t, kv_ptr, stride_kvt, cos_ptr, stride_cos, sin_ptr, stride_sin, norm_ptr, eps, cache_ptr,
                    stride_cp, slots_ptr, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages, refused_ptr,
                    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, RAGGED: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr):
    """Token t's latent [rms_norm(c_kv) | rope(k_pe)] into its slot, if its request owns the page."""
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        page = slot // PAGE
        if _owns(t, page, bt_ptr, stride_bt, width, qo_ptr, n_req, qps, pages, RAGGED, BLOCK_W, BLOCK_B):
            dt = cache_ptr.dtype.element_ty
            r = tl.arange(0, R)
            d = tl.arange(0, DR)
            dsw = (d + DR // 2) % DR
            c = tl.load(kv_ptr + t * stride_kvt + r).to(tl.float32)
            w = tl.load(norm_ptr + r).to(tl.float32)
            c = (c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps)).to(kv_ptr.dtype.element_ty).to(tl.float32) * w
            cell = cache_ptr + page * stride_cp + (slot % PAGE) * (R + DR)
            tl.store(cell + r, c.to(dt))
            cos = tl.load(cos_ptr + t * stride_cos + d)
            sin = tl.load(sin_ptr + t * stride_sin + d)
            k = tl.load(kv_ptr + t * stride_kvt + R + d).to(tl.float32)
            ks = tl.load(kv_ptr + t * stride_kvt + R + dsw).to(tl.float32)
            tl.store(cell + R + d, (k * cos + ks * sin).to(dt))
        else:
            tl.atomic_add(refused_ptr, 1)


def _owner_blocks(width: int, b_n: int) -> dict[str, int]:
    """The ownership check's tile sizes (`_owns`): block-table width and request offsets."""
    return dict(BLOCK_W=min(triton.next_power_of_2(max(width, 1)), 256),
                BLOCK_B=min(triton.next_power_of_2(b_n + 1), 256))


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                qo_indptr: Optional[torch.Tensor], tokens_per_seq: int, refused: torch.Tensor,
                head_norms: Optional[HeadNorms] = None) -> torch.Tensor:
    """Rotated q [T, Hq, D] (a new contiguous tensor, q's dtype); rotated k and v written into
    kv_cache at slot_mapping [T] int64 within each token's request's pages (module doc), refusals
    added to refused [1] int32. block_tables [B, W] int32; qo_indptr [B + 1] int32 (ragged) or
    None with tokens_per_seq = T / B; head_norms: q and k RMSNormed per head first. Nothing here
    reads the device."""
    check_rope_append(q, k, v, cos, sin, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, refused,
                      head_norms)
    t_n, hq, dim = q.shape
    pages, _, hkv, page_size, _ = kv_cache.shape
    b_n = block_tables.shape[0]
    out = torch.empty(t_n, hq, dim, dtype=q.dtype, device=q.device)
    if t_n == 0:
        return out
    w = block_tables.shape[1]
    _rope_append_kernel[(t_n,)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0), cos, cos.stride(0), sin, sin.stride(0), out,
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), slot_mapping, block_tables, block_tables.stride(0), w,
        qo_indptr if qo_indptr is not None else slot_mapping, b_n, max(tokens_per_seq, 1), pages, refused,
        q if head_norms is None else head_norms.q_weight, q if head_norms is None else head_norms.k_weight,
        1.0 if head_norms is None else float(head_norms.eps), NORM=head_norms is not None, HQ=hq, HKV=hkv,
        HQ_P=triton.next_power_of_2(hq), HKV_P=triton.next_power_of_2(hkv), D=dim,
        PAGE=page_size, RAGGED=qo_indptr is not None, **_owner_blocks(w, b_n), num_warps=2)
    return out


def mla_rope_append(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, qo_indptr: Optional[torch.Tensor], tokens_per_seq: int,
                    refused: torch.Tensor, w_uk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The absorbed-MLA form: q_lat [T, H, R] (q_nope W_UK) and unrotated q_pe [T, H, r] (both with
    contiguous dims, any token / head strides) and a token's raw latent kv [T, R + r] = [c_kv |
    k_pe] (contiguous dims) -> q [T, H, R + r] = [q_lat | rope(q_pe)] (a new tensor, q_lat's dtype);
    the latent [rms_norm(c_kv) | rope(k_pe)] (norm_weight [R], eps) written into kv_cache [pages, 1,
    1, P, R + r] at slot_mapping within each token's request's pages, refusals added to refused.
    With w_uk [H, nope, R] (contiguous) the first argument is q_nope [T, H, nope] and the launch
    forms q_lat = q_nope W_UK itself (per head, float32 accumulation). The rest as `rope_append`."""
    check_mla_rope_append(q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, slot_mapping, block_tables,
                          qo_indptr, tokens_per_seq, refused, w_uk)
    t_n, heads, first = q_lat.shape
    rank = first if w_uk is None else w_uk.shape[2]
    rope_dim, page_size, b_n = kv.shape[-1] - rank, kv_cache.shape[3], block_tables.shape[0]
    out = torch.empty(t_n, heads, rank + rope_dim, dtype=q_lat.dtype, device=q_lat.device)
    if t_n == 0:
        return out
    w, bt, rc = block_tables.shape[1], mla_block_tokens(t_n), min(rank, 128)
    _mla_rope_append_kernel[(triton.cdiv(t_n, bt), heads * (rank // rc) + bt)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_lat if w_uk is None else w_uk, q_pe, q_pe.stride(0),
        q_pe.stride(1), kv, kv.stride(0), cos, cos.stride(0), sin, sin.stride(0), norm_weight, float(eps), out,
        kv_cache, kv_cache.stride(0), slot_mapping, block_tables, block_tables.stride(0), w,
        qo_indptr if qo_indptr is not None else slot_mapping, b_n, max(tokens_per_seq, 1), kv_cache.shape[0], refused,
        t_n, H=heads, R=rank, DR=rope_dim, NOPE=first, ABSORB=w_uk is not None, BT=bt, RC=rc, NC=rank // rc,
        PAGE=page_size, RAGGED=qo_indptr is not None, **_owner_blocks(w, b_n), F32_DOT=q_lat.device.type != "cuda",
        IEEE=q_lat.dtype == torch.float32, num_warps=4)
    return out
