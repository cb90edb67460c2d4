"""Scheduler: reserve-whole-life admission (never beyond capacity), FCFS, token budget,
chunked prefill; and a tiny KV pool end to end where requests queue and still finish right."""
from __future__ import annotations

import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.scheduler import Scheduler

P = 16


def setup(num_pages=6, max_batch_size=8, max_num_tokens=32, chunked=True):
    spec = KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)
    kv = KVCacheManager([spec], num_pages, P, 256, torch.device("cpu"))
    return kv, Scheduler(kv, max_batch_size, max_num_tokens, chunked, tokens_per_gen_step=1, spec_slack=1)


def req(rid, prompt_len, max_tokens=20):
    return LlmRequest(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def test_admits_only_what_can_finish_and_keeps_fcfs():
    kv, s = setup(num_pages=6)
    for i in range(4):
        s.add(req(i, 20))                             # 20 + 20 + 1 = 41 tokens -> 3 pages each
    s.schedule()
    assert [r.request_id for r in s.running] == [0, 1] and len(s.waiting) == 2
    assert kv.available_pages() == 0
    s.add(req(9, 1, max_tokens=1))                    # would fit nowhere anyway; stays queued
    s.running[0].finish("length")
    s.remove_finished()
    s.schedule()
    assert [r.request_id for r in s.running] == [1, 2] and [r.request_id for r in s.waiting] == [3, 9]


def test_no_overtaking_by_small_requests():
    kv, s = setup(num_pages=6)
    s.add(req(0, 20))
    s.add(req(1, 60, max_tokens=40))                  # needs 7 pages: blocks the queue head
    s.add(req(2, 2, max_tokens=2))                    # would fit, but must not overtake
    s.schedule()
    assert [r.request_id for r in s.running] == [0] and [r.request_id for r in s.waiting] == [1, 2]


def test_max_batch_size():
    kv, s = setup(num_pages=64, max_batch_size=2)
    for i in range(3):
        s.add(req(i, 4, max_tokens=4))
    s.schedule()
    assert len(s.running) == 2


def test_token_budget_chunked_prefill_and_generation_first():
    kv, s = setup(num_pages=64, max_num_tokens=32)
    a, b = req(0, 20), req(1, 50)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.context_requests == [a, b] and batch.context_chunks == [20, 12]
    a.num_computed, a.state = 20, RequestState.GENERATION
    a.output_token_ids.append(5)
    b.num_computed = 12
    batch = s.schedule()
    assert batch.generation_requests == [a]
    assert batch.context_requests == [b] and batch.context_chunks == [31]   # 32 - 1 decode token


def test_unchunked_prefill_waits_for_a_whole_prompt():
    kv, s = setup(num_pages=64, max_num_tokens=32, chunked=False)
    a, b = req(0, 20), req(1, 30)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.context_requests == [a] and batch.context_chunks == [20]


def test_tiny_pool_requests_queue_and_all_finish_correctly(tiny_llama_dir, make_llm):
    prompts = [list(range(30 + 7 * i, 30 + 7 * i + 12 + 3 * i)) for i in range(6)]   # 12..27 tokens
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref_llm = make_llm(tiny_llama_dir)
    ref = [ref_llm.generate(p, params).outputs[0].token_ids for p in prompts]         # one at a time

    llm = make_llm(tiny_llama_dir, max_num_tokens=32, kv_cache_config={"max_tokens": 96, "tokens_per_block": P})
    ex, kv = llm._executor, llm._bundle.kv
    ex.shutdown()
    handles = [llm.generate_async(p, params) for p in prompts]
    ex._drain_incoming()
    max_running = max_waiting = 0
    while ex.scheduler.has_work:
        ex.step()
        running = ex.scheduler.running
        reserved = sum(kv.seqs[r.request_id].reserved_pages for r in running)
        assert reserved <= kv.num_pages and kv.num_pages - kv.pool.num_free <= reserved
        max_running = max(max_running, len(running))
        max_waiting = max(max_waiting, len(ex.scheduler.waiting))
    assert max_running >= 2 and max_waiting >= 2       # 6 pages, 2-3 per request: the rest queued
    for h, r in zip(handles, ref):
        out = h.result(timeout=0)
        assert out.outputs[0].token_ids == r and out.outputs[0].finish_reason == "length"
    assert kv.pool.num_free == kv.num_pages and kv.seqs == {}


def _ref_schedule(running, max_num_tokens, tokens_per_gen, chunked):
    """The straightforward two-pass micro-batch (slow reference of Scheduler.schedule)."""
    gens, ctx, chunks, budget = [], [], [], max_num_tokens
    for r in running:
        if r.state == RequestState.GENERATION and budget >= tokens_per_gen:
            gens.append(r.request_id)
            budget -= tokens_per_gen
    for r in running:
        if r.state != RequestState.CONTEXT or budget <= 0:
            continue
        n = r.remaining_prompt()
        if n > budget:
            if not chunked and ctx:
                continue
            n = budget if chunked else n
        ctx.append(r.request_id)
        chunks.append(n)
        budget -= n
    return gens, ctx, chunks


def test_schedule_matches_reference_on_random_running_sets():
    import random
    rng = random.Random(0)
    states = [RequestState.GENERATION, RequestState.CONTEXT, RequestState.FINISHED]
    for trial in range(300):
        tpg = rng.choice([1, 1, 3, 5])
        kv, s = setup(num_pages=64, max_num_tokens=rng.randrange(1, 40), chunked=trial % 2 == 0)
        s.tokens_per_gen_step = tpg
        for rid in range(rng.randrange(0, 12)):
            r = req(rid, rng.randrange(1, 30))
            r.state = rng.choice(states) if trial % 4 else RequestState.GENERATION
            r.num_computed = rng.randrange(0, r.prompt_len)
            s.running.append(r)
        batch = s.schedule()
        got = ([r.request_id for r in batch.generation_requests], [r.request_id for r in batch.context_requests],
               batch.context_chunks)
        assert got == _ref_schedule(s.running, s.max_num_tokens, tpg, s.chunked)
