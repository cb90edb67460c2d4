"""TRITON attention: plan-free paged attention whose KV lengths are read on the device (CUDA only).

Used where the lengths are only known on the GPU: the DSpark draft step launched from the
verify step's device-side acceptance (`DraftGraphRunner`), captured in a CUDA graph. Every
request of a call has the same number of query rows (a decode / verify / draft-block shape).
New K/V (latents) are written first at `md.slot_mapping`, which must hold no -1 (no host sync).
triton is imported inside methods, so this module imports on a CPU-only install.
"""
from __future__ import annotations

import importlib.util

import torch

from .flashinfer_backend import cache_write_rows, scatter_rows
from .interface import AttentionBackend, AttentionMetadata, BackendCapabilities


class TritonAttention(AttentionBackend):
    """GQA and absorbed MLA over pages with lengths from `md.kv_lens_device` (no plan, graph-safe)."""

    name = "TRITON"
    capabilities = BackendCapabilities(paged=True, mla=True, non_causal_block=True, sliding_window=False,
                                       fp8_kv=False, cuda_graphs=True, devices=("cuda",), device_lengths=True)

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
        if metadata.kv_lens_device is None:
            raise ValueError("attention backend TRITON needs md.kv_lens_device (the KV lengths on the device)")
        if metadata.sliding_window is not None:
            raise ValueError("attention backend TRITON does not support sliding windows")

    def _write(self, kv_cache: torch.Tensor, plane: int, values: torch.Tensor, md: AttentionMetadata) -> None:
        _, planes, h, p, _ = kv_cache.shape
        scatter_rows(kv_cache, cache_write_rows(md.slot_mapping, planes, h, p, plane), values)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                v_dim: int, mla: bool) -> torch.Tensor:
        from .triton_paged_kernel import paged_attention
        self.prepare(md)
        if kv_cache.dtype != q.dtype:
            raise ValueError(f"TRITON needs the KV cache in the query dtype ({q.dtype}), got {kv_cache.dtype}")
        return paged_attention(q.contiguous(), kv_cache, md.block_tables, md.kv_lens_device, scale, md.causal,
                               v_dim, mla)

    def forward(self, q, k, v, kv_cache, metadata, scale):
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [num_pages, 2, Hkv, P, D] -> [T, Hq, D]."""
        self._write(kv_cache, 0, k, metadata)
        self._write(kv_cache, 1, v, metadata)
        return self._attend(q, kv_cache, metadata, scale, q.shape[-1], mla=False)

    def forward_mla(self, q, latent, kv_cache, metadata, scale, v_dim):
        """q: [T, H, R+r]; latent: [T, R+r]; kv_cache: [num_pages, 1, 1, P, R+r] -> [T, H, R]."""
        self._write(kv_cache, 0, latent[:, None, :], metadata)
        return self._attend(q, kv_cache, metadata, scale, v_dim, mla=True)
