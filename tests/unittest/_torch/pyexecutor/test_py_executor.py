"""PyExecutor loop: batch invariance under continuous batching and chunked prefill, and
per-request failure isolation."""
from __future__ import annotations

import random

import pytest

from tensorrt_llm import SamplingParams

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (3, 41, 17, 26, 9, 50, 33, 5)]


@pytest.fixture
def solo(tiny_llama_dir, make_llm, prompts) -> list[list[int]]:
    """Each prompt alone, whole-prompt prefill (default token budget)."""
    llm = make_llm(tiny_llama_dir)
    return [llm.generate(p, PARAMS).outputs[0].token_ids for p in prompts]


def _record_batches(executor):
    log = []
    orig = executor.scheduler.schedule

    def schedule():
        batch = orig()
        log.append(([(r.request_id, r.num_computed, n) for r, n in zip(batch.context_requests, batch.context_chunks)],
                    [r.request_id for r in batch.generation_requests]))
        return batch

    executor.scheduler.schedule = schedule
    return log


def test_batch_invariance_with_staggered_arrivals(tiny_llama_dir, make_llm, prompts, solo):
    llm = make_llm(tiny_llama_dir, max_num_tokens=16, max_batch_size=8)
    ex = llm._executor
    ex.shutdown()                                   # drive the loop by hand, arrivals between steps
    log = _record_batches(ex)
    handles = []
    for group, steps in ((prompts[:3], 4), (prompts[3:6], 7), (prompts[6:], 0)):
        handles += [llm.generate_async(p, PARAMS) for p in group]
        ex._drain_incoming()
        for _ in range(steps):
            ex.step()
    ex.run_until_idle()
    got = [h.result(timeout=0).outputs[0].token_ids for h in handles]
    for i, (g, ref) in enumerate(zip(got, solo)):
        assert g == ref, f"prompt {i} (len {len(prompts[i])}) differs inside the batch"
    # the run really exercised what it claims to
    assert max(len(c) + len(g) for c, g in log) >= 5, "never more than 4 requests in a step"
    assert any(c and g for c, g in log), "no mixed prefill + decode step"
    assert any(start > 0 for c, _ in log for _, start, _ in c), "no chunked prefill"
    assert all(sum(n for _, _, n in c) + len(g) <= 16 for c, g in log), "token budget exceeded"


def test_batch_invariance_with_async_arrivals_while_running(tiny_llama_dir, make_llm, prompts, solo, bounded):
    llm = make_llm(tiny_llama_dir, max_num_tokens=16, max_batch_size=8)
    first = [llm.generate_async(p, PARAMS, streaming=True) for p in prompts[:4]]
    snap = bounded(lambda: next(iter(first[0])))
    assert not snap.finished                       # request 0 is decoding now; the rest arrive
    later = [llm.generate_async(p, PARAMS) for p in prompts[4:]]
    got = [h.result(timeout=60).outputs[0].token_ids for h in first + later]
    assert got == solo


def test_failing_request_is_isolated(tiny_llama_dir, make_llm):
    """A request whose own post-processing raises ends with an error; the others are unharmed."""
    llm = make_llm(tiny_llama_dir)
    ex = llm._executor
    good_ref = llm.generate("the quick brown fox", PARAMS).outputs[0].token_ids
    ex.shutdown()

    def broken_decode(ids):
        raise RuntimeError("boom")

    ex.decode = broken_decode                      # only stop-string checks use the executor's decode
    bad = llm.generate_async("once upon a time", SamplingParams(max_tokens=24, stop="zzz"))
    good = llm.generate_async("the quick brown fox", PARAMS)
    ex.run_until_idle()
    bad_out, good_out = bad.result(timeout=0), good.result(timeout=0)
    assert bad_out.finished and bad_out.outputs[0].finish_reason == "error"
    assert "boom" in bad_out.outputs[0].error
    assert good_out.outputs[0].token_ids == good_ref and good_out.outputs[0].finish_reason == "length"
    assert ex.fatal_error is None and llm._bundle.kv.seqs == {}
    assert llm._bundle.kv.pool.num_free == llm._bundle.kv.num_pages


def test_device_fault_fails_queued_and_submitted_requests_and_later_calls_raise(tiny_llama_dir, make_llm, bounded):
    """Issue #19 item 3: a device fault in a step fails every request, also one submitted while
    that step ran (it sat in the submission queue, which the old fault path never drained, so its
    caller waited forever); every later submission raises at once, and the pages are freed."""
    import threading

    llm = make_llm(tiny_llama_dir, max_batch_size=1)
    ex = llm._executor
    in_forward, release = threading.Event(), threading.Event()

    def faulty_forward(segments, prompt_segments=0):
        in_forward.set()
        release.wait(30)
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    ex.engine.forward = faulty_forward
    running = llm.generate_async("once upon a time", PARAMS)
    assert in_forward.wait(30)
    late = llm.generate_async("the quick brown fox", PARAMS)    # queued while the step runs
    release.set()
    for h in (running, late):
        out = bounded(lambda: h.result(timeout=30), timeout=40)
        assert out.outputs[0].finish_reason == "error" and "CUDA error" in out.outputs[0].error
    with pytest.raises(RuntimeError, match="fatal error.*CUDA error"):
        bounded(lambda: llm.generate("hello world", PARAMS), timeout=10)
    assert llm._bundle.kv.seqs == {}


@pytest.mark.parametrize("spec", [False, True])
def test_step_stats_count_every_step_once(tiny_llama_dir, tiny_drafters, make_llm, prompts, spec):
    """get_stats()["steps"]: each step ran one path (the one-graph DSpark step, the target's whole-step
    graph, piecewise graphs or eager), a step whose prompt chunks ran beside its one-graph step two,
    one whose prompts rode in it one (`one_graph_with_prompts`, also counted in `one_graph`), and the
    paths add up to the steps plus those beside; on the CPU (no CUDA graphs)
    a DSpark engine runs its steady steps as the one-graph step's reference path, a no-spec engine
    every step eagerly. With more prompts than the batch, prompts arrive while a DSpark step is in
    flight, which is then read before the next launch. trtllm-bench rows carry the same counts."""
    from tensorrt_llm.bench.benchmark import run_concurrency
    kw = {"speculative_config": {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}} if spec else {}
    llm = make_llm(tiny_llama_dir, max_batch_size=3, **kw)
    before = llm.get_stats()["steps"]
    assert before == {"total": 0, "with_prompt_chunks": 0, "read_in_flight_first": 0, "prompts_beside_in_flight": 0,
                      "prompts_beside_one_graph": 0, "prompts_read_late": 0, "one_graph": 0,
                      "one_graph_with_prompts": 0, "target_graph": 0,
                      "packed_graph": 0, "piecewise": 0, "eager": 0,
                      "seconds": 0.0, "seconds_with_prompt_chunks": 0.0, "seconds_reading_tokens": 0.0}
    row = run_concurrency(llm, prompts, 3, PARAMS)
    st = llm.get_stats()["steps"]
    assert row["steps"] == st                          # the level's delta (the engine was fresh)
    # step time: inside the level's wall time, the prompt steps' share of it positive and partial
    assert 0 < st["seconds_with_prompt_chunks"] < st["seconds"] <= row["elapsed_s"]
    # reading launched steps' tokens (a wait for the GPU there; host lists here): a part of the step time
    assert 0 <= st["seconds_reading_tokens"] < st["seconds"]
    assert st["total"] + st["prompts_beside_one_graph"] == (st["one_graph"] + st["target_graph"] + st["packed_graph"]
                                                            + st["piecewise"] + st["eager"])
    assert st["target_graph"] == st["packed_graph"] == st["piecewise"] == 0
    assert -(-len(prompts) // 3) <= st["with_prompt_chunks"] < st["total"]   # arrivals prefill 3 at most at once
    if spec:
        assert st["one_graph"] > st["total"] // 2 and st["read_in_flight_first"] > 0
        assert (st["prompts_beside_one_graph"] + st["one_graph_with_prompts"] <= st["prompts_beside_in_flight"]
                <= st["with_prompt_chunks"])
        assert st["one_graph_with_prompts"] <= st["one_graph"]
        assert 0 < st["prompts_read_late"] <= st["with_prompt_chunks"]
        assert st["seconds_reading_tokens"] > 0            # every DSpark step is read
    else:
        assert st["one_graph"] == st["read_in_flight_first"] == st["prompts_beside_in_flight"] == 0
        assert st["prompts_beside_one_graph"] == st["one_graph_with_prompts"] == 0
        assert st["prompts_read_late"] == 0
        assert st["eager"] == st["total"]


def test_prompt_steps_beside_a_dspark_step_in_flight_are_lossless(tiny_llama_dir, tiny_drafters, make_llm, prompts):
    """Requests that end at different steps let prompts in while others continue: such a step
    prefills the prompts alone while the DSpark step in flight runs on (its requests continue at the
    next step); the output equals the no-spec engine's token for token."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 17, 29, 8, 33, 21, 12, 40)]
    want = [o.outputs[0].token_ids for o in make_llm(tiny_llama_dir, max_batch_size=3).generate(prompts, params)]
    llm = make_llm(tiny_llama_dir, max_batch_size=3,
                   speculative_config={"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    st = llm.get_stats()["steps"]
    assert st["prompts_beside_in_flight"] > 0, st
    assert got == want


def test_only_streaming_requests_are_notified_every_step(tiny_llama_dir, make_llm, monkeypatch):
    """A request's update callback runs at every step that gave it tokens when it streams, and once,
    finished, when it does not (the LLM API reads only its final state then). Outputs are the same."""
    from tensorrt_llm.llmapi.outputs import GenerationResult
    calls: dict[int, list[bool]] = {}
    real = GenerationResult._update

    def spy(self, req, new_tokens):
        calls.setdefault(req.request_id, []).append(req.is_finished)
        real(self, req, new_tokens)
    monkeypatch.setattr(GenerationResult, "_update", spy)
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = llm.generate_async([5, 6, 7, 8], params)
    streamed = llm.generate_async([5, 6, 7, 8], params, streaming=True)
    a, b = plain.result(timeout=60), streamed.result(timeout=60)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
    assert calls[a.request_id] == [True]
    assert len(calls[b.request_id]) >= 12 and calls[b.request_id][-1] and not any(calls[b.request_id][:-1])
