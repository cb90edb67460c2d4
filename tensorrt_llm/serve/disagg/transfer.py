"""KV page transfer between disaggregated workers over NIXL (UCX backend).

Each worker registers its KV pools (`KVCacheManager.pools`: {"target", "draft"} tensors
[L, num_pages, planes, heads, P, D]) with one NIXL agent. Page `p` of layer `l` is one contiguous
run of `page_bytes` at `base + (l * num_pages + p) * page_bytes`, so a request's blocks are at most
L x n descriptors per pool (pages consecutive on both sides share one descriptor per layer). The
GEN worker READs the CTX worker's pages into its own pages (both pools, each at its own dtype); CTX
only has to keep them until GEN says it has them.

On a CPU host NIXL moves DRAM to DRAM through UCX, which needs the TCP transport: the agent sets
`UCX_TLS=tcp,self,sm` (plus cuda_copy where a GPU is present: NIXL requires it there) in the process
environment (unless the operator set UCX_TLS) before UCX starts. This is transport setup of the
worker process, not a behaviour switch. CUDA pools are registered as VRAM (the tensor's device
index) and keep UCX's default transports (all), among them cuda_ipc (a peer process's VRAM on this
host, the same GPU included) and cuda_copy; a UCX_TLS set by the operator must name them (NIXL
refuses one without cuda_copy on a GPU host).

CUDA ordering (the engine queues its work on one stream per process; NIXL copies on UCX's own):
- CTX: `wait_device()` before the pages are published, so the prefill's writes of both pools are
  done before any GEN can read them;
- GEN: `pull` waits for this process's queued work before the READ (a page just freed by a
  finished request may still be written by the step in flight) and returns only when NIXL reports
  the READ done, which for VRAM means the copy completed on the GPU, so the next step's kernels,
  queued after the pull returns, read the pulled pages.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger("tensorrt_llm")

CPU_UCX_TLS = "tcp,self,sm"


@dataclass(frozen=True)
class PoolInfo:
    """One registered pool as a peer sees it."""

    addr: int               # base address of the [L, num_pages, ...] tensor
    num_layers: int
    num_pages: int
    page_bytes: int         # one layer's page
    page_shape: tuple[int, ...]   # [planes, heads, P, D]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "PoolInfo":
        page = t[0, 0]
        return cls(t.data_ptr(), t.shape[0], t.shape[1], page.numel() * page.element_size(),
                   tuple(page.shape), str(t.dtype).replace("torch.", ""))

    def descs(self, starts: np.ndarray, lengths: np.ndarray, dev_id: int) -> np.ndarray:
        """[L * n, 3] (addr, len, devId) of n runs of consecutive pages (first page, page count) in every
        layer, layer-major."""
        layers = np.arange(self.num_layers, dtype=np.int64)[:, None]
        addr = self.addr + (layers * self.num_pages + starts[None, :]) * self.page_bytes
        out = np.empty((addr.size, 3), dtype=np.int64)
        out[:, 0], out[:, 2] = addr.reshape(-1), dev_id
        out[:, 1] = np.broadcast_to(lengths[None, :] * self.page_bytes, addr.shape).reshape(-1)
        return out


def page_runs(local: Sequence[int], remote: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs over which both page lists go up by one: (local firsts, remote firsts, lengths).
    A run is one descriptor per layer (one copy instead of one per page)."""
    lo, rem = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(lo) != 1) | (np.diff(rem) != 1)) + 1
    firsts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([firsts, [len(lo)]]))
    return lo[firsts], rem[firsts], lengths


def layout_of(pools: dict[str, torch.Tensor], tokens_per_block: int) -> dict[str, Any]:
    """What two workers must agree on (pool names, per-page shapes, dtypes, layers, tokens_per_block)."""
    return {"tokens_per_block": tokens_per_block,
            "pools": {n: {"num_layers": t.shape[0], "page_shape": list(t.shape[2:]),
                          "dtype": str(t.dtype).replace("torch.", "")} for n, t in sorted(pools.items())}}


def pages_digest(pools: dict[str, torch.Tensor], pages: Sequence[int]) -> dict[str, str]:
    """sha256 of the bytes of `pages` (every layer) per pool: the transfer check of the tests."""
    idx = torch.tensor(list(pages), dtype=torch.long, device=next(iter(pools.values())).device)
    out = {}
    for name, t in sorted(pools.items()):
        raw = t[:, idx].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(raw).hexdigest()
    return out


class KVTransferAgent:
    """One NIXL agent over a worker's KV pools; `pull` reads a peer's pages into local pages."""

    def __init__(self, pools: dict[str, torch.Tensor], tokens_per_block: int, role: str,
                 timeout_s: float = 30.0):
        self.device = next(iter(pools.values())).device
        if any(t.device != self.device or not t.is_contiguous() for t in pools.values()):
            raise ValueError("KV pools must be contiguous tensors on one device, got "
                             f"{ {n: (str(t.device), t.is_contiguous()) for n, t in pools.items()} }")
        # NIXL's memory type and devId of the pools (register_memory takes the same from the tensors)
        self.mem, self.dev_id = ("DRAM", 0) if self.device.type == "cpu" else ("VRAM", self.device.index or 0)
        if self.mem == "DRAM":      # must precede the agent's UCX init; NIXL refuses a UCX_TLS without
            # cuda_copy where a GPU is present, even for DRAM pools
            os.environ.setdefault("UCX_TLS", CPU_UCX_TLS + (",cuda_copy" if torch.cuda.is_available() else ""))
        from nixl._api import nixl_agent, nixl_agent_config
        self.name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self.pools = pools
        self.tokens_per_block = tokens_per_block
        self.timeout_s = timeout_s
        self._regs = [self.agent.register_memory(t) for t in pools.values()]
        self.info = {n: PoolInfo.of(t) for n, t in pools.items()}
        self._peers: dict[str, tuple[int, dict[str, PoolInfo]]] = {}     # agent name -> (devId, its pools)

    def wait_device(self) -> None:
        """Until every kernel this process queued on the pools' GPU so far has finished (CPU: at once)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metadata(self) -> dict[str, Any]:
        """What a peer needs to read from this agent (JSON-able)."""
        return {"agent_name": self.name,
                "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "mem": self.mem, "dev_id": self.dev_id,
                "pools": {n: {"addr": i.addr, "num_pages": i.num_pages} for n, i in self.info.items()},
                "layout": layout_of(self.pools, self.tokens_per_block)}

    def add_peer(self, meta: dict[str, Any]) -> None:
        """Register a peer agent (after the caller checked its layout against ours)."""
        name = meta["agent_name"]
        if name in self._peers:
            return
        if meta.get("mem") != self.mem:     # one NIXL READ has one memory type on both sides
            raise ValueError(f"peer {name} keeps its KV in {meta.get('mem')}, this worker in {self.mem}")
        self.agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
        mine = self.info
        self._peers[name] = (int(meta["dev_id"]), {
            n: PoolInfo(p["addr"], mine[n].num_layers, p["num_pages"], mine[n].page_bytes, mine[n].page_shape,
                        mine[n].dtype) for n, p in meta["pools"].items()})

    def forget_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:     # the peer is gone anyway
                logger.warning("removing NIXL peer %s: %s", name, e)

    def pull(self, peer: str, remote_pages: Sequence[int], local_pages: Sequence[int],
             pools: Optional[Sequence[str]] = None) -> dict[str, Any]:
        """READ the peer's `remote_pages` of `pools` (default: all) into `local_pages`; blocks until
        done (the other pools' local pages are zeroed: the diagnostic negative control). Raises
        RuntimeError on a failed or timed-out transfer. Returns {bytes, seconds, pool_bytes, descriptors}
        (pool_bytes: per pool pulled; descriptors: NIXL descriptors per side, one per run of pages
        consecutive on both sides and layer)."""
        if len(remote_pages) != len(local_pages):
            raise ValueError(f"{len(remote_pages)} remote pages for {len(local_pages)} local pages")
        if peer not in self._peers:
            raise RuntimeError(f"NIXL peer {peer!r} is not registered (no handshake)")
        names = list(self.pools) if pools is None else list(pools)
        left = [n for n in self.pools if n not in names]
        if left and local_pages:     # a pool left behind reads as zeros, never as an earlier request's KV
            idx = torch.tensor(list(local_pages), dtype=torch.long, device=self.pools[left[0]].device)
            for n in left:
                self.pools[n][:, idx] = 0
        pool_bytes = {n: len(local_pages) * self.info[n].num_layers * self.info[n].page_bytes for n in names}
        if not local_pages or not names:
            return {"bytes": 0, "seconds": 0.0, "pool_bytes": {n: 0 for n in names}, "descriptors": 0}
        remote_dev, remote = self._peers[peer]
        lo, rem, lengths = page_runs(local_pages, remote_pages)
        local_d = np.concatenate([self.info[n].descs(lo, lengths, self.dev_id) for n in names])
        remote_d = np.concatenate([remote[n].descs(rem, lengths, remote_dev) for n in names])
        self.wait_device()         # no queued kernel of this process writes these pages during the READ
        t0 = time.perf_counter()
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local_d, self.mem),
                                            self.agent.get_xfer_descs(remote_d, self.mem), peer)
        if not handle:
            raise RuntimeError(f"NIXL could not create a transfer from {peer}")
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"NIXL transfer from {peer} failed")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL transfer from {peer} timed out after {self.timeout_s} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)
        return {"bytes": int(local_d[:, 1].sum()), "seconds": time.perf_counter() - t0, "pool_bytes": pool_bytes,
                "descriptors": len(local_d)}
