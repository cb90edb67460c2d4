"""Device-resident draft ids (`pending_drafts`): lengths without a sync, values on demand, and
the verify step's on-device gather of them into its input ids (`cuda_graph_runner.gather_drafts`)."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import gather_drafts
from tensorrt_llm._torch.runtime.token_rows import TokenRow, PendingTokens, VerifyTokens, gather_shifts


def test_rows_lengths_and_values():
    pend = PendingTokens(torch.arange(12).view(3, 4))
    row = pend.row(1)
    assert len(row) == 4 and bool(row) and row.tolist() == [4, 5, 6, 7]
    assert list(row) == [4, 5, 6, 7] and row[0] == 4 and row[1:3] == [5, 6]
    short = pend.row(2, 2)
    assert len(short) == 2 and list(short) == [8, 9]
    v = VerifyTokens(99, row)
    assert len(v) == 5 and list(v) == [99, 4, 5, 6, 7] and v[-1] == 7
    assert pend.rows() is pend.rows()        # read once
    for bad in ((3, 4), (0, 5), (-1, 1)):
        with pytest.raises(ValueError, match="out of range"):
            TokenRow(pend, *bad)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        PendingTokens(torch.arange(4))


def test_stacked_rows_come_from_the_parts_copies():
    """`PendingTokens.stacked` (DraftsAhead.join): the device rows are the parts' from their first
    columns, in order; the host rows are read from the parts' own copies, not from a copy of the
    stacked tensor (a write into the stacked device rows does not show; it does in a plain
    PendingTokens of the same tensor, the control). Nested stacks read through."""
    a = PendingTokens(torch.tensor([[9, 1, 2, 3], [9, 4, 5, 6]]))
    b = PendingTokens(torch.tensor([[7, 8, 9]]))
    both = PendingTokens.stacked([(a, 1), (b, 0)])
    assert (both.num_rows, both.width) == (3, 3)
    assert both.device.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    both.device[0, 0] = -5
    plain = PendingTokens(both.device)
    assert both.rows() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]] and plain.rows()[0][0] == -5
    three = PendingTokens.stacked([(both, 0), (PendingTokens(torch.tensor([[0, 1, 2, 3]])), 1)])
    assert three.rows()[2:] == [[7, 8, 9], [1, 2, 3]] and three.row(3, 2, 1).tolist() == [2, 3]


def test_gather_drafts_matches_the_host_values_in_any_row_order():
    q, bucket = 5, 6
    a = PendingTokens(torch.randint(0, 1000, (4, q - 1)))
    b = PendingTokens(torch.randint(0, 1000, (3, q - 1)))
    cases = {
        "consecutive": [(0, a.row(0)), (1, a.row(1)), (2, a.row(2))],
        "permuted, two sources": [(0, a.row(3)), (2, a.row(0)), (3, b.row(2)), (5, b.row(0))],
    }
    for name, items in cases.items():
        dst = torch.zeros(bucket, q, dtype=torch.long)
        dst[:, 0] = 7
        toks = [VerifyTokens(7, r) for _, r in items]
        gather_drafts(dst, toks, [j for j, _ in items])
        want = torch.zeros(bucket, q, dtype=torch.long)
        want[:, 0] = 7
        for j, r in items:
            want[j, 1:] = torch.tensor(list(r))
        assert torch.equal(dst, want), name
        # negative control: the drafts of the first two rows swapped
        swapped = want.clone()
        j0, j1 = items[0][0], items[1][0]
        swapped[[j0, j1]] = swapped[[j1, j0]]
        assert not torch.equal(dst, swapped), name
    with pytest.raises(ValueError, match="verify segment of 3 tokens"):
        gather_drafts(torch.zeros(2, q, dtype=torch.long), [VerifyTokens(1, a.row(0, 2))], [0])


def test_gather_shifts_zero_every_row_without_one():
    """Rows with a shift get its device value; rows without one and rows past the list are 0, also
    over a buffer holding last step's values; a list covering every row writes every row."""
    pend = PendingTokens(torch.tensor([[3, 9], [1, 9], [2, 9]]))
    shift = [pend.row(j, 1) for j in range(3)]
    dst = torch.full((5,), 77)
    gather_shifts(dst, [shift[2], None, shift[0]])
    assert dst.tolist() == [2, 0, 3, 0, 0]
    dst.fill_(77)
    gather_shifts(dst[:3], shift)
    assert dst.tolist() == [3, 1, 2, 77, 77]
    # negative control: the same shifts at other rows give other values
    gather_shifts(dst, [shift[0], None, shift[2]])
    assert dst.tolist() != [2, 0, 3, 0, 0]
