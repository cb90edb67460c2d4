"""The one-graph DSpark step (`SpecStepGraph`): target verify -> greedy acceptance -> draft step.

`greedy_verify` equals the rejection sampler's greedy rows (random logits and drafts that match a
random prefix of the argmax; control: one changed draft changes its row), and so does its
acceptance compiled by inductor (`compiled_accept_rows`, what a step with compiled regions runs).
End to end on the CPU
(the same step code, run directly): with it and without it (target forward + rejection sampler +
draft step apart) the outputs equal no-spec greedy token for token and the acceptance histograms
are equal under oracle drafts; most steps take it. Negative control: committing one token past
the first mismatch changes the output. A refused graph falls back to the split step, losslessly.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor import spec_step_graph
from tensorrt_llm._torch.runtime.sampler import Sampler
from tensorrt_llm._torch.speculative.rejection_sampler import RejectionSampler, SpecDecodeMetadata

from tests.unittest._torch.pyexecutor.spec_runs import generate_run, random_prompts
from tests.unittest._torch.speculative.draft_oracle import future_drafts, patch_draft_oracles


def _verify_case(seed: int, b: int = 12, q: int = 6, v: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, q, v, generator=g)
    best = logits.argmax(-1)
    ids = torch.randint(0, v, (b, q), generator=g)
    for i in range(b):            # row i's drafts match the argmax for a prefix of i % q
        n = i % q
        ids[i, 1:1 + n] = best[i, :n]
    return ids, logits


def test_greedy_verify_equals_the_rejection_sampler():
    ids, logits = _verify_case(0)
    b, q, _ = logits.shape
    got = spec_step_graph.greedy_verify(ids, logits, torch.ones(b, dtype=torch.bool))
    meta = SpecDecodeMetadata(request_ids=list(range(b)), params=[SamplingParams()] * b,
                              draft_token_ids=ids[:, 1:], num_draft_tokens=torch.full((b,), q - 1),
                              target_logits=logits)
    want = RejectionSampler(Sampler(0, torch.device("cpu"))).forward(meta)
    assert torch.equal(got, want)
    assert sorted(set(((got >= 0).sum(1) - 1).tolist())) == list(range(q))   # every acceptance length
    pad = spec_step_graph.greedy_verify(ids, logits, torch.zeros(b, dtype=torch.bool))
    assert ((pad >= 0).sum(1) == 1).all()                                     # a padding row commits one
    wrong = ids.clone()
    wrong[q - 1, 1] = (wrong[q - 1, 1] + 1) % logits.shape[2]                 # control: its first draft
    bad = spec_step_graph.greedy_verify(wrong, logits, torch.ones(b, dtype=torch.bool))
    assert not torch.equal(bad[q - 1], got[q - 1]) and torch.equal(bad[:q - 1], got[:q - 1])


def test_greedy_verify_over_bf16_logits_with_the_split_argmax():
    """The one-graph step on CUDA: the lm_head's bf16 logits (no float32 copy) through `argmax_rows`
    (Triton; the interpreter here) commit what the float32 logits commit."""
    from tensorrt_llm._torch.models.dspark_markov_kernel import argmax_rows
    ids, logits = _verify_case(0)
    half = logits.to(torch.bfloat16)
    live = torch.ones(ids.shape[0], dtype=torch.bool)
    want = spec_step_graph.greedy_verify(ids, half.float(), live)
    assert torch.equal(spec_step_graph.greedy_verify(ids, half, live, argmax_rows), want)
    assert bool((want >= 0).sum(1).gt(1).any())                              # drafts were accepted


def test_compiled_acceptance_equals_the_eager_one():
    """With compiled regions the acceptance after the argmax is `accept_rows` through inductor: the
    same committed rows on live and padding rows; control: a draft changed in one row changes
    exactly that row."""
    ids, logits = _verify_case(1)
    b = ids.shape[0]
    best = logits.argmax(-1)
    compiled = spec_step_graph.compiled_accept_rows()
    for live in (torch.ones(b, dtype=torch.bool), torch.arange(b) % 3 != 0):
        want = spec_step_graph.accept_rows(ids, best, live)
        assert torch.equal(compiled(ids, best, live), want)
        assert torch.equal(spec_step_graph.greedy_verify(ids, logits, live, accept=compiled), want)
    wrong = ids.clone()
    wrong[b - 1, 1] = (best[b - 1, 0] + 1) % logits.shape[2]
    live = torch.ones(b, dtype=torch.bool)
    got, want = compiled(wrong, best, live), spec_step_graph.accept_rows(ids, best, live)
    assert not torch.equal(got[b - 1], want[b - 1]) and torch.equal(got[:b - 1], want[:b - 1])


def _off(engine) -> None:
    engine.spec_step = None


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_one_graph_step_equals_the_split_step(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch, kind):
    rng = random.Random(11)
    prompts = random_prompts(rng, 8)
    max_tokens = [rng.randrange(4, 40) for _ in prompts]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False, max_batch_size=4)
    patch_draft_oracles(monkeypatch, future_drafts({tuple(p): t for p, t in zip(prompts, want)}, salt=3))
    # arrivals beside a one-graph step launch their first drafts here (the oracle's), as in the split
    # step, not placeholder rows (`anchor_arrivals`: test_arrival_drafts.py)
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    monkeypatch.setattr(DSparkWorker, "anchor_arrivals", lambda self, commits, anchors, captured: None)
    from tensorrt_llm._torch.pyexecutor.mixed_step_graph import MixedSpecGraph    # nor inside it (placeholders)
    monkeypatch.setattr(MixedSpecGraph, "run", lambda self, reqs, segments, num_ctx: None)
    runs = {}
    for overlap in (False, True):
        got, stats, ex = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap, tiny_drafters[kind],
                                   max_batch_size=4)
        runs[overlap] = (got, stats["speculative"]["accept_histogram"], ex.engine.spec_step.num_launches,
                         ex.iterations)
    # the split step: the same engine without the one-graph path
    from tensorrt_llm._torch.pyexecutor import py_executor_creator
    real = py_executor_creator._enable_spec_step
    monkeypatch.setattr(py_executor_creator, "_enable_spec_step", lambda *a, **k: {"enabled": False, "reason": "test"})
    split, s_split, ex_split = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                         max_batch_size=4)
    monkeypatch.setattr(py_executor_creator, "_enable_spec_step", real)
    assert ex_split.engine.spec_step is None
    for overlap, (got, hist, launches, iterations) in runs.items():
        assert got == want, overlap
        assert hist == s_split["speculative"]["accept_histogram"], overlap
        assert launches > 0.5 * iterations, (overlap, launches, iterations)
    assert split == want
    assert sum(runs[True][1][1:]) > 0          # drafts were accepted (the oracle's prefixes)


def test_committing_past_the_first_mismatch_is_seen(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch):
    """Negative control: the graph commits one more token (the target's choice after a rejected
    draft): the output differs from no-spec."""
    rng = random.Random(5)
    prompts = random_prompts(rng, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    real = spec_step_graph.greedy_verify

    def one_more(ids, logits, live, argmax, accept):
        v = real(ids, logits, live, argmax, accept)
        n = (v >= 0).sum(1)
        col = n.clamp(max=v.shape[1] - 1)
        v.scatter_(1, col[:, None], logits.argmax(-1).gather(1, col[:, None]))
        return v
    monkeypatch.setattr(spec_step_graph, "greedy_verify", one_more)
    bad, _, ex = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"])
    assert ex.engine.spec_step.num_launches > 0
    assert bad != want


def test_a_refused_one_graph_step_falls_back_to_the_split_step(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch,
                                                               caplog):
    """A runtime error in the one-graph step (a capture the runtime refuses) turns it off with an
    error logged; that step and the rest run verify and draft apart, and the output still equals
    no-spec greedy (no request fails)."""
    rng = random.Random(9)
    prompts = random_prompts(rng, 4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    real, calls = spec_step_graph.SpecStepGraph.run, []

    def refused(self, reqs, segments):
        calls.append(len(segments))
        if len(calls) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, reqs, segments)
    monkeypatch.setattr(spec_step_graph.SpecStepGraph, "run", refused)
    with caplog.at_level("ERROR", logger="tensorrt_llm"):
        got, stats, ex = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"])
    assert got == want
    assert len(calls) == 3 and ex.engine.spec_step is None
    assert "one-graph DSpark step failed" in caplog.text and not re.search(r"request \d+ failed", caplog.text)
    assert stats["speculative"]["accept_histogram"][0] > 0 and ex.drafter.graph_runner is not None


def test_capacity_report_says_whether_steps_are_one_graph(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch):
    spec = {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}
    on = make_llm(tiny_llama_dir, speculative_config=spec)
    rep = on.capacity_report["one_graph_step"]
    assert rep["enabled"] and "directly" in rep["reason"] and on._executor.engine.spec_step is not None
    assert "one_graph_step" not in make_llm(tiny_llama_dir).capacity_report          # no drafter
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    monkeypatch.setattr(DSparkWorker, "enable_device_drafts", lambda self, *a, **k: None)
    off = make_llm(tiny_llama_dir, speculative_config=spec)
    rep = off.capacity_report["one_graph_step"]
    assert not rep["enabled"] and "device draft step is off" in rep["reason"] and off._executor.engine.spec_step is None


def test_a_one_graph_capture_refused_at_startup_turns_it_off(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch,
                                                             caplog):
    """`ModelEngine.capture_graphs` (the startup capture of every graph): a one-graph step the runtime
    refuses to capture is turned off with an error logged and the engine keeps serving, losslessly;
    a device fault is raised. Control: without the refusal the step stays on (on the CPU nothing is
    captured: the step runs directly)."""
    spec = {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}
    llm = make_llm(tiny_llama_dir, speculative_config=spec)
    engine = llm._executor.engine
    assert engine.capture_graphs(True) == 0 and engine.spec_step is not None

    def refused(self, continued):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(spec_step_graph.SpecStepGraph, "capture_all", refused)
    with caplog.at_level("ERROR", logger="tensorrt_llm"):
        assert engine.capture_graphs(True) == 0
    assert engine.spec_step is None and "one-graph DSpark step capture failed" in caplog.text
    rng = random.Random(4)
    prompts = random_prompts(rng, 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want

    llm2 = make_llm(tiny_llama_dir, speculative_config=spec)

    def fault(self, continued):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(spec_step_graph.SpecStepGraph, "capture_all", fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm2._executor.engine.capture_graphs(True)


def test_a_startup_capture_the_runtime_refuses_is_reported(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch,
                                                           caplog):
    """The executor creator's startup capture (`_capture_graphs`): a refused capture is logged and
    reported instead of raised (the rest are captured at their first step); a device fault is
    raised. Control: nothing refused, no error entry."""
    from tensorrt_llm._torch.pyexecutor import py_executor_creator
    from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner
    spec = {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}
    ex = make_llm(tiny_llama_dir, speculative_config=spec)._executor
    ok = py_executor_creator._capture_graphs(ex.engine, ex.drafter, True, torch.float32)
    assert ok["captured_at_startup"] == 0 and "error" not in ok

    def refused(self, dtype):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(DraftGraphRunner, "capture_all", refused)
    with caplog.at_level("ERROR", logger="tensorrt_llm"):
        rep = py_executor_creator._capture_graphs(ex.engine, ex.drafter, True, torch.float32)
    assert "not permitted" in rep["error"] and "capturing CUDA graphs at startup failed" in caplog.text

    def fault(self, dtype):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(DraftGraphRunner, "capture_all", fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        py_executor_creator._capture_graphs(ex.engine, ex.drafter, True, torch.float32)
