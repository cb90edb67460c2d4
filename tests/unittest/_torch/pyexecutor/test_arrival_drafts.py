"""Arrivals drafted before the host reads their first tokens (`pyexecutor/arrival_drafts.py`): a step
with prompt chunks (alone, or leading the running requests' continued segments) launches its prompts'
first drafts from the chosen ids on the device and is read one step late. Outputs equal no-spec greedy."""
from __future__ import annotations

import random

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor import py_executor
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor

from tests.unittest._torch.pyexecutor.spec_runs import generate_run, random_prompts


def _staggered_runs(make_llm, target, drafter):
    """30 short requests of random lengths, 4 at a time: (prompts, params, the no-spec greedy output,
    the overlapped DSpark run's (output, stats, executor))."""
    rng = random.Random(7)
    prompts = random_prompts(rng, 30)
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True) for _ in prompts]
    want, _, _ = generate_run(make_llm, target, prompts, params, overlap=False)
    return prompts, params, want, generate_run(make_llm, target, prompts, params, True, drafter, max_batch_size=4)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_arrivals_are_read_one_step_late(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch, kind):
    """A prompt-only step launches its prompts' first drafts from the chosen ids on the device and is
    read one step later (the requests continue from those rows): outputs equal no-spec greedy, with
    stop ids and max_tokens 1 among them. Negative control: an arrival advanced to its full prompt
    length on the host (its continued segment one position late) changes the output."""
    rng = random.Random(11)
    prompts = random_prompts(rng, 9)
    max_tokens = [1 if i == 4 else rng.randrange(3, 30) for i in range(len(prompts))]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts,
                              [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens], overlap=False)
    params = [SamplingParams(max_tokens=m, stop_token_ids=[t[0]] if i == 2 else [], ignore_eos=True)
              for i, (m, t) in enumerate(zip(max_tokens, want))]
    ref, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    assert ref[2] != want[2] and ref[4] == want[4][:1]     # a stop on the first token; max_tokens 1
    got, stats, ex = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                  max_batch_size=3)
    assert got == ref
    assert stats["steps"]["prompts_read_late"] == ex.prompts_read_late > 0

    real = py_executor.launch_arrivals

    def one_late(drafter, reqs, segments, out, ids, *beside):
        ahead, whole = real(drafter, reqs, segments, out, ids, *beside)
        for req in reqs if whole else ():
            req.num_computed += 1
        return ahead, whole
    monkeypatch.setattr(py_executor, "launch_arrivals", one_late)
    bad, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                             max_batch_size=3)
    assert bad != ref


@pytest.mark.parametrize("kind,mode", [("gqa", "inside"), ("mla", "inside"), ("gqa", "beside"), ("mla", "beside"),
                                       ("gqa", "apart"), ("mla", "apart")])
def test_prompts_join_the_continued_segments_in_one_step(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch,
                                                         kind, mode):
    """A prompt arriving while a DSpark step is in flight runs in the same step as the running requests'
    continued verify segments, launched before the step in flight is read: inside the continued
    one-graph step's forward (`MixedSpecGraph`, "inside"), in their own graph beside it (`SpecSteps`,
    "beside": the mixed graph declines), or, without the one-graph step ("apart"), in one mixed forward
    with them. Such a step whose prompts all end drafts them ahead too, so it is read one step late:
    seen many times over many short requests; output equals no-spec greedy. Negative controls: the
    continued segments one position late on the device (their shift + 1 in `shift_tokens`) change the
    output, in the mixed forward and in the mixed one-graph step."""
    from tensorrt_llm._torch.pyexecutor import mixed_step_graph, model_engine
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    if mode == "apart":
        monkeypatch.setattr(ModelEngine, "forward_spec", lambda self, reqs, segments, num_ctx=0: None)
    if mode == "beside":
        monkeypatch.setattr(mixed_step_graph.MixedSpecGraph, "run", lambda self, reqs, segments, num_ctx: None)
    mixed = []
    real = PyExecutor._continue_or_complete

    def counting(self, batch):
        real(self, batch)
        mixed.append(bool(batch.context_requests) and self._spec_inflight is not None
                     and bool(batch.generation_requests))
    monkeypatch.setattr(PyExecutor, "_continue_or_complete", counting)
    prompts, params, want, (got, stats, ex) = _staggered_runs(make_llm, tiny_llama_dir, tiny_drafters[kind])
    assert got == want
    assert sum(mixed) >= 5 and ex.prompts_beside_flight == sum(mixed)
    # in or beside the one-graph step where it took the generating segments (continued, or read on the host)
    inside, beside = stats["steps"]["one_graph_with_prompts"], ex.prompts_beside_one_graph
    assert inside >= 0.8 * sum(mixed) if mode == "inside" else inside == 0
    assert beside >= 0.8 * sum(mixed) if mode == "beside" else beside == 0
    # most mixed steps drafted their arrivals ahead and were read late
    assert stats["steps"]["prompts_read_late"] >= sum(mixed) // 2
    if mode == "beside":
        return

    module = mixed_step_graph if mode == "inside" else model_engine
    real_shift = module.shift_tokens

    def late(positions, slots, kv_lens, shift_index, shifts, block_tables, page_size):
        if shift_index.numel() and bool((shift_index < shifts.shape[0] - 1).any()) and ex_ref.mixed:
            shifts = shifts + (torch.arange(shifts.shape[0]) < shifts.shape[0] - 1).to(shifts.dtype)
        real_shift(positions, slots, kv_lens, shift_index, shifts, block_tables, page_size)

    class ex_ref:
        mixed = False

    def flag(self, batch):
        real(self, batch)
        ex_ref.mixed = bool(batch.context_requests) and self._spec_inflight is not None
    monkeypatch.setattr(PyExecutor, "_continue_or_complete", flag)
    monkeypatch.setattr(module, "shift_tokens", late)
    bad, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind], max_batch_size=4)
    assert bad != want


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_arrivals_continue_in_the_one_graph_step(make_llm, tiny_llama_dir, tiny_drafters, kind):
    """The step after a prompt-only step read late mixes the arrivals' continued segments (their
    starts shifted on the device) with requests read on the host: it still runs as one graph (each
    segment's page span is checked for its own kind), so every step without a prompt chunk does.
    Output equals no-spec greedy. (With the continued span required of every segment, 20 of these
    117 steps went eager: 89 one-graph steps for 109.)"""
    rng = random.Random(5)
    prompts = random_prompts(rng, 12)
    params = [SamplingParams(max_tokens=rng.randrange(10, 60), ignore_eos=True) for _ in prompts]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    got, stats, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                 max_batch_size=4, kv_cache_config={"max_tokens": 4096, "tokens_per_block": 8})
    steps = stats["steps"]
    assert got == want
    assert steps["prompts_read_late"] > 0
    assert steps["one_graph"] == (steps["total"] - steps["with_prompt_chunks"] + steps["prompts_beside_one_graph"]
                                  + steps["one_graph_with_prompts"])


def test_an_arrival_left_out_of_the_launch_writes_its_context_once(make_llm, tiny_llama_dir, tiny_drafters,
                                                                   monkeypatch):
    """`draft_arrivals` writes every arrival's draft context; one its launch leaves out (here the last
    of each group, as a page-span refusal would) drafts after the read without writing it again:
    every (request, position) is written once, and the output equals no-spec greedy. Checked the
    other way: without the skip the left-out arrivals' prompt positions were written twice."""
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    written, left_out = [], []
    real_write, real_launch = DSparkWorker._write_context, DSparkWorker._launch_last_rows

    def spy(self, commits, captured):
        written.extend((c.req.request_id, p) for c in commits for p in range(c.start, c.start + c.count))
        return real_write(self, commits, captured)

    def partial(self, commits, anchors, captured):
        if len(commits) > 1:
            left_out.append(commits[-1].req.request_id)
            commits, anchors = commits[:-1], anchors[:-1]
        return real_launch(self, commits, anchors, captured)
    rng = random.Random(3)
    prompts = random_prompts(rng, 8)
    params = [SamplingParams(max_tokens=rng.randrange(4, 20), ignore_eos=True) for _ in prompts]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    monkeypatch.setattr(DSparkWorker, "_write_context", spy)
    monkeypatch.setattr(DSparkWorker, "_launch_last_rows", partial)
    got, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"],
                             max_batch_size=4)
    assert got == want
    assert left_out and written
    assert len(written) == len(set(written))


def test_prompt_context_written_by_the_forward_is_not_written_again(make_llm, tiny_llama_dir, tiny_drafters,
                                                                    monkeypatch):
    """A forward that wrote its prompt chunks' draft context (the packed-step graph with the drafter's
    writer; emulated here on the CPU's eager forward with the same `write_forward_context`) reports
    them in `context_segments`: the executor marks them written and the drafter's own writes skip
    every prompt position. Output equals no-spec greedy and the AL equals the run without the
    emulation (the same context, written once). Control: without the marks, prompt positions are
    written a second time."""
    from tensorrt_llm._torch.attention_backend.interface import host_ints
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    rng = random.Random(4)
    prompts = random_prompts(rng, 8)
    params = [SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=True) for _ in prompts]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    _, plain, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"], max_batch_size=3)
    real_forward, real_write = ModelEngine.forward, DSparkWorker._write_context
    prompt_positions, again, emulated = set(), [], []

    def forward(self, segments, prompt_segments=0):
        out = real_forward(self, segments, prompt_segments)
        drafter, kv = self.test_drafter, self.kv
        segs = segments[:prompt_segments]
        slots = [s for seg in segs for s in kv.slots(seg.request_id, seg.start, len(seg.token_ids))]
        if segs and -1 not in slots:
            n = len(slots)
            pos = [p for seg in segs for p in range(seg.start, seg.start + len(seg.token_ids))]
            with torch.inference_mode():
                drafter.write_forward_context(out.captured[:n], host_ints(pos, out.captured.device),
                                              host_ints(slots, out.captured.device))
            out.context_segments = prompt_segments
            emulated.append(n)
            prompt_positions.update((seg.request_id, p) for seg in segs
                                    for p in range(seg.start, seg.start + len(seg.token_ids)))
        return out

    def spy(self, commits, captured):
        again.extend((c.req.request_id, p) for c in commits for p in range(c.start, c.start + c.count))
        return real_write(self, commits, captured)
    monkeypatch.setattr(ModelEngine, "forward", forward)
    monkeypatch.setattr(DSparkWorker, "_write_context", spy)
    llm = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark",
                                                       "speculative_model": tiny_drafters["gqa"]},
                   max_batch_size=3)
    llm._executor.engine.test_drafter = llm._executor.drafter
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert emulated and prompt_positions and not prompt_positions & set(again)
    assert llm.get_stats()["speculative"]["acceptance_length"] == plain["speculative"]["acceptance_length"]
    # control: the executor's marks are what the drafter skips by
    monkeypatch.setattr(ModelEngine, "forward", lambda self, segments, prompt_segments=0: _unmarked(
        forward(self, segments, prompt_segments)))
    prompt_positions.clear()
    again.clear()
    llm2 = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark",
                                                        "speculative_model": tiny_drafters["gqa"]},
                    max_batch_size=3)
    llm2._executor.engine.test_drafter = llm2._executor.drafter
    llm2.generate(prompts, params)
    assert prompt_positions & set(again)


def _unmarked(out):
    out.context_segments = 0
    return out


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_arrivals_beside_the_one_graph_step_carry_placeholder_drafts(make_llm, tiny_llama_dir, tiny_drafters,
                                                                     monkeypatch, kind):
    """Prompt chunks beside a one-graph step launch no draft step: their rows hold the chosen id and
    placeholder drafts (`anchor_arrivals`), which the next step verifies and then drafts from; a
    prompt-only step still launches its arrivals' drafts. Output equals no-spec greedy, with the
    placeholders used many times. Negative control: rows whose anchor is not the chosen id change the
    output (the next step really continues from these rows). A drafter that declines gets the
    arrivals' draft launch instead (still lossless). (The prompts run beside the one-graph step here: the
    mixed one-graph step, which would take them inside, declines.)"""
    from tensorrt_llm._torch.pyexecutor.mixed_step_graph import MixedSpecGraph
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    monkeypatch.setattr(MixedSpecGraph, "run", lambda self, reqs, segments, num_ctx: None)
    calls = {"anchor": 0, "launch": 0}
    real_anchor, real_launch = DSparkWorker.anchor_arrivals, DSparkWorker.draft_arrivals

    def anchor(self, commits, anchors, captured):
        ahead = real_anchor(self, commits, anchors, captured)
        calls["anchor"] += ahead is not None
        return ahead

    def launch(self, commits, anchors, captured):
        calls["launch"] += 1
        return real_launch(self, commits, anchors, captured)
    monkeypatch.setattr(DSparkWorker, "anchor_arrivals", anchor)
    monkeypatch.setattr(DSparkWorker, "draft_arrivals", launch)
    prompts, params, want, (got, stats, ex) = _staggered_runs(make_llm, tiny_llama_dir, tiny_drafters[kind])
    assert got == want
    assert calls["anchor"] == ex.prompts_beside_one_graph >= 5
    assert calls["launch"] >= 1                    # the first prompt-only step
    assert stats["steps"]["prompts_read_late"] >= calls["anchor"]

    def wrong_anchor(self, commits, anchors, captured):
        return real_anchor(self, commits, (anchors + 1) % 500, captured)
    monkeypatch.setattr(DSparkWorker, "anchor_arrivals", wrong_anchor)
    bad, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind], max_batch_size=4)
    assert bad != want

    calls.update(anchor=0, launch=0)
    monkeypatch.setattr(DSparkWorker, "anchor_arrivals", lambda self, commits, anchors, captured: None)
    got2, _, ex2 = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                max_batch_size=4)
    assert got2 == want
    assert calls["anchor"] == 0 and calls["launch"] >= ex2.prompts_beside_one_graph >= 5
