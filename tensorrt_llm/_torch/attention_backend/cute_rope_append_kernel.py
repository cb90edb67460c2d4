"""The CuTe DSL kernels of `cute_rope_append` (imports nvidia-cutlass-dsl and apache-tvm-ffi: import this
module only where `cute_norm_rope.dsl_import_error()` is empty). What they compute, their numerics and the
write's bound are that module's doc (and `triton_rope_append`'s, whose contract they share).

One launch per layer. The rows are prepared as `cute_norm_rope_kernel`'s (chunks of V elements in
registers, L lanes per row, 128 threads per CTA); the CTAs are split by kind so every warp takes one path:
GQA: the first CTAs take the query rows (t, h) (normed with the head norms and rotated into out), the
rest the key rows (t, h); MLA: query rows ([q_lat | rope(q_pe)] into out), then one latent row per token
([rms_norm(c_kv) | rope(k_pe)] into the one plane). A key / latent row with slot[t] >= 0 finds t's request
(t // tokens_per_seq, or the count of requests whose qo_indptr end is <= t, at most B - 1) and whether
slot[t]'s page is in that request's block-table row (its L lanes stride the row, a butterfly sum) and in
the pool; an owned slot gets the row (GQA: the rotated k in plane 0, v in plane 1), a refused one is not
written and lane 0 of the token's first head adds 1 to the counter (one per token, as the Triton kernel).
"""
import functools

import cutlass
import cutlass.cute as cute
import torch

from .cute_norm_rope_kernel import (F32, THREADS, clamp_row, compile_tvm, copy_chunks, fake, lanes_per_row,
                                    prep_chunks, store_chunks, vector_width)

I32, I64 = cutlass.Int32, cutlass.Int64


def launch_rope_append(args: tuple, eps: float, tokens_per_seq: int, heads: tuple, dim: int, page_size: int,
                       normed: bool, ragged: bool) -> None:
    """One launch of the GQA kernel on torch's current stream. args: (q, k, v, q_weight, k_weight, cos,
    sin, out, kv_cache, slot_mapping, block_tables, qo_indptr, refused) as checked by `cute_rope_append`
    (weights [1, D], any [1, D] tensor of q's dtype without norms; qo_indptr any int32 [n] when uniform);
    heads (Hq, Hkv)."""
    q = args[0]
    v = vector_width(q.element_size(), args[:9], (dim, dim // 2))
    fn = compiled_rope_append(q.dtype, heads[0], heads[1], dim, page_size, normed, ragged, v)
    fn(*args, eps, max(tokens_per_seq, 1))


def launch_mla_rope_append(args: tuple, eps: float, tokens_per_seq: int, heads: int, rank: int, rope_dim: int,
                           page_size: int, ragged: bool) -> None:
    """One launch of the MLA kernel: args (q_lat, q_pe, kv, norm_weight [1, R], cos, sin, out, kv_cache,
    slot_mapping, block_tables, qo_indptr, refused), as `launch_rope_append`."""
    q_lat = args[0]
    v = vector_width(q_lat.element_size(), args[:8], (rank, rope_dim, rope_dim // 2))
    fn = compiled_mla_rope_append(q_lat.dtype, heads, rank, rope_dim, page_size, ragged, v)
    fn(*args, eps, max(tokens_per_seq, 1))


def _tables() -> list:
    """slot_mapping [T] int64, block_tables [B, W] int32, qo_indptr [n] int32, refused [1] int32."""
    return [fake(torch.int64, (None,), 1), fake(torch.int32, (None, None), 1), fake(torch.int32, (None,), 1),
            fake(torch.int32, (1,), 1)]


def _pool(dtype: torch.dtype, planes: int, heads: int, page_size: int, width: int, v: int):
    """kv_cache [pages, planes, heads, P, width], contiguous (static strides), pages a runtime extent."""
    inner = (heads * page_size * width, page_size * width, width, 1)
    return fake(dtype, (None, planes, heads, page_size, width), v, (planes * inner[0],) + inner)


@functools.lru_cache(maxsize=None)
def compiled_rope_append(dtype: torch.dtype, hq: int, hkv: int, dim: int, page_size: int, normed: bool,
                         ragged: bool, v: int):
    """The GQA kernel compiled for one signature and chunk width v, cached for the process (compiled for
    the GPU's arch, or `CUTE_DSL_ARCH` without one, as `cute_norm_rope_kernel.compiled_norm_rope`)."""
    lanes = lanes_per_row(dim // v, ())
    row = lambda h: fake(dtype, (None, h, dim), v, (cute.sym_int64(divisibility=v), dim, 1))   # noqa: E731
    return compile_tvm(_build_gqa(hq, hkv, dim, page_size, normed, ragged, v, lanes),
                       row(hq), row(hkv), row(hkv), fake(dtype, (1, dim), v), fake(dtype, (1, dim), v),
                       fake(torch.float32, (None, dim), v), fake(torch.float32, (None, dim), v),
                       fake(dtype, (None, hq, dim), v, (hq * dim, dim, 1)), _pool(dtype, 2, hkv, page_size, dim, v),
                       *_tables(), F32(1e-6), I32(1))


@functools.lru_cache(maxsize=None)
def compiled_mla_rope_append(dtype: torch.dtype, heads: int, rank: int, rope_dim: int, page_size: int, ragged: bool,
                             v: int):
    """The MLA kernel compiled for one signature and chunk width v, cached for the process."""
    width = rank + rope_dim
    lanes = lanes_per_row(width // v, (rank // v,))
    return compile_tvm(_build_mla(heads, rank, rope_dim, page_size, ragged, v, lanes),
                       fake(dtype, (None, heads, rank), v), fake(dtype, (None, heads, rope_dim), v),
                       fake(dtype, (None, width), v), fake(dtype, (1, rank), v),
                       fake(torch.float32, (None, rope_dim), v), fake(torch.float32, (None, rope_dim), v),
                       fake(dtype, (None, heads, width), v, (heads * width, width, 1)),
                       _pool(dtype, 1, 1, page_size, width, v), *_tables(), F32(1e-6), I32(1))


@cute.jit
def _owned(t: I32, slot: I64, mbt: cute.Tensor, mqo: cute.Tensor, qps: I32, pages: I32, sub: I32,
           page_size: cutlass.Constexpr[int], lanes: cutlass.Constexpr[int], ragged: cutlass.Constexpr[bool]):
    """(page, owned): slot's page, and whether slot >= 0 and its page is in token t's request's block-table
    row and in the pool (the Triton kernel's `_owns`). The row's L lanes share the search; every lane of
    the warp must call it."""
    n_req = mbt.shape[0]
    owner = t // qps
    if cutlass.const_expr(ragged):
        ended = I32(0)
        for b in cutlass.range(sub, n_req, lanes):
            if mqo[b + 1] <= t:
                ended = ended + 1
        owner = cute.arch.warp_reduction_sum(ended, threads_in_group=lanes)
        if owner > n_req - 1:                    # rows past the last request's (padding) are its own
            owner = n_req - 1
    page = slot // page_size
    found = I32(0)
    for j in cutlass.range(sub, mbt.shape[1], lanes):
        if mbt[owner, j].to(I64) == page:
            found = found + 1
    found = cute.arch.warp_reduction_sum(found, threads_in_group=lanes)
    owned = I32(0)
    if found > 0:
        if slot >= 0:
            if page < pages.to(I64):
                owned = I32(1)
    return page, owned


@cute.jit
def _refuse(mref: cute.Tensor, slot: I64, valid, owned: I32, lead: I32):
    """The counter += 1 by one lane of a token's first row (lead == 0) when its slot (>= 0) was refused."""
    if valid:
        if lead == 0:
            if slot >= 0:
                if owned == 0:
                    cute.arch.atomic_add(mref.iterator.llvm_ptr, I32(1), sem="relaxed", scope="gpu")


def _build_gqa(hq: int, hkv: int, dim: int, page_size: int, normed: bool, ragged: bool, v: int, lanes: int):
    """The `cute.jit` launcher of the GQA kernel for one signature (ints and flags are trace-time)."""
    per_cta = THREADS // lanes

    @cute.kernel
    def kernel(mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mqw: cute.Tensor, mkw: cute.Tensor,
               mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor,
               mbt: cute.Tensor, mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sub = tidx % lanes
        t_n = mq.shape[0]
        q_ctas = (t_n * hq + per_cta - 1) // per_cta
        if bidx < q_ctas:
            row, valid = clamp_row(bidx * per_cta + tidx // lanes, t_n * hq)
            t = row // hq
            h = row - t * hq
            y = prep_chunks(mq[t, h, None], mqw[0, None], mcos[t, None], msin[t, None], eps, sub, v, lanes, dim,
                            dim, dim, normed, normed)
            if valid:
                store_chunks(y, mo[t, h, None], sub, v, lanes, 0)
        else:
            row, valid = clamp_row((bidx - q_ctas) * per_cta + tidx // lanes, t_n * hkv)
            t = row // hkv
            h = row - t * hkv
            slot = mslot[t]
            page, owned = _owned(t, slot, mbt, mqo, qps, mcache.shape[0], sub, page_size, lanes, ragged)
            y = prep_chunks(mk[t, h, None], mkw[0, None], mcos[t, None], msin[t, None], eps, sub, v, lanes, dim,
                            dim, dim, normed, normed)
            if valid:
                if owned > 0:
                    off = slot - page * page_size
                    store_chunks(y, mcache[page, 0, h, off, None], sub, v, lanes, 0)
                    copy_chunks(mv[t, h, None], mcache[page, 1, h, off, None], sub, v, lanes, dim, 0)
            _refuse(mref, slot, valid, owned, h + sub)

    @cute.jit
    def launch(mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mqw: cute.Tensor, mkw: cute.Tensor,
               mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor,
               mbt: cute.Tensor, mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32, stream):
        t_n = mq.shape[0]
        ctas = (t_n * hq + per_cta - 1) // per_cta + (t_n * hkv + per_cta - 1) // per_cta
        kernel(mq, mk, mv, mqw, mkw, mcos, msin, mo, mcache, mslot, mbt, mqo, mref, eps, qps).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return launch


def _build_mla(heads: int, rank: int, rope_dim: int, page_size: int, ragged: bool, v: int, lanes: int):
    """The `cute.jit` launcher of the MLA kernel for one signature."""
    width = rank + rope_dim
    per_cta = THREADS // lanes
    rope_lanes = min(lanes, rope_dim // v)

    @cute.kernel
    def kernel(mql: cute.Tensor, mqp: cute.Tensor, mkv: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor,
               msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor, mbt: cute.Tensor,
               mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sub = tidx % lanes
        t_n = mql.shape[0]
        q_ctas = (t_n * heads + per_cta - 1) // per_cta
        if bidx < q_ctas:
            row, valid = clamp_row(bidx * per_cta + tidx // lanes, t_n * heads)
            t = row // heads
            h = row - t * heads
            # the rope part has rope_dim / v chunks: its first rope_lanes lanes rotate them, all copy q_lat
            rsub = sub % rope_lanes
            y = prep_chunks(mqp[t, h, None], mw[0, None], mcos[t, None], msin[t, None], eps, rsub, v, rope_lanes,
                            rope_dim, 0, rope_dim, False, False)
            if valid:
                copy_chunks(mql[t, h, None], mo[t, h, None], sub, v, lanes, rank, 0)
                if sub < rope_lanes:
                    store_chunks(y, mo[t, h, None], rsub, v, rope_lanes, rank // v)
        else:
            row, valid = clamp_row((bidx - q_ctas) * per_cta + tidx // lanes, t_n)
            slot = mslot[row]
            page, owned = _owned(row, slot, mbt, mqo, qps, mcache.shape[0], sub, page_size, lanes, ragged)
            y = prep_chunks(mkv[row, None], mw[0, None], mcos[row, None], msin[row, None], eps, sub, v, lanes,
                            width, rank, rope_dim, True, True)
            if valid:
                if owned > 0:
                    store_chunks(y, mcache[page, 0, 0, slot - page * page_size, None], sub, v, lanes, 0)
            _refuse(mref, slot, valid, owned, sub)

    @cute.jit
    def launch(mql: cute.Tensor, mqp: cute.Tensor, mkv: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor,
               msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor, mbt: cute.Tensor,
               mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32, stream):
        t_n = mql.shape[0]
        ctas = (t_n * heads + per_cta - 1) // per_cta + (t_n + per_cta - 1) // per_cta
        kernel(mql, mqp, mkv, mw, mcos, msin, mo, mcache, mslot, mbt, mqo, mref, eps, qps).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return launch
