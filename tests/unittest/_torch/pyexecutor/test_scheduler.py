"""Scheduler: reserve-whole-life admission (never beyond capacity), FCFS, token budget,
chunked prefill; and a tiny KV pool end to end where requests queue and still finish right."""
from __future__ import annotations

import pytest
import torch
import yaml
from pydantic import ValidationError

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.runtime.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.scheduler import Scheduler
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

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


# ---- batch waiting (batch_wait_timeout_iters / batch_wait_max_tokens_ratio) ----------------
def wait_setup(timeout=0, ratio=0.0, num_pages=64, max_batch_size=8, max_num_tokens=32, chunked=True):
    spec = KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)
    kv = KVCacheManager([spec], num_pages, P, 256, torch.device("cpu"))
    return kv, Scheduler(kv, max_batch_size, max_num_tokens, chunked, tokens_per_gen_step=1, spec_slack=1,
                         batch_wait_timeout_iters=timeout, batch_wait_max_tokens_ratio=ratio)


def simulate(s, arrivals: dict[int, list[LlmRequest]], max_steps=200):
    """Drive `s` like the executor: arrivals join before step t's schedule(); a chunk advances
    num_computed, the last chunk and each decode emit a token; returns the per-step trace
    [(((rid, chunk), ...), (gen rid, ...))], the number of calls that held an arrival and the
    step at which each request was admitted."""
    trace, held, admitted = [], 0, {}
    for t in range(max_steps):
        for r in arrivals.get(t, []):
            s.add(r)
        if not s.has_work and t > max(arrivals, default=0):
            break
        batch = s.schedule()
        held += s.held_iters > 0
        for r in s.running:
            admitted.setdefault(r.request_id, t)
        trace.append((tuple((r.request_id, n) for r, n in zip(batch.context_requests, batch.context_chunks)),
                      tuple(r.request_id for r in batch.generation_requests)))
        for r, n in zip(batch.context_requests, batch.context_chunks):
            r.num_computed += n
            if r.num_computed >= r.prompt_len:
                r.state = RequestState.GENERATION
                r.output_token_ids.append(7)
        for r in batch.generation_requests:
            r.num_computed += 1
            r.output_token_ids.append(7)
        for r in batch.context_requests + batch.generation_requests:
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                r.finish("length")
        s.remove_finished()
    return trace, held, admitted


def first_step(trace) -> dict[int, int]:
    """Step at which each request first gets a prefill chunk."""
    out: dict[int, int] = {}
    for t, (ctx, _) in enumerate(trace):
        for rid, _ in ctx:
            out.setdefault(rid, t)
    return out


def prefill_steps(trace) -> int:
    return sum(1 for ctx, _ in trace if ctx)


def test_arrivals_held_exactly_n_iterations_while_others_generate():
    arrivals = lambda: {0: [req(0, 8, max_tokens=30)], 2: [req(1, 5)], 4: [req(2, 6)], 9: [req(3, 4)]}
    _, s = wait_setup(timeout=4)
    trace, held, _ = simulate(s, arrivals())
    # 1 arrives at step 2 while 0 generates: held in steps 2, 3, 4, 5, scheduled in step 6
    # together with 2 (arrived at 4); 3 arrives at 9: held 9..12, scheduled at 13
    assert first_step(trace) == {0: 0, 1: 6, 2: 6, 3: 13}
    assert held == 8 and prefill_steps(trace) == 3
    for t in (2, 3, 4, 5, 9, 10, 11, 12):
        assert trace[t][0] == () and trace[t][1], f"step {t} should be a pure generation step"
    # negative control: knobs off, every arrival prefills in its own (split) step
    _, s = wait_setup()
    trace, held, _ = simulate(s, arrivals())
    assert first_step(trace) == {0: 0, 1: 2, 2: 4, 3: 9} and held == 0 and prefill_steps(trace) == 4


def test_held_arrivals_released_early_by_the_token_ratio():
    def run(second_prompt_len: int) -> dict[int, int]:
        _, s = wait_setup(timeout=6, ratio=0.5, max_num_tokens=32)     # threshold: 16 prompt tokens
        return first_step(simulate(s, {0: [req(0, 4, max_tokens=30)], 2: [req(1, 6)],
                                       3: [req(2, second_prompt_len)]})[0])
    assert run(10) == {0: 0, 1: 3, 2: 3}          # 6 + 10 = 16 held tokens: released at once
    assert run(9) == {0: 0, 1: 8, 2: 8}           # 15 < 16: the full 6-iteration wait


def test_no_wait_when_nothing_is_generating():
    _, s = wait_setup(timeout=50, max_num_tokens=8)
    # an idle engine starts at once; 2 arrives while 0 and 1 are still prefilling (no generation)
    trace, held, admitted = simulate(s, {0: [req(0, 20), req(1, 12)], 1: [req(2, 5)]})
    assert held == 0 and s.kv.seqs == {}
    assert admitted == {0: 0, 1: 0, 2: 1}         # admitted on arrival, nothing generating yet
    assert trace[0] == (((0, 8),), ()) and trace[1] == (((0, 8),), ())


def test_started_chunked_prefill_is_never_held():
    _, s = wait_setup(timeout=50, max_num_tokens=8)
    a, b = req(0, 3, max_tokens=40), req(1, 45)   # b's prompt needs 6-7 chunks
    trace, _, _ = simulate(s, {0: [a, b], 3: [req(2, 4)]})
    b_steps = [t for t, (ctx, _) in enumerate(trace) if any(rid == 1 for rid, _ in ctx)]
    assert trace[1][1] == (0,)                    # a generates from step 1 on
    assert b_steps == list(range(b_steps[0], b_steps[-1] + 1)) and len(b_steps) >= 6
    # an arrival while a prompt is in flight rides along (that step has a prefill anyway)
    assert first_step(trace)[2] <= b_steps[-1] + 1


def test_released_request_blocked_on_kv_is_admitted_without_a_second_wait():
    # 6 pages: 0 (4 pages, generates long) + 1 (2 pages, finishes after step 9) fill the pool
    _, s = wait_setup(timeout=3, num_pages=6, max_num_tokens=48)
    trace, _, admitted = simulate(s, {0: [req(0, 20, max_tokens=40), req(1, 20, max_tokens=10)],
                                      1: [req(2, 20, max_tokens=10)], 8: [req(3, 4, max_tokens=4)]})
    # 2's wait ends at step 4 but it has no pages until 1 is freed after step 9; 3 is then in its
    # own wait (arrived at 8), which must not hold 2 back (FCFS: 2 is ahead of it)
    assert admitted[2] == 10 and first_step(trace)[2] == 10
    assert admitted[3] > 10


def _today_reference(s, arrivals, max_steps=200):
    """Today's admission (FCFS reserve-or-wait, no batch waiting) + `_ref_schedule`."""
    trace = []
    for t in range(max_steps):
        for r in arrivals.get(t, []):
            s.waiting.append(r)
        if not s.waiting and not s.running and t > max(arrivals, default=0):
            break
        while s.waiting and len(s.running) < s.max_batch_size:
            r = s.waiting[0]
            reserve = r.reserve_tokens(s.spec_slack)
            if not s.kv.can_admit(r.prompt_token_ids, reserve):
                break
            s.waiting.popleft()
            r.num_computed = r.num_cached_prompt = s.kv.add_sequence(r.request_id, r.prompt_token_ids, reserve)
            r.state = RequestState.CONTEXT
            s.running.append(r)
        gens, ctx, chunks = _ref_schedule(s.running, s.max_num_tokens, 1, s.chunked)
        by_id = {r.request_id: r for r in s.running}
        trace.append((tuple(zip(ctx, chunks)), tuple(gens)))
        for rid, n in zip(ctx, chunks):
            r = by_id[rid]
            r.num_computed += n
            if r.num_computed >= r.prompt_len:
                r.state = RequestState.GENERATION
                r.output_token_ids.append(7)
        for rid in gens:
            by_id[rid].num_computed += 1
            by_id[rid].output_token_ids.append(7)
        for rid in gens + ctx:
            if len(by_id[rid].output_token_ids) >= by_id[rid].sampling_params.max_tokens:
                by_id[rid].finish("length")
        s.remove_finished()
    return trace


def _random_workload(rng, n):
    arrivals: dict[int, list[LlmRequest]] = {}
    for rid in range(n):
        arrivals.setdefault(rng.randrange(0, 30), []).append(req(rid, rng.randrange(1, 40), rng.randrange(1, 12)))
    return arrivals


def test_knobs_off_schedule_is_todays_and_knobs_on_never_starves():
    import copy
    import random
    rng = random.Random(1)
    differs = 0
    for trial in range(60):
        arrivals = _random_workload(rng, rng.randrange(1, 14))
        pages, mbs, mnt, chunked = rng.choice([8, 16, 64]), rng.randrange(1, 6), rng.randrange(8, 48), trial % 2 == 0
        _, s = wait_setup(num_pages=pages, max_batch_size=mbs, max_num_tokens=mnt, chunked=chunked)
        off, _, _ = simulate(s, copy.deepcopy(arrivals))
        _, ref_s = wait_setup(num_pages=pages, max_batch_size=mbs, max_num_tokens=mnt, chunked=chunked)
        assert off == _today_reference(ref_s, copy.deepcopy(arrivals)), f"trial {trial}"
        n = rng.randrange(1, 6)
        _, s = wait_setup(timeout=n, ratio=rng.choice([0.0, 0.5, 1.0]), num_pages=pages, max_batch_size=mbs,
                          max_num_tokens=mnt, chunked=chunked)
        on_arrivals = copy.deepcopy(arrivals)
        reqs = [r for group in on_arrivals.values() for r in group]
        on, _, admitted = simulate(s, on_arrivals)
        assert all(r.is_finished for r in reqs) and s.kv.seqs == {}, f"trial {trial}: starved"
        if pages == 64 and mbs >= len(reqs):     # ample capacity: the only delay is the wait itself
            for t, group in arrivals.items():
                for r in group:
                    assert admitted[r.request_id] - t <= n, f"trial {trial}: request {r.request_id} held too long"
        differs += on != off
    assert differs > 10                            # negative control: the knobs do change schedules


# ---- slot grouping (batch_admit_min_slots) ----------------------------------------------------
def test_slot_grouping_admits_queued_requests_together():
    """A queue larger than the batch, requests finishing one by one (staggered lengths): with k = 4
    queued requests start in groups of >= 4 (fewer prefill steps), every request still finishes
    with the same tokens; k = 1 (the control) admits one per finished request."""
    import random

    def run(k: int):
        kv = KVCacheManager([KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)], 256, P, 256,
                            torch.device("cpu"))
        s = Scheduler(kv, 8, 64, True, tokens_per_gen_step=1, spec_slack=1, batch_admit_min_slots=k)
        rng = random.Random(3)
        reqs = [req(i, rng.randrange(2, 12), max_tokens=rng.randrange(4, 30)) for i in range(40)]
        trace, _, admitted = simulate(s, {0: reqs}, max_steps=2000)
        assert all(r.is_finished for r in reqs) and s.kv.seqs == {} and not s.waiting
        groups = {}
        for rid, t in admitted.items():
            groups.setdefault(t, []).append(rid)
        return trace, groups, len(trace)

    trace1, groups1, steps1 = run(1)
    trace4, groups4, steps4 = run(4)
    later = [len(g) for t, g in groups4.items() if t > 0]
    assert sorted(groups4[0]) == list(range(8))                   # an idle engine fills the batch at once
    assert later and min(later[:-1]) >= 4                         # groups of >= 4 (the last: what is left)
    assert prefill_steps(trace4) * 2 < prefill_steps(trace1)      # control: one prefill per finish
    assert sum(1 for t, g in groups1.items() if t > 0 and len(g) == 1) > 10
    assert steps4 < 1.3 * steps1                                  # the lower occupancy costs few steps


def test_slot_grouping_never_waits_without_generation_and_caps_at_the_queue():
    _, s = wait_setup(max_batch_size=8)
    s.batch_admit_min_slots = 6
    _, _, admitted = simulate(s, {0: [req(0, 4, max_tokens=40)], 3: [req(1, 5, max_tokens=3)]})
    assert admitted == {0: 0, 1: 3}          # one queued request needs only one free slot
    with pytest.raises(ValueError, match="batch_admit_min_slots"):
        Scheduler(s.kv, 8, 32, True, tokens_per_gen_step=1, spec_slack=1, batch_admit_min_slots=0)
    with pytest.raises(ValidationError):
        TorchLlmArgs(model="m", batch_admit_min_slots=0)


@pytest.mark.parametrize("kwargs", [
    {"batch_wait_timeout_iters": -1},
    {"batch_wait_timeout_iters": 2, "batch_wait_max_tokens_ratio": 1.5},
    {"batch_wait_timeout_iters": 2, "batch_wait_max_tokens_ratio": -0.1},
    {"batch_wait_max_tokens_ratio": 0.5},          # a ratio without a timeout would never end a wait
])
def test_batch_wait_validation(kwargs):
    with pytest.raises(ValidationError):
        TorchLlmArgs(model="m", **kwargs)
    with pytest.raises(ValueError, match="batch_wait"):
        wait_setup(timeout=kwargs.get("batch_wait_timeout_iters", 0), ratio=kwargs.get("batch_wait_max_tokens_ratio", 0))
    ok = TorchLlmArgs(model="m", batch_wait_timeout_iters=4, batch_wait_max_tokens_ratio=1.0)
    assert (ok.batch_wait_timeout_iters, ok.batch_wait_max_tokens_ratio) == (4, 1.0)


# ---- batch waiting in the engine ---------------------------------------------------------
WAIT_PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
WAIT_PROMPT_LENS = (12, 20, 9, 17, 26, 5, 33, 14)     # 2 at step 0, then one every 2 steps


@pytest.fixture(scope="module")
def wait_drafter(tmp_path_factory, tiny_llama_dir):
    from tensorrt_llm._torch.models.checkpoint import read_config
    from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "target")
    out = tmp_path_factory.mktemp("wait_drafter")
    DSparkForCausalLMBase.random_init("gqa", tc, seed=3, markov_rank=4).save_pretrained(out)
    return out


def _staggered_run(llm) -> tuple[list[list[int]], int, int]:
    """Arrivals between steps (2 at step 0, one every 2 steps after); returns the greedy tokens,
    the number of steps with a prefill segment and the number of steps."""
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in WAIT_PROMPT_LENS]
    ex = llm._executor
    ex.shutdown()                                   # drive the loop by hand
    prefill_steps = [0]
    orig = ex.scheduler.schedule

    def schedule():
        batch = orig()
        prefill_steps[0] += bool(batch.context_requests)
        return batch

    ex.scheduler.schedule = schedule
    handles = [llm.generate_async(p, WAIT_PARAMS) for p in prompts[:2]]
    for p in prompts[2:]:
        ex._drain_incoming()
        ex.step()
        ex.step()
        handles.append(llm.generate_async(p, WAIT_PARAMS))
    ex.run_until_idle()
    return [h.result(timeout=0).outputs[0].token_ids for h in handles], prefill_steps[0], ex.iterations


@pytest.mark.parametrize("drafter", [False, True])
def test_batch_wait_in_engine_same_tokens_fewer_prefill_steps(tiny_llama_dir, make_llm, wait_drafter, tmp_path,
                                                              drafter):
    spec = {"speculative_config": {"decoding_type": "DSpark", "speculative_model": str(wait_drafter)}} \
        if drafter else {}
    common = dict(max_num_tokens=128, max_batch_size=8, **spec)
    off_tokens, off_prefill, _ = _staggered_run(make_llm(tiny_llama_dir, **common))
    # the knobs through the YAML path (`LLM(args.yaml)`, as `--extra-llm-api-options` reads them)
    y = tmp_path / "args.yaml"
    y.write_text(yaml.safe_dump({"model": str(tiny_llama_dir), "device": "cpu", "batch_wait_timeout_iters": 4,
                                 "kv_cache_config": {"max_tokens": 4096, "tokens_per_block": 16}, **common}))
    llm = make_llm(y)
    assert llm._executor.scheduler.batch_wait_timeout_iters == 4
    assert make_llm(tiny_llama_dir, batch_admit_min_slots=3, **common)._executor.scheduler.batch_admit_min_slots == 3
    on_tokens, on_prefill, _ = _staggered_run(llm)
    assert on_tokens == off_tokens and all(len(t) == 24 for t in on_tokens)
    if not drafter:
        # off: step 0 + one split step per arrival; on: step 0, then arrivals 2-4 at step 6 and
        # 5-7 at step 12 (each group waits 4 iterations from its first arrival)
        assert (off_prefill, on_prefill) == (7, 3)
    else:
        assert off_prefill == 7 and on_prefill <= 4, (off_prefill, on_prefill)


def test_slot_grouping_in_engine_same_tokens_fewer_prefill_steps(tiny_llama_dir, make_llm):
    """An offline batch 3x max_batch_size with staggered lengths: slot grouping gives the same greedy
    tokens in fewer prefill steps."""
    import random
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randrange(3, 20), ignore_eos=True) for _ in prompts]

    def run(k: int):
        llm = make_llm(tiny_llama_dir, max_batch_size=4, batch_admit_min_slots=k)
        sched = llm._executor.scheduler
        orig, count = sched.schedule, [0]

        def schedule():
            batch = orig()
            count[0] += bool(batch.context_requests)
            return batch
        sched.schedule = schedule
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], count[0]

    tokens1, prefill1 = run(1)
    tokens3, prefill3 = run(3)
    assert tokens3 == tokens1 and [len(t) for t in tokens1] == [p.max_tokens for p in params]
    assert prefill3 < prefill1, (prefill3, prefill1)
