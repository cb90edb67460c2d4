"""`LLM` keeps its startup heap out of the collector's full passes (gc.freeze) and gives it back at shutdown."""
from __future__ import annotations

import gc
import weakref

from tensorrt_llm import LLM


def _build(folder) -> LLM:
    return LLM(str(folder), device="cpu", kv_cache_config={"max_tokens": 2048, "tokens_per_block": 16})


def test_a_started_llm_freezes_its_heap_and_shutdown_gives_it_back(tiny_llama_dir):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = _build(tiny_llama_dir)
    try:
        # the engine's objects (weights, modules, the executor) left the oldest generation's passes
        assert gc.get_freeze_count() > 10_000
        model = weakref.ref(llm._executor.engine.model)
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model() is None, "a shut-down engine must be collectable (it is kept only by its own cycles)"


def test_control_a_heap_frozen_after_shutdown_keeps_the_stopped_engine(tiny_llama_dir):
    # why shutdown unfreezes: the engine's objects are in cycles, which only a collection frees
    llm = _build(tiny_llama_dir)
    model = weakref.ref(llm._executor.engine.model)
    llm.shutdown()
    gc.freeze()
    del llm
    gc.collect()
    try:
        assert model() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert model() is None
