"""The overlap scheduler with DSpark: a verify step is launched from the device rows of the step in
flight (its anchor, drafts and committed count, `DraftsAhead`), with its start shifted on the
device, and the step in flight is read one step later.

Outputs equal no-spec greedy and the loop without overlap token for token, and so do the
acceptance statistics (oracle drafts that depend only on (prompt, position)); most verify steps
are continued; a request that may end by length waits one step; pages all return. Negative
control: a start shift off by one on the device changes the output.
"""
from __future__ import annotations

import random

import pytest

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.runtime import token_rows

from tests.unittest._torch.pyexecutor.spec_runs import dspark_spec, generate_run, random_prompts
from tests.unittest._torch.speculative.draft_oracle import future_drafts, patch_draft_oracles


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("options,continued", [
    ({"max_batch_size": 4}, 0.5),
    # prompt chunks in most steps (a step holding one reads the step in flight first)
    ({"max_batch_size": 8, "max_num_tokens": 24}, 0.1)])
def test_continued_verify_steps_equal_the_plain_loop(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch,
                                                     kind, options, continued):
    rng = random.Random(7)
    prompts = random_prompts(rng, 10)
    max_tokens = [rng.randrange(2, 40) for _ in prompts]
    greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, greedy, overlap=False, **options)
    truth = {tuple(p): t for p, t in zip(prompts, want)}
    # stop ids the model emits (stops seen one step late must not change the output)
    params = [SamplingParams(max_tokens=m, stop_token_ids=[t[m // 2]] if i % 3 == 0 and m > 4 else [],
                             ignore_eos=True) for i, (m, t) in enumerate(zip(max_tokens, want))]
    ref, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False, **options)
    patch_draft_oracles(monkeypatch, future_drafts(truth, salt=1))
    # arrivals beside a one-graph step launch their first drafts here (the oracle's), not placeholder
    # rows (`anchor_arrivals`, whose first verify sees other drafts: test_arrival_drafts.py)
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    monkeypatch.setattr(DSparkWorker, "anchor_arrivals", lambda self, commits, anchors, captured: None)
    from tensorrt_llm._torch.pyexecutor.mixed_step_graph import MixedSpecGraph    # nor inside it (placeholders)
    monkeypatch.setattr(MixedSpecGraph, "run", lambda self, reqs, segments, num_ctx: None)
    plain, s_plain, ex_plain = generate_run(make_llm, tiny_llama_dir, prompts, params, False, tiny_drafters[kind],
                                         **options)
    over, s_over, ex_over = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                      **options)
    assert plain == ref and over == ref
    assert any(len(o) < m for o, m in zip(ref, max_tokens))          # some stopped on a stop id
    sp_plain, sp_over = s_plain["speculative"], s_over["speculative"]
    assert sp_over["accept_histogram"] == sp_plain["accept_histogram"]
    assert sp_over["acceptance_length"] > 1.5                         # the oracle's drafts arrived
    assert ex_over.spec_overlap and not ex_plain.spec_overlap
    assert ex_plain.engine.num_continued_steps == 0
    # most verify steps were launched before the step in flight was read
    n = ex_over.engine.num_continued_steps
    assert n > continued * ex_over.iterations, (n, ex_over.iterations)


def test_sampled_and_greedy_requests_mix(make_llm, tiny_llama_dir, tiny_drafters):
    """Sampled requests draft eagerly and are never continued; a step holding one is read at once.
    Their tokens depend only on their seeds: overlap on == off, greedy rows == no-spec."""
    rng = random.Random(3)
    prompts = random_prompts(rng, 6)
    params = [SamplingParams(max_tokens=18, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=18, temperature=0.9, seed=i, ignore_eos=True) for i in range(6)]
    on, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"])
    off, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, False, tiny_drafters["gqa"])
    nospec, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, False)
    assert on == off
    assert [t for i, t in enumerate(on) if i % 2] == [t for i, t in enumerate(nospec) if i % 2]


def test_a_wrong_device_shift_is_seen(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch):
    """Negative control: continued segments whose device-side start is one position late (the shift
    gathered + 1) write and read the wrong KV positions: the output differs from no-spec."""
    rng = random.Random(5)
    prompts = random_prompts(rng, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, overlap=False)
    got, _, ex = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"])
    assert got == want and ex.engine.num_continued_steps > 0
    real = token_rows.gather_shifts

    def late(dst, shifts):
        real(dst, shifts)
        dst.add_(1)
    from tensorrt_llm._torch.pyexecutor import cuda_graph_runner, model_engine
    monkeypatch.setattr(model_engine, "gather_shifts", late)        # the eager continued step
    monkeypatch.setattr(cuda_graph_runner, "gather_shifts", late)   # the graph entries (one-graph step)
    bad, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters["gqa"])
    assert bad != want


def test_capacity_report_says_whether_dspark_steps_overlap(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch):
    spec = dspark_spec(tiny_drafters["mla"])
    on = make_llm(tiny_llama_dir, speculative_config=spec).capacity_report["overlap_scheduler"]
    assert on["enabled"] and "device rows" in on["reason"]
    off = make_llm(tiny_llama_dir, speculative_config=spec, disable_overlap_scheduler=True)
    assert off.capacity_report["overlap_scheduler"] == {"enabled": False, "reason": "disable_overlap_scheduler: true"}
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    monkeypatch.setattr(DSparkWorker, "enable_device_drafts", lambda self, *a, **k: None)
    no_device = make_llm(tiny_llama_dir, speculative_config=spec)
    rep = no_device.capacity_report["overlap_scheduler"]
    assert not rep["enabled"] and "device draft step is off" in rep["reason"] and not no_device._executor.spec_overlap


def test_device_drafts_equal_eager_drafts_with_a_trained_drafter(tmp_path, monkeypatch):
    """A drafter trained on its tiny target (tests/unittest/serve/data/tiny_dspark_mla: it reads the
    context, AL ~1.4): the device draft step (run directly on the CPU, VANILLA with device lengths),
    overlap on and off, batched and one request at a time, accepts exactly what the eager draft
    step accepts. Negative control: a VANILLA that keeps a reused metadata's first layout (stale
    lengths in the device draft step's persistent metadata) accepts differently."""
    import json
    import sys
    from pathlib import Path

    from tensorrt_llm import LLM
    from tensorrt_llm._torch.attention_backend.interface import AttentionBackend
    from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
    from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
    tests = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(tests / "tools"))
    from dspark_tiny import build_tiny_target
    data = tests / "serve" / "data" / "tiny_dspark_mla"
    prompts = json.loads((data / "prompts.json").read_text())[:8]
    target = build_tiny_target(tmp_path / "target")

    def hist(batched: bool, **kw) -> list[int]:
        with LLM(str(target), device="cpu", kv_cache_config={"max_tokens": 1024, "tokens_per_block": 16},
                 speculative_config=dspark_spec(str(data)), **kw) as llm:
            p = SamplingParams(max_tokens=24, ignore_eos=True)
            if batched:
                llm.generate(prompts, p)
            else:
                for x in prompts:
                    llm.generate(x, p)
            return llm.get_stats()["speculative"]["accept_histogram"]

    device = [hist(b, disable_overlap_scheduler=not o) for b in (True, False) for o in (True, False)]
    with monkeypatch.context() as m:
        m.setattr(VanillaAttention, "prepare", AttentionBackend.prepare)        # control: stale layouts
        stale = hist(True)
    with monkeypatch.context() as m:
        m.setattr(DSparkWorker, "enable_device_drafts", lambda self, *a, **k: None)
        eager = hist(True)
    assert all(h == eager for h in device), (device, eager)
    al = sum(i * n for i, n in enumerate(eager)) / sum(eager) + 1
    assert al > 1.2, eager
    assert stale != eager
