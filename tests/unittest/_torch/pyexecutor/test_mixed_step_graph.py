"""The one-graph DSpark step with arriving prompts in its forward (`pyexecutor/mixed_step_graph.py`), on
the CPU reference path (the same step run directly). Its lossless runs with staggered arrivals, their
negative controls and fault isolation: test_arrival_drafts.py and test_fault_isolation.py."""
from __future__ import annotations

import random

import pytest

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.mixed_step_graph import MAX_PROMPTS, PROMPT_TOKEN_BUCKETS, MixedSpecGraph
from tensorrt_llm._torch.runtime.llm_request import LlmRequest
from tensorrt_llm._torch.runtime.step import ForwardSegment

from tests.unittest._torch.pyexecutor.spec_runs import dspark_spec, generate_run, random_prompts


def _prompt(rid: int, n: int, ends: bool = True, **params) -> tuple[LlmRequest, ForwardSegment]:
    req = LlmRequest(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=8, **params))
    return req, ForwardSegment(rid, req.prompt_token_ids, 0, 1 if ends else 0)


def test_takes_only_prompt_ends_of_greedy_requests_that_fit(make_llm, tiny_llama_dir, tiny_drafters):
    """Prompts it takes: every chunk ends its prompt, greedy, not context-only, at most MAX_PROMPTS;
    a captured graph also pads their tokens to a bucket (none past the largest). Anything else is
    declined (None): those prompts run beside the one-graph step."""
    llm = make_llm(tiny_llama_dir, speculative_config=dspark_spec(tiny_drafters["gqa"]))
    mixed: MixedSpecGraph = llm._executor.engine.mixed_step
    assert isinstance(mixed, MixedSpecGraph) and not mixed.capture
    assert "ride in its forward" in llm.capacity_report["one_graph_step"]["prompts"]
    # only overlapped steps continue running requests beside arrivals: without overlap it is not built
    plain = make_llm(tiny_llama_dir, speculative_config=dspark_spec(tiny_drafters["gqa"]),
                     disable_overlap_scheduler=True)
    assert plain._executor.engine.mixed_step is None
    assert "overlap scheduler is off" in plain.capacity_report["one_graph_step"]["prompts"]

    def fit(*items):
        return mixed._prompts_fit([r for r, _ in items], [s for _, s in items])
    assert fit(_prompt(1, 5), _prompt(2, 7)) == 12                      # a direct run: the tokens as they are
    assert fit(_prompt(1, 5), _prompt(2, 7, temperature=0.8)) is None   # a sampling request
    assert fit(_prompt(1, 5, ends=False)) is None                       # a chunk that does not end its prompt
    ctx, seg = _prompt(1, 5)
    ctx.context_only = True
    assert fit((ctx, seg)) is None                                      # disaggregated CTX: read on its own
    assert fit(*[_prompt(i, 2) for i in range(MAX_PROMPTS)]) == 2 * MAX_PROMPTS
    assert fit(*[_prompt(i, 2) for i in range(MAX_PROMPTS + 1)]) is None
    mixed.capture = True                                                # a captured graph's buckets
    try:
        assert fit(_prompt(1, 5), _prompt(2, 7)) == PROMPT_TOKEN_BUCKETS[0]
        assert fit(_prompt(1, PROMPT_TOKEN_BUCKETS[0] + 1)) == PROMPT_TOKEN_BUCKETS[1]
        assert fit(_prompt(1, PROMPT_TOKEN_BUCKETS[-1] + 1)) is None
    finally:
        mixed.capture = False


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_sampling_arrivals_run_beside_and_greedy_ones_inside(make_llm, tiny_llama_dir, tiny_drafters, kind):
    """Staggered arrivals, every third one sampling: steps whose arrivals are all greedy take them into the
    one-graph step, the others run them beside it; both kinds of step are seen, and every greedy output
    equals no-spec greedy token for token (the sampled ones end with their max_tokens)."""
    rng = random.Random(13)
    prompts = random_prompts(rng, 30)
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True, temperature=0.9 if i % 3 == 0 else 0.0,
                             seed=i) for i in range(len(prompts))]
    greedy = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    want, _, _ = generate_run(make_llm, tiny_llama_dir, prompts, greedy, overlap=False)
    got, stats, _ = generate_run(make_llm, tiny_llama_dir, prompts, params, True, tiny_drafters[kind],
                                 max_batch_size=4)
    steps = stats["steps"]
    assert steps["one_graph_with_prompts"] > 0 and steps["prompts_beside_one_graph"] > 0, steps
    for g, w, p in zip(got, want, params):
        if p.greedy:
            assert g == w
        else:
            assert len(g) == p.max_tokens
