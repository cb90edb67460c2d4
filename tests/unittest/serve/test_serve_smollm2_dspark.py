"""`trtllm-serve` with the real SmolLM2-135M-Instruct and the shipped MLA drafter (CPU): the served
tokens equal offline `LLM.generate`, and /metrics reports the same acceptance as `llm.get_stats()`."""
from __future__ import annotations

import openai
import pytest

from tensorrt_llm import SamplingParams

from server_proc import REPO_ROOT, start_server, stop_server

ARGS = {"device": "cpu", "max_seq_len": 1024, "kv_cache_config": {"max_tokens": 4096, "tokens_per_block": 32},
        "speculative_config": {"decoding_type": "DSpark",
                               "speculative_model": str(REPO_ROOT / "examples/models/smollm2-135m-dspark-mla")}}
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(real_model, tmp_path_factory):
    s = start_server(real_model, ARGS, tmp_path_factory.mktemp("serve_smollm2"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def offline(real_model):
    from tensorrt_llm import LLM

    llm = LLM(str(real_model), **ARGS)
    yield llm
    llm.shutdown()


def spec_metrics(m: dict[str, float], k: int) -> dict:
    name = "trtllm_spec_decode_acceptance_length_per_step_bucket"
    cum = [m[f'{name}{{le="{i + 1}.0"}}'] for i in range(k + 1)]
    return {"hist": [int(c - p) for c, p in zip(cum, [0.0] + cum[:-1])],
            "steps": m["trtllm_spec_decode_num_drafts_total"],
            "accepted": m["trtllm_spec_decode_num_accepted_tokens_total"],
            "draft_tokens": m["trtllm_spec_decode_num_draft_tokens_total"],
            "al": m["trtllm_spec_decode_acceptance_length"]}


def test_served_tokens_and_acceptance_equal_offline(server, offline):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    extra = {"return_token_ids": True}
    # one request at a time on both sides: the same batches, so the same numerics and drafts
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        want = offline.generate(offline.apply_chat_template(msgs), params).outputs[0]
        if i == 1:
            chunks = list(client.chat.completions.create(model=server.model, messages=msgs, max_tokens=MAX_TOKENS,
                                                         temperature=0, stream=True, extra_body=extra))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            ids = [t for ch in chunks for t in ch.choices[0].token_ids]
            assert chunks[-1].choices[0].finish_reason == want.finish_reason
        else:
            r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body=extra)
            text, ids = r.choices[0].message.content, r.choices[0].token_ids
            assert r.choices[0].finish_reason == want.finish_reason
        assert ids == want.token_ids and text == want.text
    want = offline.generate("The three primary colors are", params).outputs[0]
    r = client.completions.create(model=server.model, prompt="The three primary colors are", max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body=extra)
    assert r.choices[0].token_ids == want.token_ids and r.choices[0].text == want.text

    stats = offline.get_stats()["speculative"]
    got = spec_metrics(server.metrics(), len(stats["accept_histogram"]) - 1)
    assert got["hist"] == stats["accept_histogram"] and sum(got["hist"]) > 0
    assert got["steps"] == stats["request_steps"] and got["accepted"] == stats["accepted_tokens"]
    assert got["draft_tokens"] == stats["draft_tokens"]
    assert got["al"] == pytest.approx(stats["acceptance_length"], abs=1e-12) and got["al"] > 1.0
