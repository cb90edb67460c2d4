"""Step types (`runtime/step.py`): `DraftsAhead.join` puts two launches' rows in one (a step's verify
segments, from the one-graph step or the draft graph, and its arrivals) and refuses rows it cannot place."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.runtime.step import DraftsAhead
from tensorrt_llm._torch.runtime.token_rows import PendingTokens


def _ahead(rows: dict[int, int], values: list[list[int]], first: int = 0) -> DraftsAhead:
    return DraftsAhead(rows, PendingTokens(torch.tensor(values)), first)


def test_join_keeps_every_request_row_and_its_drafts():
    verify = _ahead({7: 0, 3: 1}, [[2, 11, 12, 13], [1, 21, 22, 23]])
    arrivals = _ahead({5: 0}, [[1, 31, 32, 33]])
    both = verify.join(arrivals)
    assert both.rows == {7: 0, 3: 1, 5: 2}
    assert [list(both.drafts(r)) for r in (7, 3, 5)] == [[12, 13], [22, 23], [32, 33]]
    seg = both.continued_segment(5, 40, 2)            # the arrival continues from its joined row
    assert list(seg.token_ids) == [31, 32, 33] and list(seg.start_shift) == [1] and seg.start == 40
    # control: the arrival's row read at its index in its own launch is the first verify row's
    assert list(both.drafts(7)) != list(both.drafts(5))
    # a one-graph launch's rows lead with its verify rows (first = 3): joined from the committed column on
    one_graph = _ahead({9: 0}, [[40, 41, -1, 2, 41, 42, 43]], first=3)
    joined = one_graph.join(arrivals)
    assert joined.first == 0 and joined.rows == {9: 0, 5: 1}
    assert [list(joined.drafts(r)) for r in (9, 5)] == [[42, 43], [32, 33]]
    assert list(joined.continued_segment(9, 10, 2).start_shift) == [2]


def test_join_refuses_other_layouts_and_a_request_twice():
    verify = _ahead({7: 0}, [[2, 11, 12, 13]])
    with pytest.raises(ValueError, match="different layouts"):
        verify.join(_ahead({5: 0}, [[1, 31, 32]]))
    with pytest.raises(ValueError, match="different layouts: 4 / 3 columns"):
        verify.join(_ahead({5: 0}, [[1, 31, 32, 33]], first=1))
    with pytest.raises(ValueError, match=r"requests \[7\] were drafted ahead twice"):
        verify.join(_ahead({7: 0}, [[1, 31, 32, 33]]))
