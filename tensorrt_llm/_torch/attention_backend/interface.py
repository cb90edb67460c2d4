"""Attention backend interface: per-step metadata and backend capabilities.

A step packs the new tokens of all scheduled requests into one flat token axis
(no padding). For request ``b`` the KV it attends to is laid out in its pages::

    positions:  0 ........ num_cached[b]-1 | num_cached[b] ... num_cached[b]+seq_lens[b]-1
                <--- already in the pages ---> <---- written this step (slot_mapping) --->

Queries are the new tokens. ``causal=True`` (prefill, decode, verify): new token i
sees keys at positions <= num_cached[b] + i. ``causal=False`` (a DSpark draft block):
every new token sees all keys < num_cached[b] + seq_lens[b].
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Sequence

import numpy as np
import torch

BAD_PAGE_INDEX = -1
"""Sentinel in block tables for an unallocated page. Never page 0."""


def host_ints(values: Sequence[int] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64
              ) -> torch.Tensor:
    """Python ints or a numpy array -> a `dtype` tensor on `device`, copied from pinned memory (no wait
    on the GPU queue). The one host -> device path for step metadata, from the backends up."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run. The resolver and the model check these, never class names."""

    paged: bool = True
    mla: bool = False
    non_causal_block: bool = False
    sliding_window: bool = False
    fp8_kv: bool = False
    cuda_graphs: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda")
    # activation (query) dtypes its kernels take, by torch name
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    # reads the KV lengths from `AttentionMetadata.kv_lens_device` (no host plan): a step whose
    # lengths are computed on the GPU can be captured and launched before the host knows them
    device_lengths: bool = False
    # with device_lengths: ragged queries whose offsets live on the device too
    # (`AttentionMetadata.qo_indptr_device`), so one captured graph runs any mix of segments
    ragged_graphs: bool = False
    # `forward_rope`: rotates q and k (half-rotation RoPE) in the launch that appends K/V, so a model
    # with layer regions hands it the q|k|v GEMM's output unrotated
    fused_rope_append: bool = False
    # with fused_rope_append: `forward_rope` / `forward_mla_rope` run as one CuTe DSL launch per layer
    # (`cute_rope_append`) and an MLA drafter's context latents through the CuTe DSL prep kernel
    # (`cute_norm_rope`), so a model on this backend must hand every layer's inputs unrotated (a drafter
    # that cannot is refused at load)
    cute_norm_rope: bool = False


@dataclass(frozen=True)
class HeadNorms:
    """Per-head RMSNorms of q and k that `forward_rope` applies before the rotation (a q / k-normed
    attention: the DSpark drafter's GQA layers). Weights [D] in the values' dtype, one eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (passed explicitly to every model forward).

    Shapes: B = requests in the step, T = sum(seq_lens) packed new tokens.
    """

    seq_lens: list[int]                 # [B] new tokens per request
    num_cached: list[int]               # [B] tokens already in the pages
    block_tables: torch.Tensor          # [B, max_blocks] int32, BAD_PAGE_INDEX when unallocated
    slot_mapping: torch.Tensor          # [T] int64 flat slot (page*P + offset); -1 = skip write
    tokens_per_block: int
    causal: bool = True
    sliding_window: Optional[int] = None  # keys older than this many positions are masked
    # (batch bucket, tokens per request, max pages per request) of a captured CUDA graph step:
    # backends plan fixed-address state for it; None for an eager step
    graph_shape: Optional[tuple[int, int, int]] = None
    # [B] int32 on the device: num_cached + seq_lens, for backends with `device_lengths` (the
    # host lists above may then be stale placeholders)
    kv_lens_device: Optional[torch.Tensor] = None
    # with kv_lens_device: a host upper bound of every KV length (None: the block tables' width)
    kv_len_bound: Optional[int] = None
    # [B + 1] int32 on the device: request b's new tokens are rows qo_indptr_device[b]..[b + 1] - 1 (a
    # captured step of any mix of segments, backends with `ragged_graphs`), with max_q_bound a host
    # bound of any request's new tokens; seq_lens and num_cached are then placeholders
    qo_indptr_device: Optional[torch.Tensor] = None
    max_q_bound: Optional[int] = None
    # every slot_mapping entry >= 0, when the producer knows it on the host (None: backends look at
    # the device tensor once, a sync)
    slots_all_valid: Optional[bool] = None
    extras: dict = field(default_factory=dict)  # backend-owned plan state (e.g. flashinfer)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))

    @property
    def kv_lens(self) -> list[int]:
        return [c + s for c, s in zip(self.num_cached, self.seq_lens)]

    def all_slots_valid(self) -> bool:
        """No -1 in slot_mapping: a graph step's (its runner checks) or a host-known answer, else
        one look at the device tensor."""
        if self.graph_shape is not None:
            return True
        if self.slots_all_valid is not None:
            return self.slots_all_valid
        return not bool((self.slot_mapping < 0).any())

    def validate(self, num_pages: int) -> None:
        """Raise ValueError when any table entry or slot lies outside the pool."""
        bt = self.block_tables
        if bt.numel():
            bad = (bt != BAD_PAGE_INDEX) & ((bt < 0) | (bt >= num_pages))
            if bool(bad.any()):
                raise ValueError(f"block table holds page ids outside [0, {num_pages}): "
                                 f"{bt[bad].tolist()[:8]}")
        sm = self.slot_mapping
        if sm.numel():
            bad = (sm != -1) & ((sm < 0) | (sm >= num_pages * self.tokens_per_block))
            if bool(bad.any()):
                raise ValueError(f"slot_mapping holds slots outside the pool: {sm[bad].tolist()[:8]}")


class AttentionBackend(ABC):
    """One attention implementation. Subclasses declare `name` and `capabilities`."""

    name: ClassVar[str] = "ABSTRACT"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()

    @classmethod
    def availability(cls, device: torch.device) -> tuple[bool, str]:
        """(can run on `device`, reason when not)."""
        if device.type not in cls.capabilities.devices:
            return False, f"{cls.name} does not run on {device.type}"
        return True, ""

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Per-step planning hook (called once per step before the layers run)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """GQA over pages.

        q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens, written to the cache first);
        kv_cache: [num_pages, 2, Hkv, P, D]. Returns [T, Hq, D].
        """

    def forward_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                     head_norms: Optional[HeadNorms] = None) -> torch.Tensor:
        """`forward` of unrotated q [T, Hq, D] and k [T, Hkv, D]: the backend rotates both with the
        half-rotation tables cos / sin [T, 1, D] (float32, `RotaryEmbedding.cos_sin`) as it writes
        K/V, after their per-head RMSNorms when head_norms is given. Only where
        `capabilities.fused_rope_append`."""
        raise ValueError(f"attention backend {self.name} does not fuse RoPE into its KV append")

    def forward_mla_rope(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, v_dim: int, w_uk: Optional[torch.Tensor] = None,
                         w_uv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`forward_mla` from the layer's unrotated pieces: q_lat [T, H, R] (q_nope W_UK), q_pe
        [T, H, r] and the raw latent kv [T, R + r] = [c_kv | k_pe]; the backend builds q = [q_lat |
        rope(q_pe)] and writes [rms_norm(c_kv) (norm_weight [R], eps) | rope(k_pe)] as it appends
        (cos / sin [T, 1, r], half rotation). With w_uk [H, nope, R] the first argument is q_nope
        [T, H, nope] and the backend forms q_lat; with w_uv [H, v, R] it returns the heads' outputs
        through W_UV, [T, H, v], instead of [T, H, R] in latent space. Only where
        `capabilities.fused_rope_append`."""
        raise ValueError(f"attention backend {self.name} does not fuse RoPE into its KV append")

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
        """Absorbed MLA over paged latents (MQA with value = latent[..., :v_dim]).

        q: [T, H, Dl] with Dl = kv_lora_rank + rope dim; latent: [T, Dl] new entries;
        kv_cache: [num_pages, 1, 1, P, Dl]. Returns [T, H, v_dim] (still in latent space).
        """
        raise ValueError(f"attention backend {self.name} does not support MLA")


def write_slots(cache_plane: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                all_valid: bool = False) -> None:
    """Scatter new tokens into pages.

    cache_plane: [num_pages, H, P, D]; values: [T, H, D]; slot_mapping: [T] (-1 skipped).
    all_valid: the caller guarantees every slot >= 0 (no host sync; safe inside CUDA graphs).
    """
    rows = _kept_rows(values, slot_mapping, all_valid, cache_plane.shape[2])
    if rows is not None:
        cache_plane, vals = writable(cache_plane, rows[0])
        cache_plane[rows[1], :, rows[2]] = vals


def _kept_rows(values: torch.Tensor, slot_mapping: torch.Tensor, all_valid: bool, page_size: int
               ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The rows to write (-1 slots dropped unless all_valid) -> (values, page, offset), or None when
    none is left."""
    if not all_valid:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            values, slot_mapping = values[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return None
    return values, slot_mapping // page_size, slot_mapping % page_size


def stacked_layers(caches: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-layer caches that are consecutive, equally spaced views of one pool tensor (the KV
    manager's [L, pages, ...] allocation: `KVCacheManager.layer_caches`) -> that [L, pages, ...]
    view; None otherwise (then each layer is written on its own)."""
    first = caches[0] if caches else None
    if first is None or any(c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype
                            or c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                            for c in caches):
        return None
    step = (caches[1].data_ptr() - first.data_ptr()) // first.element_size() if len(caches) > 1 else first.numel()
    if step <= 0 or any(c.data_ptr() != first.data_ptr() + i * step * first.element_size()
                        for i, c in enumerate(caches)):
        return None
    return first.as_strided((len(caches),) + tuple(first.shape), (step,) + tuple(first.stride()))


def write_slots_layers(pool: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                       all_valid: bool = False) -> None:
    """`write_slots` of every layer and plane at once: pool [L, num_pages, planes, H, P, D] (from
    `stacked_layers`), values [T, L, planes, H, D], slot_mapping [T] (-1 skipped; all_valid as there)."""
    rows = _kept_rows(values, slot_mapping, all_valid, pool.shape[4])
    if rows is not None:
        pool, vals = writable(pool, rows[0])
        pool[:, rows[1], :, :, rows[2]] = vals


def joint_kv(k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
    """k, v [T, H, D] -> a [T, 2H, D] view covering both when, token by token, v's heads follow k's
    directly in one allocation (the layer regions write them so: `compiled_regions.attention_inputs`);
    None otherwise. With `joint_planes` one cache write then covers the K and the V plane."""
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.stride() != v.stride():
        return None
    t, h, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    if v.data_ptr() != k.data_ptr() + h * d * k.element_size() or (t > 1 and k.stride(0) < 2 * h * d):
        return None
    return k.as_strided((t, 2 * h, d), (k.stride(0), d, 1))


def joint_planes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous [num_pages, 2, H, P, D] K/V cache as [num_pages, 1, 2H, P, D]: plane p's head h is
    head p * H + h, so `joint_kv` rows write both planes at once."""
    n, planes, h, p, d = kv_cache.shape
    return kv_cache.view(n, 1, planes * h, p, d)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             write: Callable[[torch.Tensor, int, torch.Tensor], None]) -> None:
    """K and V [T, H, D] into planes 0 and 1 of kv_cache [num_pages, 2, H, P, D] through a backend's
    `write(cache, plane, values)`: one call covering both planes when they are one buffer's halves
    (`joint_kv`, over `joint_planes`), else one call per plane."""
    kv = joint_kv(k, v)
    if kv is not None:
        write(joint_planes(kv_cache), 0, kv)
    else:
        write(kv_cache, 0, k)
        write(kv_cache, 1, v)


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def writable(cache: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache, values cast to its dtype) to index-write; fp8 pools as their bytes (uint8 views), which
    every device's indexed copy supports."""
    vals = values.to(cache.dtype)
    if cache.dtype in FP8_KV_DTYPES:
        return cache.view(torch.uint8), vals.view(torch.uint8)
    return cache, vals


def device_positions(starts: torch.Tensor, q: int, block_tables: torch.Tensor, page_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and slots of q new tokens per request, computed on the device (no host value).

    starts [B] int64 (first new position per request), block_tables [B, W] int32 ->
    (positions [B, q] int64, slot_mapping [B * q] int64; -1 where the page is BAD_PAGE_INDEX or
    past the table)."""
    pos = starts[:, None] + torch.arange(q, device=starts.device)
    col = pos // page_size
    w = block_tables.shape[1]
    pages = block_tables.long().gather(1, col.clamp(max=w - 1))
    slots = torch.where((pages >= 0) & (col < w), pages * page_size + pos % page_size, -1)
    return pos, slots.view(-1)
