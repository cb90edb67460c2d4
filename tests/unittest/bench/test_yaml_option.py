"""yaml_mapping: an inline YAML mapping option; empty is {}, anything else is refused naming the flag."""
from __future__ import annotations

import pytest

from tensorrt_llm.bench.yaml_option import yaml_mapping


def test_mapping_empty_and_refusals():
    assert yaml_mapping("{a: 1, b: {c: true}}", "--x") == {"a": 1, "b": {"c": True}}
    assert yaml_mapping(None, "--x") == {} == yaml_mapping("", "--x") == yaml_mapping("null", "--x")
    with pytest.raises(ValueError, match=r"--x '\[1, 2\]' is not a YAML mapping"):
        yaml_mapping("[1, 2]", "--x")
    with pytest.raises(ValueError, match=r"--x '\{a: \[' is not valid YAML"):
        yaml_mapping("{a: [", "--x")
