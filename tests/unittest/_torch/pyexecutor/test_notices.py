"""Notices (`pyexecutor/notices.py`): streaming requests get every notice, others only the final one;
inside `held()` notices wait for the end of the block (also on an error), in order."""
from __future__ import annotations

import pytest

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.notices import Notices
from tensorrt_llm._torch.runtime.llm_request import LlmRequest


def _setup(streaming: bool):
    notices, got = Notices(), []
    req = LlmRequest(1, [5, 6], SamplingParams(max_tokens=4), streaming=streaming)
    notices.register(1, lambda r, toks: got.append((list(toks), r.is_finished)))
    return notices, req, got


def test_held_notices_wait_for_the_block_and_keep_their_order():
    notices, req, got = _setup(streaming=True)
    with notices.held():
        notices.notify(req, [7])
        with notices.held():                     # nested: adds to the outer block
            notices.notify(req, [8])
        assert got == []
    assert got == [([7], False), ([8], False)]
    notices.notify(req, [9])                     # outside a block: at once (control)
    assert got[-1] == ([9], False)


def test_only_the_final_notice_reaches_a_non_streaming_caller_and_an_error_still_flushes():
    notices, req, got = _setup(streaming=False)
    with pytest.raises(RuntimeError):
        with notices.held():
            notices.notify(req, [7])
            req.finish("error")
            notices.notify(req, [])
            raise RuntimeError("step failed")
    assert got == [([], True)]
    notices.deliver(req, [])                     # the callback went with the final notice
    assert got == [([], True)]
