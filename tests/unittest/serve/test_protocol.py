"""Request validation (no server): unknown fields, unsupported OpenAI parameters, field-naming errors."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tensorrt_llm.serve.errors import from_validation_error
from tensorrt_llm.serve.protocol import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def error_of(model, body: dict):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return from_validation_error(e.value)


@pytest.mark.parametrize("field,value", [("n", 2), ("best_of", 3), ("echo", True), ("logprobs", 1),
                                         ("suffix", "x"), ("frequency_penalty", 0.1), ("logit_bias", {"5": 1})])
def test_unsupported_completion_parameter_is_named(field, value):
    e = error_of(CompletionRequest, {"model": "m", "prompt": "hi", field: value})
    assert e.param == field and "unsupported" in e.message and e.status == 400


@pytest.mark.parametrize("field,value", [("n", 1), ("best_of", 1), ("echo", False), ("frequency_penalty", 0),
                                         ("presence_penalty", 0.0), ("logit_bias", {})])
def test_neutral_values_of_unsupported_parameters_are_accepted(field, value):
    assert getattr(CompletionRequest.model_validate({"model": "m", "prompt": "hi", field: value}), field) == value


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function"}]), ("logprobs", True), ("top_logprobs", 2),
                                         ("store", True), ("tool_choice", "auto"), ("n", 3)])
def test_unsupported_chat_parameter_is_named(field, value):
    e = error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, field: value})
    assert e.param == field and "unsupported" in e.message


def test_several_unsupported_and_unknown_fields_are_all_listed():
    e = error_of(CompletionRequest, {"model": "m", "prompt": "hi", "n": 2, "echo": True})
    assert e.param == "n" and "n, echo" in e.message
    e = error_of(CompletionRequest, {"model": "m", "prompt": "hi", "foo": 1, "bar": 2})
    assert e.param == "foo" and "foo, bar" in e.message and "unknown" in e.message


def test_type_and_range_errors_name_the_nested_field():
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]}
                    ).param == "messages[0].content"
    assert error_of(CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": True}).param == "max_tokens"
    assert error_of(CompletionRequest, {"model": "m", "prompt": "hi", "seed": 2 ** 64}).param == "seed"
    assert error_of(CompletionRequest, {"model": "m", "prompt": "hi", "stop": ["a"] * 5}).param == "stop"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": MSG, "max_tokens": 4,
                                            "max_completion_tokens": 4}).param == "max_completion_tokens"


def test_valid_requests_keep_their_values():
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "top_k": 5, "stream": True, "stream_options": {"include_usage": True}})
    assert r.template_messages() == [{"role": "user", "content": "ab"}]
    assert r.output_limit == 7 and r.top_k == 5 and r.include_usage_chunk
    c = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert c.prompt == [1, 2, 3] and c.temperature == 1.0 and c.max_tokens is None
