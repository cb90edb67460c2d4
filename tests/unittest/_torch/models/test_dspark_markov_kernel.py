"""The greedy drafts' Markov chain in Triton (`dspark_markov_kernel`) against the torch ops
(`dspark_regions.greedy_drafts`): CPU in Triton's interpreter, the H200 at the drafter's shapes."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from tensorrt_llm._torch.models.dspark_markov_kernel import BLOCK_V, argmax_rows, greedy_drafts_triton, \
    markov_greedy_chain
from tensorrt_llm._torch.models.dspark_regions import DrafterRegions, greedy_drafts


def _reference(logits: torch.Tensor, anchors: torch.Tensor, w1: Optional[torch.Tensor],
               w2: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch chain -> (ids [R, n], each pick's margin over the runner-up [R, n])."""
    prev, ids, margins = anchors, [], []
    for j in range(logits.shape[1]):
        lj = logits[:, j].float()
        if w1 is not None:
            lj = lj + F.linear(F.embedding(prev, w1), w2).float()
        top = lj.topk(2, dim=-1).values
        prev = lj.argmax(-1)
        ids.append(prev)
        margins.append(top[:, 0] - top[:, 1])
    return torch.stack(ids, 1), torch.stack(margins, 1)


def _case(r: int, n: int, v: int, rank: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(r, n, v, generator=g) * 3).to(dtype).to(device)
    w1 = (torch.randn(v, rank, generator=g) * 2).to(dtype).to(device) if rank else None
    w2 = torch.randn(v, rank, generator=g).to(dtype).to(device) if rank else None
    anchors = torch.randint(0, v, (r,), generator=g).to(device)
    return logits, anchors, w1, w2


def _check(got: torch.Tensor, logits, anchors, w1, w2) -> None:
    """Equal to the torch chain up to the first pick whose margin is within rounding: the bias is
    rounded to the weights' dtype, and one unit in the last place of a bf16 bias near 8 is 0.06
    (after a differing pick the chains see different biases)."""
    want, margins = _reference(logits, anchors, w1, w2)
    tol = 1e-3 if logits.dtype == torch.float32 else 0.15
    for row in range(got.shape[0]):
        for j in range(got.shape[1]):
            if margins[row, j] <= tol:
                break
            assert got[row, j] == want[row, j], (row, j)
    assert (margins > tol).float().mean() > 0.8      # the cases are not mostly near-ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("r,v,rank", [(1, 2 * BLOCK_V + 37, 16), (19, BLOCK_V + 5, 5), (3, 300, 0)],
                         ids=["one-row", "two-row-blocks-rank5", "no-markov"])
def test_chain_equals_torch(dtype: torch.dtype, r: int, v: int, rank: int) -> None:
    logits, anchors, w1, w2 = _case(r, 5, v, rank, dtype, "cpu")
    got = markov_greedy_chain(logits, anchors, w1, w2)
    assert got.dtype == torch.int64 and got.shape == (r, 5)
    _check(got, logits, anchors, w1, w2)
    if rank:      # negative control: the same logits without the Markov bias pick other drafts
        unbiased, _ = _reference(logits, anchors, None, None)
        assert (got != unbiased).float().mean() > 0.5


def test_greedy_drafts_triton_equals_region() -> None:
    """The region function (LM-head GEMM + chain) == `greedy_drafts`, slots first.. of each block."""
    g = torch.Generator().manual_seed(1)
    r, s, h, v, rank = 4, 8, 32, 2 * BLOCK_V + 3, 16
    hidden = torch.randn(r * s, h, generator=g)
    lm_w = torch.randn(v, h, generator=g)
    w1, w2 = torch.randn(v, rank, generator=g) * 2, torch.randn(v, rank, generator=g)
    anchors = torch.randint(0, v, (r,), generator=g)
    for first, n in ((0, 7), (1, 6)):
        got = greedy_drafts_triton(hidden, anchors, lm_w, None, w1, w2, s, first, n)
        assert torch.equal(got, greedy_drafts(hidden, anchors, lm_w, None, w1, w2, s, first, n))
    shifted = greedy_drafts(hidden, anchors, lm_w, None, w1, w2, s, 1, 7)      # control: other slots
    assert not torch.equal(greedy_drafts_triton(hidden, anchors, lm_w, None, w1, w2, s, 0, 7), shifted)


def test_ties_pick_the_lowest_index_across_tiles() -> None:
    """Equal maxima in different vocabulary tiles: the lowest index wins, as torch.argmax."""
    v = 3 * BLOCK_V
    logits = torch.zeros(2, 2, v)
    logits[0, 0, [BLOCK_V + 7, 2 * BLOCK_V + 1]] = 5.0
    logits[1, 0, [2 * BLOCK_V + 9, 3]] = 5.0
    logits[:, 1, 11] = 1.0
    got = markov_greedy_chain(logits, torch.tensor([0, 0]), None, None)
    assert got.tolist() == [[BLOCK_V + 7, 11], [3, 11]]
    assert got[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_rows_equals_torch(dtype: torch.dtype) -> None:
    """The verify argmax (`SpecStepGraph` on CUDA): 19 rows (two programs of up to 16) over three
    X"""
    x = (torch.randn(19, 2 * BLOCK_V + 9, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax_rows(x[:, :BLOCK_V + 1]), x[:, :BLOCK_V + 1].argmax(-1))
    assert not torch.equal(argmax_rows(x), (-x).argmax(-1))          # control: the other extreme


def test_bad_inputs_name_the_problem() -> None:
    logits, anchors, w1, w2 = _case(2, 3, 100, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="anchor_ids must be"):
        markov_greedy_chain(logits, anchors[:1], w1, w2)
    with pytest.raises(ValueError, match="come together"):
        markov_greedy_chain(logits, anchors, w1, None)
    with pytest.raises(ValueError, match=r"\[100, r\]"):
        markov_greedy_chain(logits, anchors, w1[:50], w2[:50])
    with pytest.raises(ValueError, match=r"\[R, n, V\]"):
        markov_greedy_chain(logits[0], anchors, w1, w2)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        argmax_rows(logits)


def test_cuda_regions_use_the_chain() -> None:
    """Eager or compiled, the regions a CUDA engine sets (`create_py_executor`) draft through the chain;
    the CPU's (and the default) keep the torch ops."""
    for regions in (DrafterRegions.inductor(triton_chain=True), DrafterRegions.eager(triton_chain=True)):
        assert regions.greedy_drafts is greedy_drafts_triton and regions.triton_chain
    for regions in (DrafterRegions.inductor(), DrafterRegions.eager()):
        assert regions.greedy_drafts is not greedy_drafts_triton and not regions.triton_chain
    assert DrafterRegions.eager() == DrafterRegions.eager(triton_chain=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("r", [1, 64])
def test_chain_on_gpu_at_drafter_shapes(r: int) -> None:
    """SmolLM2's vocabulary (49,152), 8 drafts, rank 16, bf16, on the GPU."""
    logits, anchors, w1, w2 = _case(r, 8, 49152, 16, torch.bfloat16, "cuda", seed=r)
    got = markov_greedy_chain(logits, anchors, w1, w2)
    _check(got.cpu(), logits.cpu(), anchors.cpu(), w1.cpu(), w2.cpu())
    unbiased, _ = _reference(logits, anchors, None, None)
    assert (got != unbiased).float().mean() > 0.5
    rows = logits.view(-1, logits.shape[-1])                    # the verify argmax over bf16 logits
    assert torch.equal(argmax_rows(rows), rows.argmax(-1))
