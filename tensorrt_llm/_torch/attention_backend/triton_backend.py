"""TRITON attention: plan-free paged attention whose KV lengths are read on the device (CUDA only).

No plan is made on the host: lengths, and for ragged steps the query offsets, are device tensors
the kernel reads (`triton_paged_kernel`). Two uses:
* the DSpark draft graph, launched from the verify step's device-side acceptance: the graph
  computes `md.kv_lens_device` itself (`DraftGraphRunner`);
* any step when chosen as the engine's `attn_backend: TRITON` (an explicit choice; AUTO does
  not pick it): `prepare` sends the host lengths with one non-blocking copy (into a persistent
  tensor for a captured graph's metadata), and ragged steps (prompt chunks) carry `qo_indptr`;
  a captured ragged step (`PackedGraphRunner`) brings its own device lengths and query offsets.
New K/V (latents) are written first at `md.slot_mapping`: by the C++ page-bounded append where it is
built (`paged_append.py`: a slot outside its request's pages is refused in the kernel and counted
into this backend's persistent counter, `refused_writes`), else by a scatter, where a step with -1
slots (writes beyond a request's pages, skipped) is found once in `prepare`. triton is imported
inside methods, so this module imports on a CPU-only install.
"""
from __future__ import annotations

import importlib.util
from typing import Optional
from itertools import accumulate

import torch

from .flashinfer_backend import cache_write_rows, scatter_rows
from .interface import AttentionBackend, AttentionMetadata, BackendCapabilities, host_ints, write_kv, write_slots
from .cpp_ops import ops_loaded
from .paged_append import paged_kv_append

LENS_KEY, QO_KEY, VALID_KEY = "triton_kv_lens", "triton_qo_indptr", "triton_slots_valid"


class TritonAttention(AttentionBackend):
    """GQA and absorbed MLA over pages with lengths read on the device (no plan, graph-safe)."""

    name = "TRITON"
    capabilities = BackendCapabilities(paged=True, mla=True, non_causal_block=True, sliding_window=False,
                                       fp8_kv=False, cuda_graphs=True, devices=("cuda",), device_lengths=True,
                                       ragged_graphs=True, fused_rope_append=True)

    def __init__(self, num_splits: Optional[int] = None):
        """num_splits: KV splits per program (a power of two <= 16; None: sized by the grid, see
        `triton_paged_kernel.default_num_splits`)."""
        self.num_splits = num_splits
        self._refused: dict[torch.device, torch.Tensor] = {}   # [1] int32 per device, never re-zeroed

    @classmethod
    def availability(cls, device: torch.device) -> tuple[bool, str]:
        ok, why = super().availability(device)
        if ok and importlib.util.find_spec("triton") is None:
            return False, "TRITON needs the triton package (it ships with torch's CUDA wheels)"
        return ok, why

    @staticmethod
    def shape_support(v_dim: int, rope_dim: int, page_size: int) -> str:
        """'' when the kernel runs these widths (GQA: v_dim = head_dim, rope_dim 0; MLA: the latent
        rank and its rope width), else why not."""
        from .triton_paged_kernel import shape_support
        return shape_support(v_dim, rope_dim, page_size)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Device lengths (unless the caller computed `kv_lens_device` on the GPU), the ragged query
        offsets, and whether every slot is written (into metadata.extras)."""
        md = metadata
        if md.sliding_window is not None:
            raise ValueError("attention backend TRITON does not support sliding windows")
        dev = md.block_tables.device
        self._counter(dev)          # allocated (and zeroed) here, outside any CUDA-graph capture
        if md.kv_lens_device is None:
            lens = host_ints(md.kv_lens, dev, torch.int32)
            kept = md.extras.get(LENS_KEY)
            if md.graph_shape is not None and kept is not None:
                kept.copy_(lens, non_blocking=True)    # a captured graph reads this tensor
            else:
                md.extras[LENS_KEY] = lens
        if md.qo_indptr_device is not None:
            md.extras[QO_KEY] = md.qo_indptr_device
        elif len(set(md.seq_lens)) > 1:
            md.extras[QO_KEY] = host_ints(list(accumulate(md.seq_lens, initial=0)), dev, torch.int32)
        else:
            md.extras.pop(QO_KEY, None)
        md.extras[VALID_KEY] = md.all_slots_valid()

    def _counter(self, device: torch.device) -> torch.Tensor:
        c = self._refused.get(device)
        if c is None:
            c = self._refused[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return c

    def refused_writes(self) -> int:
        """K/V writes the C++ append refused since this backend was made (slots outside their
        request's pages), over all devices; a sync."""
        return sum(int(c.item()) for c in self._refused.values())

    def _extras(self, md: AttentionMetadata) -> dict:
        if VALID_KEY not in md.extras:
            self.prepare(md)
        return md.extras

    def _token_owners(self, md: AttentionMetadata) -> tuple[Optional[torch.Tensor], int]:
        """(qo_indptr, tokens_per_seq) of the page-bounded appends: the ragged query offsets, or None
        and the uniform tokens per request."""
        qo = self._extras(md).get(QO_KEY)
        return qo, 0 if qo is not None else md.seq_lens[0]

    def _write(self, kv_cache: torch.Tensor, plane: int, values: torch.Tensor, md: AttentionMetadata) -> None:
        ex = self._extras(md)
        if ops_loaded():   # the C++ op: one kernel, each slot checked against its request's pages
            paged_kv_append(values, kv_cache, md.slot_mapping, md.block_tables, *self._token_owners(md), plane,
                            self._counter(values.device))
            return
        if not ex[VALID_KEY]:
            write_slots(kv_cache[:, plane], values, md.slot_mapping)
            return
        _, planes, h, p, _ = kv_cache.shape
        scatter_rows(kv_cache, cache_write_rows(md.slot_mapping, planes, h, p, plane), values)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                v_dim: int, mla: bool, w_uv: Optional[torch.Tensor] = None) -> torch.Tensor:
        from .triton_paged_kernel import paged_attention
        if kv_cache.dtype != q.dtype:
            raise ValueError(f"TRITON needs the KV cache in the query dtype ({q.dtype}), got {kv_cache.dtype}")
        ex = self._extras(md)
        lens = md.kv_lens_device if md.kv_lens_device is not None else ex[LENS_KEY]
        qo = ex.get(QO_KEY)
        if q.stride(-1) != 1:       # the kernel reads any token / head strides (a view of the q|k|v buffer)
            q = q.contiguous()
        return paged_attention(q, kv_cache, md.block_tables, lens, scale, md.causal, v_dim, mla,
                               num_splits=self.num_splits, v_proj=w_uv,
                               qo_indptr=qo, max_q=0 if qo is None else md.max_q_bound or max(md.seq_lens))

    def forward(self, q, k, v, kv_cache, metadata, scale):
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [num_pages, 2, Hkv, P, D] -> [T, Hq, D]."""
        write_kv(kv_cache, k, v, lambda cache, plane, x: self._write(cache, plane, x, metadata))
        return self._attend(q, kv_cache, metadata, scale, q.shape[-1], mla=False)

    def forward_rope(self, q, k, v, cos, sin, kv_cache, metadata, scale, head_norms=None):
        """Unrotated q [T, Hq, D], k / v [T, Hkv, D]: one launch (per-head norms first with head_norms)
        rotates q and k and appends K/V within each request's pages (`triton_rope_append`; refusals
        counted as the C++ append's), then attention."""
        from .triton_rope_append import rope_append
        md = metadata
        q = rope_append(q, k, v, cos, sin, kv_cache, md.slot_mapping, md.block_tables, *self._token_owners(md),
                        self._counter(q.device), head_norms)
        return self._attend(q, kv_cache, md, scale, q.shape[-1], mla=False)

    def forward_mla_rope(self, q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, metadata, scale, v_dim,
                         w_uk=None, w_uv=None):
        """Absorbed MLA from unrotated pieces: one launch builds q (q_nope W_UK too, given w_uk), norms and
        rotates the latent and appends it within each request's pages (`triton_rope_append.mla_rope_append`),
        then attention, its output through W_UV given w_uv (one launch after it: `mla_value_projection`)."""
        from .triton_rope_append import mla_rope_append
        md = metadata
        q = mla_rope_append(q_lat, q_pe, kv, cos, sin, norm_weight, eps, kv_cache, md.slot_mapping, md.block_tables,
                            *self._token_owners(md), self._counter(q_lat.device), w_uk)
        return self._attend(q, kv_cache, md, scale, v_dim, mla=True, w_uv=w_uv)

    def forward_mla(self, q, latent, kv_cache, metadata, scale, v_dim):
        """q: [T, H, R+r]; latent: [T, R+r]; kv_cache: [num_pages, 1, 1, P, R+r] -> [T, H, R]."""
        self._write(kv_cache, 0, latent[:, None, :], metadata)
        return self._attend(q, kv_cache, metadata, scale, v_dim, mla=True)
