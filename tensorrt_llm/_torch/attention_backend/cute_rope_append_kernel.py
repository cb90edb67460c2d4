"""The CuTe DSL kernels of `cute_rope_append` (imports nvidia-cutlass-dsl: import this module only where
`cute_norm_rope.dsl_import_error()` is empty). What they compute, their numerics and the write's bound are
that module's doc (and `triton_rope_append`'s, whose contract they share).

One launch per layer, one warp per row, `ROWS_PER_CTA` rows per CTA. GQA: rows 0 .. T*Hq-1 are query
rows (t, h): normed (with head norms) and rotated into out; rows T*Hq .. T*(Hq+Hkv)-1 are key rows (t, h):
when slot[t] >= 0 the warp finds t's request (t // tokens_per_seq, or the count of requests whose
qo_indptr end is <= t, at most B - 1) and whether slot[t]'s page is in that request's block-table row
(lanes stride the row, a warp sum) and in the pool; an owned slot gets the normed, rotated k row in plane
0 and the v row in plane 1, a refused one is not written and the warp of head 0 adds 1 to the counter
(one per token, as the Triton kernel). MLA: rows 0 .. T*H-1 are query rows ([q_lat | rope(q_pe)] into
out), rows T*H .. T*H+T-1 the tokens' latents ([rms_norm(c_kv) | rope(k_pe)] into the one plane, the
same bound and count). A row's norm and rotation are `cute_norm_rope_kernel`'s: lanes stride the columns,
the statistic is a warp butterfly sum, a rope column loads its partner column itself. Compiled once per
signature and cached; token count, request count, block-table width, pool size, strides and pointers are
runtime values.
"""
import contextlib
import functools

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver

from .cute_norm_rope_kernel import cute_tensor

ROWS_PER_CTA = 4
F32, I32, I64 = cutlass.Float32, cutlass.Int32, cutlass.Int64


def launch_rope_append(args: tuple, eps: float, tokens_per_seq: int, heads: tuple, dim: int, page_size: int,
                       normed: bool, ragged: bool) -> None:
    """One launch of the GQA kernel on torch's current stream of q's device. args: (q, k, v, q_weight,
    k_weight, cos, sin, out, kv_cache, slot_mapping, block_tables, qo_indptr, refused) as checked by
    `cute_rope_append` (weights [1, D], any 2-d tensor without norms; qo_indptr any int32 [n] when
    uniform); heads (Hq, Hkv)."""
    q = args[0]
    fn = compiled_rope_append(str(q.device), q.dtype, heads[0], heads[1], dim, page_size, normed, ragged)
    with torch.cuda.device(q.device):
        fn(*(cute_tensor(a) for a in args), F32(eps), I32(max(tokens_per_seq, 1)),
           driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream))


def launch_mla_rope_append(args: tuple, eps: float, tokens_per_seq: int, heads: int, rank: int, rope_dim: int,
                           page_size: int, ragged: bool) -> None:
    """One launch of the MLA kernel: args (q_lat, q_pe, kv, norm_weight [1, R], cos, sin, out, kv_cache,
    slot_mapping, block_tables, qo_indptr, refused), as `launch_rope_append`."""
    q_lat = args[0]
    fn = compiled_mla_rope_append(str(q_lat.device), q_lat.dtype, heads, rank, rope_dim, page_size, ragged)
    with torch.cuda.device(q_lat.device):
        fn(*(cute_tensor(a) for a in args), F32(eps), I32(max(tokens_per_seq, 1)),
           driver.CUstream(torch.cuda.current_stream(q_lat.device).cuda_stream))


def _example_tables(dev: torch.device) -> list[torch.Tensor]:
    """slot_mapping, block_tables, qo_indptr, refused: the compile's dtype and rank examples."""
    return [torch.zeros(2, dtype=torch.int64, device=dev), torch.zeros(2, 2, dtype=torch.int32, device=dev),
            torch.zeros(3, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)]


def _compile(launch, dev: torch.device, tensors: list[torch.Tensor]):
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return cute.compile(launch, *(cute_tensor(a) for a in tensors), F32(1e-6), I32(1), driver.CUstream(0))


@functools.lru_cache(maxsize=None)
def compiled_rope_append(device: str, dtype: torch.dtype, hq: int, hkv: int, dim: int, page_size: int, normed: bool,
                         ragged: bool):
    """The GQA kernel compiled for one signature, cached for the process (device "cuda:N", or "cpu" for a
    compile check without a GPU, as `cute_norm_rope_kernel.compiled_norm_rope`)."""
    dev = torch.device(device)
    x = lambda h: torch.empty(2, h, dim, dtype=dtype, device=dev)          # noqa: E731
    w, tab = torch.empty(1, dim, dtype=dtype, device=dev), torch.empty(2, dim, dtype=torch.float32, device=dev)
    cache = torch.empty(2, 2, hkv, page_size, dim, dtype=dtype, device=dev)
    return _compile(_build_gqa(hq, hkv, dim, page_size, normed, ragged), dev,
                    [x(hq), x(hkv), x(hkv), w, w.clone(), tab, tab.clone(), x(hq), cache] + _example_tables(dev))


@functools.lru_cache(maxsize=None)
def compiled_mla_rope_append(device: str, dtype: torch.dtype, heads: int, rank: int, rope_dim: int, page_size: int,
                             ragged: bool):
    """The MLA kernel compiled for one signature, cached for the process (as `compiled_rope_append`)."""
    dev = torch.device(device)
    e = lambda *shape: torch.empty(*shape, dtype=dtype, device=dev)        # noqa: E731
    tab = torch.empty(2, rope_dim, dtype=torch.float32, device=dev)
    return _compile(_build_mla(heads, rank, rope_dim, page_size, ragged), dev,
                    [e(2, heads, rank), e(2, heads, rope_dim), e(2, rank + rope_dim), e(1, rank), tab, tab.clone(),
                     e(2, heads, rank + rope_dim), e(2, 1, 1, page_size, rank + rope_dim)] + _example_tables(dev))


@cute.jit
def _prep_row(src: cute.Tensor, w: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, dst: cute.Tensor, eps: F32,
              lane: I32, width: cutlass.Constexpr[int], norm_dim: cutlass.Constexpr[int],
              rope_dim: cutlass.Constexpr[int], apply: cutlass.Constexpr[bool], dst_off: cutlass.Constexpr[int]):
    """dst[dst_off + c] = the prepared column c of the row src [width] (`cute_norm_rope`'s numerics): the
    first norm_dim columns RMSNormed times w [norm_dim] when apply (each rounding to src's dtype), the last
    rope_dim columns rotated with cos / sin [rope_dim]. One warp: lanes stride the columns."""
    half, rope_start = rope_dim // 2, width - rope_dim
    dt = src.element_type
    scale = F32(1.0)
    if cutlass.const_expr(apply):
        ss = F32(0.0)
        for c in cutlass.range(lane, norm_dim, 32):
            v = src[c].to(F32)
            ss = ss + v * v
        ss = cute.arch.warp_reduction_sum(ss)
        scale = cute.math.rsqrt(ss / norm_dim + eps)
    for c in cutlass.range(lane, width, 32):
        v = src[c].to(F32)
        if cutlass.const_expr(apply):
            if c < norm_dim:
                v = ((v * scale).to(dt).to(F32) * w[c].to(F32)).to(dt).to(F32)
        if c >= rope_start:
            j = c - rope_start
            p = rope_start + (j + half) % rope_dim          # the partner column of the half rotation
            vp = src[p].to(F32)
            if cutlass.const_expr(apply):
                if p < norm_dim:
                    vp = ((vp * scale).to(dt).to(F32) * w[p].to(F32)).to(dt).to(F32)
            v = v * cos[j] + vp * sin[j]
        dst[dst_off + c] = v.to(dst.element_type)


@cute.jit
def _owned(t: I32, page: I64, mbt: cute.Tensor, mqo: cute.Tensor, qps: I32, pages: I32, lane: I32,
           ragged: cutlass.Constexpr[bool]) -> I32:
    """1 when `page` is in token t's request's block-table row and in the pool, else 0 (the Triton
    kernel's `_owns`; one warp, every lane gets the answer)."""
    n_req = mbt.shape[0]
    owner = t // qps
    if cutlass.const_expr(ragged):
        ended = I32(0)
        for b in cutlass.range(lane, n_req, 32):
            if mqo[b + 1] <= t:
                ended = ended + 1
        owner = cute.arch.warp_reduction_sum(ended)
        if owner > n_req - 1:                    # rows past the last request's (padding) are its own
            owner = n_req - 1
    found = I32(0)
    for j in cutlass.range(lane, mbt.shape[1], 32):
        if mbt[owner, j].to(I64) == page:
            found = found + 1
    found = cute.arch.warp_reduction_sum(found)
    ok = I32(0)
    if found > 0:
        if page < pages.to(I64):
            ok = I32(1)
    return ok


@cute.jit
def _warp_row():
    """(lane, row): the thread's lane and its warp's row of the launch (ROWS_PER_CTA warps per CTA)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return tidx % 32, bidx * ROWS_PER_CTA + tidx // 32


@cute.jit
def _refuse(mref: cute.Tensor, lane: I32, first_head: I32):
    """The counter += 1 by one lane of the token's first row (one per token)."""
    if lane == 0:
        if first_head == 0:
            cute.arch.atomic_add(mref.iterator.llvm_ptr, I32(1), sem="relaxed", scope="gpu")


def _build_gqa(hq: int, hkv: int, dim: int, page_size: int, normed: bool, ragged: bool):
    """The `cute.jit` launcher of the GQA kernel for one signature (ints and flags are trace-time)."""

    @cute.kernel
    def kernel(mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mqw: cute.Tensor, mkw: cute.Tensor,
               mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor,
               mbt: cute.Tensor, mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32):
        lane, row = _warp_row()
        t_n = mq.shape[0]
        if row < t_n * hq:
            t = row // hq
            h = row - t * hq
            _prep_row(mq[t, h, None], mqw[0, None], mcos[t, None], msin[t, None], mo[t, h, None], eps, lane,
                      dim, dim, dim, normed, 0)
        elif row < t_n * (hq + hkv):
            kr = row - t_n * hq
            t = kr // hkv
            h = kr - t * hkv
            slot = mslot[t]
            if slot >= 0:
                page = slot // page_size
                if _owned(t, page, mbt, mqo, qps, mcache.shape[0], lane, ragged) > 0:
                    off = slot - page * page_size
                    _prep_row(mk[t, h, None], mkw[0, None], mcos[t, None], msin[t, None],
                              mcache[page, 0, h, off, None], eps, lane, dim, dim, dim, normed, 0)
                    for c in cutlass.range(lane, dim, 32):
                        mcache[page, 1, h, off, c] = mv[t, h, c]
                else:
                    _refuse(mref, lane, h)

    @cute.jit
    def launch(mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mqw: cute.Tensor, mkw: cute.Tensor,
               mcos: cute.Tensor, msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor,
               mbt: cute.Tensor, mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32, stream: driver.CUstream):
        rows = mq.shape[0] * (hq + hkv)
        kernel(mq, mk, mv, mqw, mkw, mcos, msin, mo, mcache, mslot, mbt, mqo, mref, eps, qps).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[ROWS_PER_CTA * 32, 1, 1], stream=stream)

    return launch


def _build_mla(heads: int, rank: int, rope_dim: int, page_size: int, ragged: bool):
    """The `cute.jit` launcher of the MLA kernel for one signature."""
    width = rank + rope_dim

    @cute.kernel
    def kernel(mql: cute.Tensor, mqp: cute.Tensor, mkv: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor,
               msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor, mbt: cute.Tensor,
               mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32):
        lane, row = _warp_row()
        t_n = mql.shape[0]
        if row < t_n * heads:
            t = row // heads
            h = row - t * heads
            for c in cutlass.range(lane, rank, 32):
                mo[t, h, c] = mql[t, h, c]
            _prep_row(mqp[t, h, None], mw[0, None], mcos[t, None], msin[t, None], mo[t, h, None], eps, lane,
                      rope_dim, 0, rope_dim, False, rank)
        elif row < t_n * (heads + 1):
            t = row - t_n * heads
            slot = mslot[t]
            if slot >= 0:
                page = slot // page_size
                if _owned(t, page, mbt, mqo, qps, mcache.shape[0], lane, ragged) > 0:
                    _prep_row(mkv[t, None], mw[0, None], mcos[t, None], msin[t, None],
                              mcache[page, 0, 0, slot - page * page_size, None], eps, lane, width, rank, rope_dim,
                              True, 0)
                else:
                    _refuse(mref, lane, I32(0))

    @cute.jit
    def launch(mql: cute.Tensor, mqp: cute.Tensor, mkv: cute.Tensor, mw: cute.Tensor, mcos: cute.Tensor,
               msin: cute.Tensor, mo: cute.Tensor, mcache: cute.Tensor, mslot: cute.Tensor, mbt: cute.Tensor,
               mqo: cute.Tensor, mref: cute.Tensor, eps: F32, qps: I32, stream: driver.CUstream):
        rows = mql.shape[0] * (heads + 1)
        kernel(mql, mqp, mkv, mw, mcos, msin, mo, mcache, mslot, mbt, mqo, mref, eps, qps).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[ROWS_PER_CTA * 32, 1, 1], stream=stream)

    return launch
