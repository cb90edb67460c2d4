"""`LLM` keeps its startup heap out of the collector's full passes (gc.freeze) and gives it back at shutdown."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from tensorrt_llm import LLM

# run in a fresh interpreter: whether a dead engine is collected must not depend on what earlier tests left
_COLLECTABLE = textwrap.dedent("""
    import gc, sys, weakref
    from tensorrt_llm import LLM

    def build():
        return LLM(sys.argv[1], device="cpu", kv_cache_config={"max_tokens": 2048, "tokens_per_block": 16})

    def collect():
        for _ in range(4):
            if not gc.collect():
                return

    llm = build()
    model = weakref.ref(llm._executor.engine.model)
    llm.shutdown()
    del llm
    collect()
    print("unfrozen", model() is not None)
    llm = build()                 # control: frozen again after shutdown, the stopped engine stays
    model = weakref.ref(llm._executor.engine.model)
    llm.shutdown()
    gc.freeze()
    del llm
    collect()
    print("frozen", model() is not None)
    gc.unfreeze()
    collect()
    print("unfrozen_again", model() is not None)
""")


def test_a_started_llm_freezes_its_heap_and_shutdown_gives_it_back(tiny_llama_dir):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 2048, "tokens_per_block": 16})
    try:
        # the engine's objects (weights, modules, the executor) left the oldest generation's passes
        assert gc.get_freeze_count() > 10_000
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_shut_down_engine_is_collected_and_would_not_be_if_frozen(tiny_llama_dir):
    # the engine's objects are in cycles, which only a collection frees: why shutdown unfreezes
    out = subprocess.run([sys.executable, "-c", _COLLECTABLE, str(tiny_llama_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    alive = dict(line.split() for line in out.stdout.splitlines() if line.split()[0].startswith(("unfrozen", "frozen")))
    assert alive == {"unfrozen": "False", "frozen": "True", "unfrozen_again": "False"}
