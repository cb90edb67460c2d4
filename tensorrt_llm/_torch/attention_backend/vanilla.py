"""VANILLA attention: plain torch SDPA over gathered pages. Runs on CPU and CUDA.

This is the reference every fast backend is tested against. It also reads KV lengths computed on
the device (`AttentionMetadata.kv_lens_device`): its masks then come from that tensor and its keys
span a host bound (`kv_len_bound`, else the block tables' width), so no host value is needed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .interface import AttentionBackend, AttentionMetadata, BackendCapabilities, write_kv, write_slots


class _Layout:
    """Host-built index tensors to pad packed tokens per request (cached per step)."""

    def __init__(self, md: AttentionMetadata, device: torch.device):
        b = md.num_seqs
        self.q_max = max(md.seq_lens) if b else 0
        bidx, qidx = [], []
        for i, s in enumerate(md.seq_lens):
            bidx.extend([i] * s)
            qidx.extend(range(s))
        self.batch_idx = torch.tensor(bidx, dtype=torch.long, device=device)
        self.q_idx = torch.tensor(qidx, dtype=torch.long, device=device)
        self.uniform = all(s == self.q_max for s in md.seq_lens)
        seq = torch.tensor(md.seq_lens, dtype=torch.long, device=device)
        if md.kv_lens_device is not None:   # lengths on the device: masks from them, keys up to a bound
            kv_len = md.kv_lens_device.long()
            cached = kv_len - seq
            width = md.block_tables.shape[1] * md.tokens_per_block
            self.kv_max = min(md.kv_len_bound or width, width) if b else 0
        else:
            cached = torch.tensor(md.num_cached, dtype=torch.long, device=device)
            kv_len = torch.tensor(md.kv_lens, dtype=torch.long, device=device)
            self.kv_max = max(md.kv_lens) if b else 0
        key_pos = torch.arange(self.kv_max, device=device)
        q_pos = cached[:, None] + torch.arange(self.q_max, device=device)[None, :]  # [B, Q]
        valid = key_pos[None, None, :] < kv_len[:, None, None]                      # [B, 1, K]
        if md.causal:
            valid = valid & (key_pos[None, None, :] <= q_pos[:, :, None])
        else:
            valid = valid.expand(b, self.q_max, self.kv_max)
        if md.sliding_window is not None:
            valid = valid & (key_pos[None, None, :] > q_pos[:, :, None] - md.sliding_window)
        pad_q = torch.arange(self.q_max, device=device)[None, :] >= seq[:, None]    # [B, Q]
        # Padded query rows attend to key 0 only (avoids NaN); their output is dropped.
        valid = valid | (pad_q[:, :, None] & (key_pos[None, None, :] == 0))
        self.mask = valid[:, None]                                                   # [B,1,Q,K]


def _layout(md: AttentionMetadata, device: torch.device) -> _Layout:
    lay = md.extras.get("vanilla_layout")
    if lay is None:
        lay = _Layout(md, device)
        md.extras["vanilla_layout"] = lay
    return lay


def gather_pages(cache_plane: torch.Tensor, block_tables: torch.Tensor, kv_max: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """[num_pages, H, P, D] pages -> [B, H, kv_max, D] contiguous per request.

    Sentinel entries are read as page 0 but always masked out by the caller.
    """
    p = cache_plane.shape[2]
    nb = (kv_max + p - 1) // p
    bt = block_tables[:, :nb].long().clamp(min=0)
    g = cache_plane[bt]                                   # [B, nb, H, P, D]
    b, _, h, _, d = g.shape
    g = g.permute(0, 2, 1, 3, 4).reshape(b, h, nb * p, d)[:, :, :kv_max]
    return g.to(dtype)


def _pad(x: torch.Tensor, lay: _Layout, b: int) -> torch.Tensor:
    """[T, H, D] packed -> [B, H, Q, D]."""
    if lay.uniform:
        return x.view(b, lay.q_max, *x.shape[1:]).transpose(1, 2)
    out = x.new_zeros(b, lay.q_max, *x.shape[1:])
    out[lay.batch_idx, lay.q_idx] = x
    return out.transpose(1, 2)


def _unpad(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """[B, H, Q, D] -> [T, H, D]."""
    x = x.transpose(1, 2)
    if lay.uniform:
        return x.reshape(-1, *x.shape[2:])
    return x[lay.batch_idx, lay.q_idx]


def paged_sdpa(q: torch.Tensor, k_pages: torch.Tensor, v_pages: Optional[torch.Tensor],
               md: AttentionMetadata, scale: float, v_dim: Optional[int] = None) -> torch.Tensor:
    """Masked SDPA of packed queries over paged K/V.

    q: [T, Hq, D]; k_pages: [num_pages, Hkv, P, D]; v_pages: same or None (value =
    key[..., :v_dim], the absorbed-MLA case). Returns [T, Hq, Dv].
    """
    lay = _layout(md, q.device)
    b = md.num_seqs
    k = gather_pages(k_pages, md.block_tables, lay.kv_max, q.dtype)
    v = k[..., :v_dim] if v_pages is None else gather_pages(v_pages, md.block_tables, lay.kv_max, q.dtype)
    qp = _pad(q, lay, b)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=lay.mask, scale=scale,
                                         enable_gqa=k.shape[1] != qp.shape[1])
    return _unpad(out, lay)


class VanillaAttention(AttentionBackend):
    """SDPA over pages; supports every feature, slowly."""

    name = "VANILLA"
    capabilities = BackendCapabilities(paged=True, mla=True, non_causal_block=True,
                                       sliding_window=True, fp8_kv=True, cuda_graphs=False, device_lengths=True)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """A step's layout is built at its first layer; a metadata reused across steps (the device draft
        step's) gets a fresh one, since its device lengths change between steps."""
        metadata.extras.pop("vanilla_layout", None)

    def forward(self, q, k, v, kv_cache, metadata, scale):
        write_kv(kv_cache, k, v, lambda cache, plane, x: write_slots(cache[:, plane], x, metadata.slot_mapping))
        return paged_sdpa(q, kv_cache[:, 0], kv_cache[:, 1], metadata, scale)

    def forward_mla(self, q, latent, kv_cache, metadata, scale, v_dim):
        write_slots(kv_cache[:, 0], latent[:, None, :], metadata.slot_mapping)
        return paged_sdpa(q, kv_cache[:, 0], None, metadata, scale, v_dim=v_dim)
