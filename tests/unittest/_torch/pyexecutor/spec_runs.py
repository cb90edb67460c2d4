"""Runs of the tiny target with and without a DSpark drafter (test fixture for the overlap and
one-graph step tests)."""
from __future__ import annotations

import random


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def dspark_spec(path) -> dict:
    return {"decoding_type": "DSpark", "speculative_model": path}


def generate_run(make_llm, target, prompts, params, overlap: bool, drafter=None, **kw):
    llm = make_llm(target, disable_overlap_scheduler=not overlap,
                   speculative_config=dspark_spec(drafter) if drafter else None, **kw)
    outs = llm.generate(prompts, params)
    stats = llm.get_stats()
    assert stats["kv_cache"]["free_pages"] == llm._bundle.kv.num_pages, "pages leaked"
    return [o.outputs[0].token_ids for o in outs], stats, llm._executor
