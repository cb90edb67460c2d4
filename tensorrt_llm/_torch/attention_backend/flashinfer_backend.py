"""FLASHINFER attention: flashinfer's paged kernels for GQA and absorbed MLA (CUDA only).

flashinfer is optional: it is imported inside methods, so this module imports on a
CPU-only install; the resolver's probe decides whether the backend can run.

Cache layouts (the interface's, no copies)::

    GQA layer cache [num_pages, 2, Hkv, P, D]  -> flashinfer "HND" with K/V on dim 1
    MLA layer cache [num_pages, 1, 1, P, R+r]  -> cache[:, 0, 0] = packed [ckv (R) | kpe (r)]

Plan lifecycle (nothing lives in module globals):

* ``prepare(md)`` builds the step's page metadata once (indptrs, page ids, last-page
  lengths) into ``md.extras["flashinfer_pages"]``.
* The first ``forward``/``forward_mla`` of a step for a given head configuration plans
  one wrapper (``wrapper.plan``); every later layer of the step reuses that plan. One
  wrapper exists per distinct (kind, graph shape, causal, heads, head dims, dtype,
  scale) and belongs to this backend instance, so the target and the drafter (separate
  instances) never share plan state.
* CUDA-graph steps: the graph runner sets ``md.graph_shape =
  (batch_size, tokens_per_request, max_pages_per_seq)``. Those steps use wrappers with
  fixed-address index buffers (``use_cuda_graph=True``); ``prepare`` re-plans every such
  wrapper already known for that shape (outside the graph, before replay).
* GQA steps where every request has one new token (decode) use flashinfer's decode kernel
  (BatchDecodeWithPagedKVCacheWrapper: split-KV over CUDA cores, one query row per request)
  instead of the prefill kernel, whose query tile is mostly empty at one row; every other GQA
  step (prompt chunks, verify segments, draft blocks) uses the prefill kernel.
* New K/V (latents) are written first. When every slot of the step is owned (checked once
  in ``prepare``; guaranteed by the graph runner) the scatter needs no host sync; otherwise
  ``write_slots`` skips the -1 slots.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .interface import (FP8_KV_DTYPES, AttentionBackend, AttentionMetadata, BackendCapabilities, writable, write_kv,
                        write_slots)


PAGES_KEY = "flashinfer_pages"
WORKSPACE_BYTES = 128 * 1024 * 1024


def import_flashinfer():
    """The flashinfer module, or ValueError naming how to install it."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as e:  # ImportError or a broken install
        raise ValueError(f"attention backend FLASHINFER needs flashinfer ({type(e).__name__}: {e}); "
                         "install the 'gpu' extra: pip install 'tensorrt_llm[gpu]'") from e


@dataclass
class StepPages:
    """Page metadata of one step in flashinfer's CSR form (built once per step).

    For request b: its pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]], its queries are
    rows qo_indptr[b]:qo_indptr[b+1], and its last page holds last_page_len[b] tokens.
    """

    qo_indptr: torch.Tensor       # [B+1] int32, CPU
    kv_indptr: torch.Tensor       # [B+1] int32, CPU
    kv_indices: torch.Tensor      # [kv_indptr[-1]] int32, on the cache device
    last_page_len: torch.Tensor   # [B] int32, CPU, in 1..P
    kv_lens: torch.Tensor         # [B] int32, CPU
    page_size: int
    graph_shape: Optional[tuple[int, int, int]] = None
    slots_valid: bool = True      # every slot_mapping entry >= 0 (new K/V scattered without syncs)
    decode: bool = False          # every request has exactly one new token
    # rows of a cache viewed as [-1, D] that each new token's heads are written to, per (capturing,
    # planes, heads, P, plane): computed by the step's first layer, reused by the others
    write_rows: dict[tuple[bool, int, int, int, int], torch.Tensor] = field(default_factory=dict)


def build_step_pages(md: AttentionMetadata) -> StepPages:
    """Host-side CSR page metadata for `md` (no device sync; one gather on the device).

    Computed with numpy on the host lists (a handful of array ops whatever the batch size);
    only the page-id gather out of md.block_tables runs where the table lives.
    """
    p = md.tokens_per_block
    b = md.num_seqs
    if b == 0:
        raise ValueError("attention metadata has no requests")
    seq = np.asarray(md.seq_lens, dtype=np.int32)
    kv_lens = np.asarray(md.num_cached, dtype=np.int32) + seq
    if (seq < 1).any():
        raise ValueError(f"every request needs >= 1 new token, got seq_lens {md.seq_lens}")
    n_pages = (kv_lens + (p - 1)) // p
    width = md.block_tables.shape[1]
    if int(n_pages.max()) > width:
        raise ValueError(f"block table width {width} < {int(n_pages.max())} pages needed for "
                         f"kv_lens {md.kv_lens} at {p} tokens per page")
    qo_indptr = np.zeros(b + 1, dtype=np.int32)
    seq.cumsum(out=qo_indptr[1:])
    kv_indptr = np.zeros(b + 1, dtype=np.int32)
    n_pages.cumsum(out=kv_indptr[1:])
    # flat index of page j of request r in the [B, width] table: r * width + j
    row_base = np.arange(b, dtype=np.int64) * width - kv_indptr[:-1]
    flat = np.arange(int(kv_indptr[-1]), dtype=np.int64) + row_base.repeat(n_pages)
    flat_t = torch.from_numpy(flat).to(md.block_tables.device, non_blocking=True)
    kv_indices = md.block_tables.reshape(-1)[flat_t].to(torch.int32).contiguous()
    last = kv_lens - (n_pages - 1) * p
    shape = md.graph_shape
    # Graph steps own every slot (the runner checks), the KV manager says so from the host, or
    # one look per step, so the layers' writes need no per-layer host sync.
    valid = md.all_slots_valid()
    return StepPages(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), kv_indices,
                     torch.from_numpy(last), torch.from_numpy(kv_lens), p,
                     tuple(shape) if shape is not None else None, valid, bool((seq == 1).all()))


@dataclass(frozen=True)
class PlanKey:
    """What a plan is specialised for (one wrapper each)."""

    kind: str                                   # "gqa" | "gqa_decode" | "mla"
    graph_shape: Optional[tuple[int, int, int]]
    causal: bool
    num_qo_heads: int
    num_kv_heads: int                           # MLA: 1
    head_dim: int                               # GQA: D; MLA: kv_lora_rank (value width)
    head_dim_rope: int                          # GQA: 0; MLA: rope width
    dtype: torch.dtype                          # queries
    scale: float
    kv_dtype: Optional[torch.dtype] = None      # the cache (fp8 for an fp8 GQA pool); None: as the queries


class _PlanSlot:
    """One flashinfer wrapper plus which step it is planned for."""

    def __init__(self, wrapper: Any):
        self.wrapper = wrapper
        self.planned_for: Optional[StepPages] = None
        self.uploaded: Optional[torch.cuda.Event] = None   # plan's async upload from pinned memory


def cache_write_rows(slot_mapping: torch.Tensor, planes: int, heads: int, page_size: int,
                     plane: int) -> torch.Tensor:
    """slot_mapping [T] int64, all >= 0 -> [T, heads] rows of `plane` in a contiguous cache
    [num_pages, planes, heads, P, D] viewed as [-1, D]. Computed once per step, layout and plane,
    so each layer's write is one indexed copy."""
    page, off = slot_mapping // page_size, slot_mapping % page_size
    base = page * (planes * heads * page_size) + plane * heads * page_size + off       # [T]
    return base[:, None] + torch.arange(heads, device=slot_mapping.device) * page_size


def scatter_rows(kv_cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Graph-safe write of values [T, H, D] into a contiguous kv_cache [num_pages, planes, H, P, D]
    at `cache_write_rows` rows [T, H] (all slots valid: no -1, no host sync)."""
    flat, vals = writable(kv_cache.view(-1, kv_cache.shape[-1]), values)
    flat.index_put_((rows,), vals)


def _gqa_kind(pages: StepPages, md: AttentionMetadata) -> tuple[str, bool]:
    """(plan kind, causal) of a GQA step: one query row per request runs the decode kernel (causal
    or not, that row attends to all of its KV), anything else the prefill kernel."""
    return ("gqa_decode", True) if pages.decode else ("gqa", md.causal)


class FlashInferAttention(AttentionBackend):
    """flashinfer paged attention: GQA prefill / verify / non-causal draft blocks
    (BatchPrefillWithPagedKVCacheWrapper, HND), GQA decode (BatchDecodeWithPagedKVCacheWrapper,
    HND) and absorbed MLA (BatchMLAPagedAttentionWrapper).

    fp8 KV (e4m3 / e5m2, scale 1: new K/V are cast on write): GQA pools, with bf16 / fp16 queries
    (flashinfer's mixed-precision kernels; "auto" picks fa2 for them on sm90); MLA latents stay in
    the query dtype. Sliding windows are not supported. Both GQA and MLA plans have CUDA-graph
    variants (fixed-address metadata buffers).
    """

    name = "FLASHINFER"
    capabilities = BackendCapabilities(paged=True, mla=True, non_causal_block=True,
                                       sliding_window=False, fp8_kv=True, cuda_graphs=True,
                                       devices=("cuda",), dtypes=("float16", "bfloat16"))

    def __init__(self, gqa_kernel: str = "auto", mla_kernel: Optional[str] = None):
        """gqa_kernel: flashinfer prefill backend ("auto" = fa3 on sm90, else fa2);
        mla_kernel: flashinfer MLA backend (None = "fa3" on sm90, else "auto")."""
        self.gqa_kernel = gqa_kernel
        self.mla_kernel = mla_kernel
        self._workspace: Optional[torch.Tensor] = None
        self._slots: dict[PlanKey, _PlanSlot] = {}

    # ---- step planning -----------------------------------------------------------------
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Build the step's page metadata; for a graph step, re-plan its known wrappers."""
        if metadata.sliding_window is not None:
            raise ValueError("attention backend FLASHINFER does not support sliding windows")
        pages = build_step_pages(metadata)
        metadata.extras[PAGES_KEY] = pages
        if pages.graph_shape is not None:
            gqa = _gqa_kind(pages, metadata)
            for key, slot in self._slots.items():
                if key.graph_shape == pages.graph_shape and (
                        (key.kind, key.causal) == gqa if key.kind != "mla" else key.causal == metadata.causal):
                    self._plan(slot, key, pages)

    def _pages(self, md: AttentionMetadata) -> StepPages:
        pages = md.extras.get(PAGES_KEY)
        if pages is None:
            self.prepare(md)
            pages = md.extras[PAGES_KEY]
        return pages

    def _planned_slot(self, key: PlanKey, pages: StepPages, device: torch.device) -> _PlanSlot:
        slot = self._slots.get(key)
        if slot is None:
            slot = _PlanSlot(self._new_wrapper(key, device))
            self._slots[key] = slot
        if slot.planned_for is not pages:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer would plan inside CUDA-graph capture; prepare() the "
                                   "metadata and run one eager forward before capturing")
            self._plan(slot, key, pages)
        return slot

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _new_wrapper(self, key: PlanKey, device: torch.device) -> Any:
        fi = import_flashinfer()
        ws = self._workspace_on(device)
        i32 = dict(dtype=torch.int32, device=device)
        if key.kind == "gqa_decode":
            if key.graph_shape is None:
                return fi.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND")
            bsz, _, max_pages = key.graph_shape
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, kv_layout="HND", use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(bsz + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(bsz * max_pages, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(bsz, **i32))
        if key.kind == "gqa":
            if key.graph_shape is None:
                return fi.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND", backend=self.gqa_kernel)
            bsz, _, max_pages = key.graph_shape
            return fi.BatchPrefillWithPagedKVCacheWrapper(
                ws, kv_layout="HND", backend=self.gqa_kernel, use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(bsz + 1, **i32), paged_kv_indptr_buf=torch.zeros(bsz + 1, **i32),
                paged_kv_indices_buf=torch.zeros(bsz * max_pages, **i32),
                paged_kv_last_page_len_buf=torch.zeros(bsz, **i32))
        mla_kernel = self.mla_kernel
        if mla_kernel is None:
            mla_kernel = "fa3" if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 \
                else "auto"
        wrapper_cls = importlib.import_module("flashinfer.mla").BatchMLAPagedAttentionWrapper
        if key.graph_shape is None:
            return wrapper_cls(ws, backend=mla_kernel)
        # Graph plans copy their CSR metadata into these fixed-address buffers (re-planned
        # before every replay; fa2/fa3 keep their integer workspace across re-plans).
        bsz, _, max_pages = key.graph_shape
        return wrapper_cls(ws, use_cuda_graph=True, qo_indptr=torch.zeros(bsz + 1, **i32),
                           kv_indptr=torch.zeros(bsz + 1, **i32), kv_indices=torch.zeros(bsz * max_pages, **i32),
                           kv_len_arr=torch.zeros(bsz, **i32), backend=mla_kernel)

    def _plan(self, slot: _PlanSlot, key: PlanKey, pages: StepPages) -> None:
        # The wrapper stages its schedule in pinned memory and uploads it asynchronously:
        # wait until the previous upload left that buffer before overwriting it.
        if slot.uploaded is not None:
            slot.uploaded.synchronize()
        if key.kind == "gqa_decode":
            slot.wrapper.plan(pages.kv_indptr, pages.kv_indices, pages.last_page_len, key.num_qo_heads,
                              key.num_kv_heads, key.head_dim, pages.page_size, pos_encoding_mode="NONE",
                              sm_scale=key.scale, q_data_type=key.dtype, kv_data_type=key.kv_dtype or key.dtype)
        elif key.kind == "gqa":
            extra = {"uniform_q_len": key.graph_shape[1]} if key.graph_shape is not None else {}
            slot.wrapper.plan(pages.qo_indptr, pages.kv_indptr, pages.kv_indices, pages.last_page_len,
                              key.num_qo_heads, key.num_kv_heads, key.head_dim, pages.page_size,
                              causal=key.causal, sm_scale=key.scale, q_data_type=key.dtype,
                              kv_data_type=key.kv_dtype or key.dtype, **extra)
        else:
            meta = importlib.import_module("flashinfer.mla").MLAPlanMetadata.csr(
                pages.qo_indptr, pages.kv_indptr, pages.kv_indices, pages.kv_lens)
            slot.wrapper.plan(metadata=meta, num_heads=key.num_qo_heads, head_dim_ckv=key.head_dim,
                              head_dim_kpe=key.head_dim_rope, page_size=pages.page_size,
                              causal=key.causal, sm_scale=key.scale, q_data_type=key.dtype,
                              kv_data_type=key.dtype, query_layout="packed", kv_cache_layout="packed")
        if pages.kv_indices.device.type == "cuda":
            slot.uploaded = torch.cuda.Event()
            slot.uploaded.record()
        slot.planned_for = pages

    # ---- attention ---------------------------------------------------------------------
    @staticmethod
    def _check_dtypes(q: torch.Tensor, kv_cache: torch.Tensor, fp8_ok: bool) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FLASHINFER needs float16/bfloat16 queries, got {q.dtype}")
        if kv_cache.dtype != q.dtype and not (fp8_ok and kv_cache.dtype in FP8_KV_DTYPES):
            raise ValueError(f"FLASHINFER needs the {'GQA' if fp8_ok else 'MLA'} KV cache in the query dtype "
                             f"({q.dtype}){' or fp8' if fp8_ok else ''}, got {kv_cache.dtype}")

    def _write(self, kv_cache: torch.Tensor, plane: int, values: torch.Tensor, md: AttentionMetadata,
               pages: StepPages) -> None:
        """New K (plane 0), V (plane 1) or latents (plane 0) into kv_cache [num_pages, planes, H, P, D]."""
        if not pages.slots_valid:
            write_slots(kv_cache[:, plane], values, md.slot_mapping)
            return
        _, planes, h, p, _ = kv_cache.shape
        # a graph's capture computes its own rows (its replays recompute them from the persistent
        # slot_mapping); rows computed by the warm-up forward before it must not be captured stale
        capturing = kv_cache.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (capturing, planes, h, p, plane)
        rows = pages.write_rows.get(key)
        if rows is None:
            rows = pages.write_rows[key] = cache_write_rows(md.slot_mapping, planes, h, p, plane)
        scatter_rows(kv_cache, rows, values)

    def forward(self, q, k, v, kv_cache, metadata, scale):
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [num_pages, 2, Hkv, P, D] -> [T, Hq, D]."""
        self._check_dtypes(q, kv_cache, fp8_ok=True)
        pages = self._pages(metadata)
        write_kv(kv_cache, k, v, lambda cache, plane, x: self._write(cache, plane, x, metadata, pages))
        kind, causal = _gqa_kind(pages, metadata)
        key = PlanKey(kind, pages.graph_shape, causal, q.shape[1], k.shape[1], q.shape[2], 0, q.dtype, float(scale),
                      kv_cache.dtype if kv_cache.dtype != q.dtype else None)
        slot = self._planned_slot(key, pages, q.device)
        return slot.wrapper.run(q.contiguous(), kv_cache)

    def forward_mla(self, q, latent, kv_cache, metadata, scale, v_dim):
        """q: [T, H, R+r] (q_nope already absorbed into latent space | roped q_pe);
        latent: [T, R+r]; kv_cache: [num_pages, 1, 1, P, R+r] -> [T, H, R] (R = v_dim)."""
        self._check_dtypes(q, kv_cache, fp8_ok=False)
        dl = q.shape[-1]
        if kv_cache.shape[-1] != dl or latent.shape[-1] != dl or not 0 < v_dim < dl:
            raise ValueError(f"MLA widths disagree: q {dl}, latent {latent.shape[-1]}, "
                             f"cache {kv_cache.shape[-1]}, v_dim {v_dim}")
        pages = self._pages(metadata)
        self._write(kv_cache, 0, latent[:, None, :], metadata, pages)
        key = PlanKey("mla", pages.graph_shape, metadata.causal, q.shape[1], 1, v_dim, dl - v_dim,
                      q.dtype, float(scale))
        slot = self._planned_slot(key, pages, q.device)
        return slot.wrapper.run(query=q.contiguous(), kv_cache=kv_cache[:, 0, 0])
