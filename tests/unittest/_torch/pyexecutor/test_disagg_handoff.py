"""The executor's disaggregated path without a network: a context-only request on one LLM, its pages
copied by a local `pull` into a `prefilled` request on another LLM. Tokens and the acceptance histogram
equal the aggregated run; held pages go back on `release_kv`; a failing pull fails that request alone;
without the draft pool's pages the tokens stay and the accepted drafts drop (negative control)."""
from __future__ import annotations

import time

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.runtime.llm_request import PrefilledKV

KV = {"max_tokens": 1024, "tokens_per_block": 16}
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _llm(target, drafter) -> LLM:
    return LLM(str(target), device="cpu", kv_cache_config=KV,
               speculative_config={"decoding_type": "DSpark", "speculative_model": drafter})


def _wait(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def _handoff(ctx: LLM, gen: LLM, prompt: list[int], pools=("target", "draft"), fail: bool = False):
    out = ctx.generate_async(prompt, PARAMS, context_only=True).result()
    assert out.outputs[0].finish_reason == "context"
    kv_c, kv_g = ctx._bundle.kv, gen._bundle.kv
    src = kv_c.request_pages(out.request_id)[:kv_c.pages_for(len(prompt))]

    def pull(first_block: int, pages: list[int]) -> None:
        if fail:
            raise RuntimeError("transfer failed")
        s = torch.tensor(src[first_block:first_block + len(pages)])
        for name in kv_g.pools:
            kv_g.pools[name][:, torch.tensor(pages)] = kv_c.pools[name][:, s] if name in pools else 0

    d = out.disaggregated_params
    handle = gen.generate_async(prompt, PARAMS, prefilled=PrefilledKV(d["first_token"], tuple(d["draft_tokens"]),
                                                                      pull))
    res = handle.result()
    ctx.release_kv(out.request_id)
    return res


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_drafters):
    llms = [_llm(tiny_llama_dir, tiny_drafters["mla"]) for _ in range(3)]
    try:
        yield llms
    finally:
        for llm in llms:
            llm.shutdown()


def _prompts():
    return [[(5 * i + 11 * j) % 500 + 4 for j in range(19 + 4 * i)] for i in range(4)]


def test_handoff_equals_aggregated(engines):
    agg, ctx, gen = engines
    agg.reset_speculative_stats()
    gen.reset_speculative_stats()
    for p in _prompts():
        want = agg.generate(p, PARAMS).outputs[0]
        got = _handoff(ctx, gen, p).outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert gen.get_stats()["speculative"]["accept_histogram"] == agg.get_stats()["speculative"]["accept_histogram"]
    _wait(lambda: not ctx._bundle.kv.seqs and not gen._bundle.kv.seqs)      # held pages released


def test_failed_pull_fails_that_request_only(engines):
    agg, ctx, gen = engines
    p = _prompts()[1]
    bad = _handoff(ctx, gen, p, fail=True).outputs[0]
    assert bad.finish_reason == "error" and "transfer failed" in bad.error
    assert _handoff(ctx, gen, p).outputs[0].token_ids == agg.generate(p, PARAMS).outputs[0].token_ids
    _wait(lambda: not ctx._bundle.kv.seqs and not gen._bundle.kv.seqs)


def test_context_only_reserves_prompt_only(engines):
    """Three held requests whose prompt + max_tokens (3 x ~500 tokens) would not fit the 1024-token pool
    together: a context-only request reserves its prompt and one draft block only."""
    _, ctx, _ = engines
    params = SamplingParams(max_tokens=480, ignore_eos=True)
    res = [h.result() for h in [ctx.generate_async(p, params, context_only=True) for p in _prompts()[:3]]]
    assert all(r.outputs[0].finish_reason == "context" and len(r.outputs[0].token_ids) == 1 for r in res)
    assert ctx._executor.scheduler.held == {r.request_id for r in res}
    for r in res:
        ctx.release_kv(r.request_id)
    ctx.release_kv(res[0].request_id)          # idempotent
    _wait(lambda: not ctx._bundle.kv.seqs and not ctx._executor.scheduler.held)
