"""append_tokens: the first stop id ends the request (not appended), max_tokens ends it, a stop string
in the decoded tail ends it; only the tokens before the stop are returned."""
from __future__ import annotations

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.stop_criteria import append_tokens
from tensorrt_llm._torch.runtime.llm_request import LlmRequest


def _decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _req(**params) -> LlmRequest:
    return LlmRequest(1, [5, 6], SamplingParams(**params))


def test_stop_id_max_tokens_and_stop_string():
    req = _req(max_tokens=10, stop_token_ids=[7], ignore_eos=True)
    assert append_tokens(req, [1, 2, 7, 3], _decode) == [1, 2] and req.finish_reason == "stop"
    assert req.output_token_ids == [1, 2]
    req = _req(max_tokens=3, ignore_eos=True)
    assert append_tokens(req, [1, 2, 3, 4], _decode) == [1, 2, 3] and req.finish_reason == "length"
    req = _req(max_tokens=10, stop="cd", ignore_eos=True)         # ids 2, 3 decode to "cd"
    assert append_tokens(req, [0, 2, 3, 4], _decode) == [0, 2, 3] and req.finish_reason == "stop"
    req = _req(max_tokens=10, stop="zz", ignore_eos=True)         # control: no stop, nothing finishes
    assert append_tokens(req, [0, 2, 3, 4], _decode) == [0, 2, 3, 4] and not req.is_finished


def test_runs_that_cannot_finish_and_the_boundaries():
    """Tokens that neither reach max_tokens nor hold a stop id are all appended (returned as a new
    list); the run that reaches max_tokens exactly finishes by length; a stop id anywhere in a run
    with room left still stops it there."""
    req = _req(max_tokens=4, ignore_eos=True)
    toks = [1, 2]
    got = append_tokens(req, toks, _decode)
    assert got == [1, 2] and got is not toks and not req.is_finished
    assert append_tokens(req, [3, 4], _decode) == [3, 4] and req.finish_reason == "length"
    assert req.output_token_ids == [1, 2, 3, 4]
    req = _req(max_tokens=100, stop_token_ids=[9], ignore_eos=True)
    assert append_tokens(req, [1, 2, 3], _decode) == [1, 2, 3] and not req.is_finished
    assert append_tokens(req, [4, 9, 5], _decode) == [4] and req.finish_reason == "stop"
    assert req.output_token_ids == [1, 2, 3, 4]
