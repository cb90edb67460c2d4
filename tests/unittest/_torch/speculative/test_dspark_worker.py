"""`DSparkWorker`'s device draft backend under AUTO (CPU side): where the CUTEDSL support predicate fails,
AUTO falls back to TRITON and says why; without a device-length backend the device draft step stays off.
The GPU side (AUTO picks CUTEDSL on the H200 with the CuTe DSL present, lossless) is
`test_draft_graph.py::test_auto_drafter_takes_the_graph_backend_and_arrivals_stay_lossless`."""
from __future__ import annotations

import pytest

from tensorrt_llm._torch.attention_backend.cute_dsl_backend import CuteDslAttention
from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention

from tests.unittest._torch.speculative.test_page_bound import _setup


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_auto_graph_backend_falls_back_to_triton_with_the_reason(tiny_llama_dir, kind):
    worker, _, _ = _setup(tiny_llama_dir, kind)
    assert worker.cfg.attention_backend == "AUTO"
    backend, note = worker._auto_graph_backend()
    assert type(backend) is TritonAttention and not isinstance(backend, CuteDslAttention)
    assert note == "TRITON (CUTEDSL: CUTEDSL does not run on cpu)", note


def test_auto_with_graphs_on_the_cpu_leaves_the_device_draft_step_off_and_names_why(tiny_llama_dir):
    worker, _, _ = _setup(tiny_llama_dir, "gqa")
    worker.enable_device_drafts(4, cuda_graphs=True)
    assert worker.graph_runner is None and worker.graph_backend == "TRITON does not run on cpu"
    assert worker.resolution.name == "VANILLA"           # the worker keeps the backend it was built with
