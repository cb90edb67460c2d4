"""KVTransferAgent in one process: two agents over their own pools, pages pulled with NIXL (UCX tcp on
DRAM; VRAM on a GPU machine). The pulled pages equal the source pages byte for byte, the pool left
behind reads as zeros, the per-pool byte counts are the pages' sizes, and a peer in another memory
type or an unknown peer is refused."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
from tensorrt_llm.serve.disagg.transfer import KVTransferAgent, page_runs  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _own_ucx_tls(monkeypatch):
    """Each test's agents choose UCX_TLS themselves (a DRAM agent sets it for the process); restored after."""
    monkeypatch.setenv("UCX_TLS", "")
    monkeypatch.delenv("UCX_TLS")


def _pools(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(2, 12, 2, 2, 4, 8, generator=g).to(torch.bfloat16)     # [L, pages, planes, heads, P, D]
    draft = torch.randn(3, 12, 1, 1, 4, 16, generator=g)                          # another dtype and layout
    return {"target": target.to(device), "draft": draft.to(device)}


@pytest.mark.parametrize("device", DEVICES)
def test_pull_copies_pages_of_both_pools(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    src_pools, dst_pools = _pools(device, 0), _pools(device, 1)
    src = KVTransferAgent(src_pools, 4, "context")
    dst = KVTransferAgent(dst_pools, 4, "generation")
    meta = src.metadata()
    assert meta["mem"] == ("DRAM" if device == "cpu" else "VRAM") and meta["dev_id"] == dst.dev_id
    dst.add_peer(meta)
    # remote 3..5 -> local 6..8 is one run; remote 10, 11 are consecutive but land on 9, 2: two runs
    remote, local = [3, 4, 5, 2, 10, 11], [6, 7, 8, 0, 9, 2]
    before = {n: t.clone() for n, t in dst_pools.items()}
    stats = dst.pull(src.name, remote, local)
    assert stats["descriptors"] == 4 * (2 + 3)        # 4 runs in each of the 2 + 3 layers
    for n in ("target", "draft"):
        assert torch.equal(dst_pools[n][:, local], src_pools[n][:, remote])
        untouched = [p for p in range(12) if p not in local]
        assert torch.equal(dst_pools[n][:, untouched], before[n][:, untouched])
        t = src_pools[n]
        assert stats["pool_bytes"][n] == len(local) * t.shape[0] * t[0, 0].numel() * t.element_size()
    assert stats["bytes"] == sum(stats["pool_bytes"].values()) and stats["seconds"] > 0
    # the target pool alone: the draft pool's local pages are zeroed, never left at an older request's KV
    stats = dst.pull(src.name, [1], [3], pools=["target"])
    assert torch.equal(dst_pools["target"][:, [3]], src_pools["target"][:, [1]])
    assert not dst_pools["draft"][:, [3]].any() and list(stats["pool_bytes"]) == ["target"]
    with pytest.raises(ValueError, match="2 remote pages for 1 local pages"):
        dst.pull(src.name, [1, 2], [3])
    with pytest.raises(RuntimeError, match="not registered"):
        dst.pull("nobody", [1], [3])
    other = "VRAM" if device == "cpu" else "DRAM"
    with pytest.raises(ValueError, match=f"keeps its KV in {other}"):
        dst.add_peer({**meta, "agent_name": "other-mem", "mem": other})


def test_page_runs():
    lo, rem, n = page_runs([6, 7, 8, 0, 9, 2], [3, 4, 5, 2, 10, 11])
    assert lo.tolist() == [6, 0, 9, 2] and rem.tolist() == [3, 2, 10, 11] and n.tolist() == [3, 1, 1, 1]
    lo, rem, n = page_runs([4, 5, 6], [1, 2, 3])
    assert lo.tolist() == [4] and rem.tolist() == [1] and n.tolist() == [3]
    lo, rem, n = page_runs([1], [7])
    assert lo.tolist() == [1] and rem.tolist() == [7] and n.tolist() == [1]


def test_pools_must_be_contiguous():
    pools = _pools("cpu", 0)
    pools["draft"] = pools["draft"].transpose(4, 5)
    with pytest.raises(ValueError, match="contiguous tensors on one device"):
        KVTransferAgent(pools, 4, "context")
