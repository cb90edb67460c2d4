"""Target hidden-state capture for DSpark training: the frozen target over whole sequences.

Two paths, equal up to kernel rounding (`tests/unittest/tools/test_dspark_capture.py`):

* ``paged``: the engine's own inference path (VANILLA backend, one page per sequence, a
  boolean mask per request). The reference.
* ``dense`` (default): the batch right-padded to one length L and run as ``[S, L]`` with a
  causal SDPA and no KV cache (flash attention on CUDA). Right padding is invisible to real
  positions under a causal mask. Layers after the last captured one are skipped unless the
  final hidden states are asked for (`with_final`, for distillation on the target's distribution).
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

from .._torch.attention_backend.interface import (AttentionBackend, AttentionMetadata,
                                                  BackendCapabilities)


class DenseCausalAttention(AttentionBackend):
    """Training-only backend: causal SDPA over a right-padded [S, L] batch; keeps no KV cache."""

    name = "DENSE_CAUSAL"
    capabilities = BackendCapabilities(paged=False)

    def __init__(self, num_seqs: int, length: int):
        self.shape = (num_seqs, length)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, metadata,
                scale: float) -> torch.Tensor:
        """q [S*L, Hq, D], k/v [S*L, Hkv, D] -> [S*L, Hq, D]; kv_cache and metadata unused."""
        s, length = self.shape
        hq, hkv = q.shape[1], k.shape[1]
        if q.shape[0] != s * length:
            raise ValueError(f"dense capture got {q.shape[0]} tokens, expected {s} x {length}")
        qh = q.view(s, length, hq, -1).transpose(1, 2)
        kh = k.reshape(s, length, hkv, -1).transpose(1, 2)
        vh = v.reshape(s, length, hkv, -1).transpose(1, 2)
        if hq != hkv:                                   # flash takes equal head counts
            kh, vh = kh.repeat_interleave(hq // hkv, 1), vh.repeat_interleave(hq // hkv, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(s * length, hq, -1)


class TargetCapture:
    """Frozen target; returns the residual stream after each of `layer_ids` for whole sequences."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int],
                 mode: Literal["dense", "paged"] = "dense"):
        if mode not in ("dense", "paged"):
            raise ValueError(f"capture mode {mode!r}: expected 'dense' or 'paged'")
        n = target.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"capture layer ids {bad} outside the target's {n} layers")
        self.target, self.layer_ids, self.mode = target, list(layer_ids), mode

    def __call__(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """seqs: token ids -> (captured [S, L, n*H] target dtype, input_ids [S, L], seq_lens [S]).

        Rows past a sequence's length are zero in both outputs.
        """
        captured, _, ids, lens = self.with_final(seqs, final=False)
        return captured, ids, lens

    @torch.no_grad()
    def with_final(self, seqs: list[list[int]], final: bool = True
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Like `__call__`, plus the target's final-normed hidden states [S, L, H] (None unless
        `final`): `target.lm_head` of row p gives the target's distribution of token p+1 (all layers
        run)."""
        if not seqs or min(len(q) for q in seqs) == 0:
            raise ValueError("capture needs at least one non-empty sequence")
        dev = self.target.lm_head.weight.device
        lens = [len(q) for q in seqs]
        ids = torch.zeros(len(seqs), max(lens), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, :len(q)] = torch.as_tensor(q, dtype=torch.long)
        ids, lens_t = ids.to(dev, non_blocking=True), torch.tensor(lens, device=dev)
        if self.mode == "paged":                      # padding rows are never written: already zero
            cap, fin = self._paged(ids, lens, final)
            return cap, fin, ids, lens_t
        cap, fin = self._dense(ids, final)
        valid = (torch.arange(ids.shape[1], device=dev)[None, :] < lens_t[:, None])[..., None].to(cap.dtype)
        return cap * valid, (fin * valid if fin is not None else None), ids, lens_t

    def _dense(self, ids: torch.Tensor, final: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        s, length = ids.shape
        model = self.target.model
        pos = torch.arange(length, device=ids.device).repeat(s)
        backend = DenseCausalAttention(s, length)
        rope = self.target.rotary.cos_sin(pos)
        h = model.embed_tokens(ids.reshape(-1))
        want, captured = set(self.layer_ids), {}
        last = len(model.layers) if final else max(self.layer_ids) + 1
        for i, layer in enumerate(model.layers[:last]):
            h = layer(h, pos, None, None, backend, rope)
            if i in want:
                captured[i] = h
        cap = torch.cat([captured[i] for i in self.layer_ids], dim=-1).view(s, length, -1)
        return cap, (model.norm(h).view(s, length, -1) if final else None)

    def _paged(self, ids: torch.Tensor, lens: list[int], final: bool
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        from .._torch.attention_backend.vanilla import VanillaAttention
        s, length = ids.shape
        dev, dtype = ids.device, self.target.lm_head.weight.dtype
        page = -(-length // 16) * 16
        n_layers, n_kv, head_dim = self.target.kv_cache_layout()
        caches = torch.zeros(n_layers, s, 2, n_kv, page, head_dim, dtype=dtype, device=dev).unbind(0)
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        row = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).to(dev)
        md = AttentionMetadata(seq_lens=lens, num_cached=[0] * s,
                               block_tables=torch.arange(s, dtype=torch.int32, device=dev)[:, None],
                               slot_mapping=row * page + pos, tokens_per_block=page, causal=True)
        backend = VanillaAttention()
        backend.prepare(md)
        normed, captured = self.target(ids[row, pos], pos, caches, md, backend, self.layer_ids)
        cap = torch.cat(captured, dim=-1)
        out = cap.new_zeros(s, length, cap.shape[-1])
        out[row, pos] = cap
        if not final:
            return out, None
        fin = normed.new_zeros(s, length, normed.shape[-1])
        fin[row, pos] = normed
        return out, fin
