"""`draft_len_schedule`: drafts verified per request by the step's number of generating requests.

Config validation names the bad entry; the lookup follows TensorRT-LLM's rule (the smallest batch
key >= the batch; above the largest, no drafts). In the engine (CPU, oracle drafts on both draft
paths), every step verifies exactly 1 + draft_len(its generating requests) tokens per request,
steps above the largest key decode one token per request, outputs equal no-spec greedy with the
overlap scheduler on and off, and the acceptance statistics count only verified drafts.
Negative control: the same run without a schedule verifies other widths.
"""
from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from tensorrt_llm import DSparkDecodingConfig, SamplingParams
from tests.unittest._torch.speculative.draft_oracle import future_drafts, patch_draft_oracles

SCHEDULE = {2: 4, 4: 2, 6: 1}


@pytest.mark.parametrize("bad,msg", [({}, "must not be empty"), ({2: 1, 4: 3}, "must not increase"),
                                     ({0: 2}, "batch size >= 1"), ({4: -1}, "draft length >= 0")])
def test_schedule_validation_names_the_entry(bad, msg):
    with pytest.raises(ValidationError, match=msg):
        DSparkDecodingConfig(speculative_model="x", draft_len_schedule=bad)
    cfg = DSparkDecodingConfig(speculative_model="x", draft_len_schedule={8: 1, 2: 4})
    assert list(cfg.draft_len_schedule) == [2, 8]                  # sorted by batch size


def test_schedule_above_max_draft_len_is_refused(make_llm, tiny_llama_dir, tiny_drafters):
    with pytest.raises(ValueError, match=r"draft_len_schedule \{2: 9\} exceeds max_draft_len 4"):
        make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark", "max_draft_len": 4,
                                                    "speculative_model": tiny_drafters["gqa"],
                                                    "draft_len_schedule": {2: 9, 4: 3}})


def test_lookup_and_widths(make_llm, tiny_llama_dir, tiny_drafters):
    llm = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark", "speculative_model":
                                                      tiny_drafters["gqa"], "draft_len_schedule": SCHEDULE})
    w = llm._executor.drafter
    assert [w.draft_len(b) for b in (1, 2, 3, 4, 5, 6, 7, 64)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert list(w.verify_widths) == [1, 2, 3, 5]
    plain = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark",
                                                        "speculative_model": tiny_drafters["gqa"]})
    assert plain._executor.drafter.draft_len(64) == plain._executor.drafter.max_draft_len


@pytest.mark.parametrize("overlap", [True, False])
def test_steps_verify_the_scheduled_width_losslessly(make_llm, tiny_llama_dir, tiny_drafters, monkeypatch, overlap):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 20))] for _ in range(9)]
    params = [SamplingParams(max_tokens=rng.randrange(6, 30), ignore_eos=True) for _ in prompts]
    want = [o.outputs[0].token_ids for o in make_llm(tiny_llama_dir, max_batch_size=8).generate(prompts, params)]
    patch_draft_oracles(monkeypatch, future_drafts({tuple(p): t for p, t in zip(prompts, want)}, salt=3))

    def run(schedule):
        spec = {"decoding_type": "DSpark", "speculative_model": tiny_drafters["gqa"]}
        if schedule:
            spec["draft_len_schedule"] = schedule
        llm = make_llm(tiny_llama_dir, max_batch_size=8, speculative_config=spec,
                       disable_overlap_scheduler=not overlap)
        eng, seen = llm._executor.engine, []
        real, real_spec = eng.forward, eng.forward_spec

        def observe(segments):
            gen = [len(s.token_ids) for s in segments if s.num_logits == len(s.token_ids) and s.start > 0]
            if gen and len(gen) == len(segments):
                seen.append((len(gen), set(gen)))

        def forward(segments, prompt_segments=0):
            observe(segments)
            return real(segments, prompt_segments)

        def forward_spec(reqs, segments, num_ctx=0):   # the one-graph step (else `forward` runs the step)
            launch = real_spec(reqs, segments, num_ctx)
            if launch is not None:
                observe(segments[num_ctx:])
            return launch
        eng.forward, eng.forward_spec = forward, forward_spec
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outs, seen, llm.get_stats()["speculative"]

    got, seen, stats = run(SCHEDULE)
    assert got == want
    widths = {1 + next((n for b, n in sorted(SCHEDULE.items()) if k <= b), 0) for k in range(1, 9)}
    assert {w for _, ws in seen for w in ws} <= widths
    # steps of pure generation verify the scheduled width (a request whose drafts were clamped
    # by its pages may verify fewer); above the largest key: one token per request
    for batch, ws in seen:
        want_w = 1 + next((n for b, n in sorted(SCHEDULE.items()) if batch <= b), 0)
        assert max(ws) == want_w, (batch, ws)
    assert any(b > 6 for b, _ in seen) and any(b <= 2 for b, _ in seen)
    assert sum(stats["accept_histogram"][2:]) > 0                  # the oracle's drafts were accepted
    # control: without the schedule every pure-generation step verifies 1 + K, and more drafts
    got_plain, seen_plain, plain = run(None)
    assert got_plain == want
    assert {max(ws) for _, ws in seen_plain} != {max(ws) for _, ws in seen}
    assert plain["draft_tokens"] > stats["draft_tokens"]
