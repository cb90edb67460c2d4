"""Fixtures: the tiny model served by `trtllm-serve` in a subprocess, and the same engine offline."""
from __future__ import annotations

from typing import Iterator

import pytest
from server_proc import TINY_ARGS, Server, start_server, stop_server


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory) -> Iterator[Server]:
    server = start_server(tiny_llama_dir, TINY_ARGS, tmp_path_factory.mktemp("serve_tiny"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def tiny_offline(tiny_llama_dir):
    """The same engine in-process: the offline reference of the server's outputs."""
    from tensorrt_llm import LLM

    llm = LLM(str(tiny_llama_dir), **TINY_ARGS)
    yield llm
    llm.shutdown()
