"""`trtllm-serve` in a subprocess (tiny Llama, CPU) through the official `openai` client.

Every output is compared with the same engine run offline in-process (`LLM.generate`, T=0).
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tensorrt_llm import SamplingParams

PROMPTS = ["the quick brown fox", "hello world, what is the capital of france?",
           "a paged kv cache holds keys and values", "once upon a time"]
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def offline(llm, prompt: str, max_tokens: int, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)).outputs[0]


def test_models_health_version(tiny_server, client):
    assert [m.id for m in client.models.list().data] == [tiny_server.model]
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200
    from tensorrt_llm import __version__
    assert httpx.get(f"{tiny_server.base_url}/version").json() == {"version": __version__}


def test_completions_and_chat_equal_offline_greedy(tiny_server, tiny_offline, client):
    for prompt in PROMPTS:
        want = offline(tiny_offline, prompt, 24)
        got = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body=EXTRA)
        c = got.choices[0]
        assert c.token_ids == want.token_ids and c.text == want.text and c.finish_reason == "length"
        assert got.usage.completion_tokens == 24
        assert got.usage.prompt_tokens == len(tiny_offline.tokenizer.encode(prompt))
        # the same prompt as token ids
        by_ids = client.completions.create(model=tiny_server.model, prompt=tiny_offline.tokenizer.encode(prompt),
                                           max_tokens=24, temperature=0, extra_body=EXTRA)
        assert by_ids.choices[0].token_ids == want.token_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    want = offline(tiny_offline, tiny_offline.apply_chat_template(msgs), 20)
    got = client.chat.completions.create(model=tiny_server.model, messages=msgs, max_tokens=20, temperature=0,
                                         extra_body=EXTRA)
    assert got.choices[0].token_ids == want.token_ids
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    # text parts are the same conversation
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in msgs]
    got2 = client.chat.completions.create(model=tiny_server.model, messages=parts, max_tokens=20, temperature=0,
                                          extra_body=EXTRA)
    assert got2.choices[0].token_ids == want.token_ids


def test_streaming_equals_offline_and_ends_with_usage(tiny_server, tiny_offline, client):
    for prompt in PROMPTS[:2]:
        want = offline(tiny_offline, prompt, 30)
        chunks = list(client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=30,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body=EXTRA))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        ids = [t for ch in chunks if ch.choices for t in ch.choices[0].token_ids]
        assert text == want.text and ids == want.token_ids
        assert len([ch for ch in chunks if ch.choices]) > 2          # streamed, not one chunk
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    want = offline(tiny_offline, tiny_offline.apply_chat_template(msgs), 30)
    chunks = list(client.chat.completions.create(model=tiny_server.model, messages=msgs, max_tokens=30,
                                                 temperature=0, stream=True, extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_interval_from_the_yaml_sends_fewer_chunks(tiny_llama_dir, tiny_offline, tmp_path):
    """`stream_interval: 4` in the server's YAML: a streamed completion of 30 tokens (one per step)
    arrives in 9 chunks with text (the first token at once, then 4 tokens each, the last 1) with the
    offline tokens and text; the server at the default streams one chunk per token (the test above)."""
    from server_proc import TINY_ARGS, start_server, stop_server
    server = start_server(tiny_llama_dir, {**TINY_ARGS, "stream_interval": 4}, tmp_path)
    try:
        c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        want = offline(tiny_offline, PROMPTS[0], 30)
        chunks = [ch for ch in c.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=30,
                                                    temperature=0, stream=True, extra_body=EXTRA) if ch.choices]
        assert [len(ch.choices[0].token_ids) for ch in chunks] == [1] + [4] * 7 + [1]
        assert [t for ch in chunks for t in ch.choices[0].token_ids] == want.token_ids
        assert "".join(ch.choices[0].text for ch in chunks) == want.text
    finally:
        stop_server(server)


def test_stop_strings_and_seeded_sampling(tiny_server, tiny_offline, client):
    prompt = PROMPTS[0]
    full = offline(tiny_offline, prompt, 40).text
    stop = full[len(full) // 2: len(full) // 2 + 3]       # a string the greedy text is sure to contain
    assert stop and stop in full
    want = tiny_offline.generate(prompt, SamplingParams(max_tokens=40, stop=stop)).outputs[0]
    assert stop not in want.text and want.finish_reason == "stop"
    got = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=40, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want.text
    # temperature / top_p / top_k / seed reach the engine: equal to the offline draw for that seed
    kw = dict(temperature=0.9, top_p=0.9, seed=7)
    want = offline(tiny_offline, prompt, 24, top_k=40, **kw)
    got = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=24,
                                    extra_body={**EXTRA, "top_k": 40}, **kw)
    assert got.choices[0].token_ids == want.token_ids
    other = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=24,
                                      extra_body={**EXTRA, "top_k": 40}, temperature=0.9, top_p=0.9, seed=8)
    assert other.choices[0].token_ids != want.token_ids       # control: the seed matters


def test_tokenize_detokenize_round_trip(tiny_server, tiny_offline):
    url = tiny_server.base_url
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/tokenize", json={"model": tiny_server.model, "prompt": prompt}).json()
        assert r["tokens"] == tiny_offline.tokenizer.encode(prompt) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == tiny_offline.max_seq_len
        assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": prompt}
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tiny_offline.tokenizer.encode(tiny_offline.apply_chat_template(msgs))
    r = httpx.post(f"{url}/tokenize", json={"prompt": "the fox", "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"]


BAD = [  # (path, body, param named in the error)
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "M", "prompt": "hi " * 600}, "prompt"),                    # > max_seq_len
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 600}, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 400}, "max_tokens"),   # > the KV pool
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": 3}, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "M", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [5, 512]}, "prompt"),                      # vocab is 512
    ("/v1/completions", {"model": "M", "prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "nonsense": 1}, "nonsense"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, "response_format.type"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -3]}, "tokens"),
]


def test_every_bad_request_is_a_400_naming_its_field_and_the_server_keeps_serving(tiny_server, tiny_offline):
    url, model = tiny_server.base_url, tiny_server.model
    good = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    want = offline(tiny_offline, PROMPTS[0], 8).text
    for path, body, param in BAD:
        if body.get("model") == "M":
            body = {**body, "model": model}
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (body, err)
        g = httpx.post(f"{url}/v1/completions", json=good, timeout=30)
        assert g.status_code == 200 and g.json()["choices"][0]["text"] == want
    for raw in (b'{"model": ', b"[1, 2]", b"\xff\xfe"):              # malformed JSON / not an object
        r = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    # the openai client surfaces the same error
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(
            model=model, prompt="hi", max_tokens=4, frequency_penalty=1.0)
    assert e.value.body["param"] == "frequency_penalty"
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_count_requests_and_tokens(tiny_server, client):
    before = tiny_server.metrics()
    usages = [client.completions.create(model=tiny_server.model, prompt=p, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True}).usage for p in PROMPTS]
    m = tiny_server.metrics()

    def delta(key: str) -> float:
        return m[key] - before.get(key, 0.0)

    assert delta('trtllm_requests_total{finish_reason="length"}') == len(PROMPTS)
    assert delta("trtllm_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("trtllm_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 12 * len(PROMPTS)
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"trtllm_{h}_count") == len(PROMPTS)
        assert m[f'trtllm_{h}_bucket{{le="+Inf"}}'] == m[f"trtllm_{h}_count"]
    assert m["trtllm_kv_cache_pages_total"] == 320 // 16
    assert m["trtllm_kv_cache_pages_used"] == 0 and m["trtllm_num_requests_running"] == 0
    assert 0.0 <= m["trtllm_prefix_cache_hit_rate"] <= 1.0
    assert not any(k.startswith("trtllm_spec_decode") for k in m)       # no drafter on this server


def test_soak_concurrent_requests_equal_offline_greedy(tiny_server, tiny_offline):
    n, concurrency, max_tokens = 200, 32, 16
    prompts = [PROMPTS[i % len(PROMPTS)] + " " + "abcdefghij"[: i % 10] for i in range(n)]
    want = [o.outputs[0].token_ids for o in tiny_offline.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    client = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[int]:
        async with sem:
            if i % 2:
                r = await client.completions.create(model=tiny_server.model, prompt=prompts[i], max_tokens=max_tokens,
                                                    temperature=0, extra_body=EXTRA)
                return r.choices[0].token_ids
            s = await client.completions.create(model=tiny_server.model, prompt=prompts[i], max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=EXTRA)
            return [t async for ch in s for t in ch.choices[0].token_ids]

    async def run() -> list:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)

    got = asyncio.run(run())
    failures = [g for g in got if isinstance(g, BaseException)]
    assert not failures, failures[:3]
    assert [i for i in range(n) if got[i] != want[i]] == []


def wait_idle(server, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["trtllm_num_requests_running"] == 0 and m["trtllm_kv_cache_pages_used"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"still busy after {timeout} s: running {m['trtllm_num_requests_running']}, "
                        f"pages used {m['trtllm_kv_cache_pages_used']}")
        time.sleep(0.05)


def test_disconnecting_clients_abort_their_requests_and_free_every_page(tiny_server, tiny_offline):
    n, max_tokens = 50, 120
    before = wait_idle(tiny_server)

    async def leave_early(i: int, stream: bool) -> None:
        # a non-streaming client hangs up 0.1 s after sending a 250-token request (its connect may take
        # longer on a loaded machine). The pool holds one such request at a time, and the first one
        # admitted runs alone: 250 steps took ~0.5 s in CI, so a 0.5 s hang-up raced its completion
        # (once: 49 of 50 aborted). 0.1 s is well inside 250 steps on any CPU, so the request is still
        # running when the client goes; the server submits it even if it reads it after the hang-up,
        # then sees the disconnect. A streaming client hangs up after three chunks.
        body = {"model": tiny_server.model, "prompt": PROMPTS[i % 4], "max_tokens": max_tokens if stream else 250,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=60) as c:
            if not stream:              # hang up while the request is running
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
                return
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        return          # closes the connection mid-stream

    async def run() -> None:
        await asyncio.gather(*(leave_early(i, stream=i % 3 != 0) for i in range(n)))

    asyncio.run(run())
    m = wait_idle(tiny_server, timeout=30)
    aborted = m['trtllm_requests_total{finish_reason="aborted"}'] - before['trtllm_requests_total{finish_reason="aborted"}']
    assert aborted == n
    # the engine stopped them early: >= max_tokens / 2 steps each had they run to the end (2 fit the pool)
    steps = m["trtllm_iterations_total"] - before["trtllm_iterations_total"]
    assert steps < n * max_tokens / 4
    # and the server still answers exactly
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json={
        "model": tiny_server.model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).json()
    assert r["choices"][0]["text"] == offline(tiny_offline, PROMPTS[0], 8).text


def test_a_stalled_engine_answers_completions_with_an_error_and_health_503(tiny_llama_dir):
    """The step watchdog (`step_timeout_s`) ends an engine whose step never returns (a forward
    blocked forever stands in for a GPU that never completes): the waiting completion gets a
    server error naming the stall instead of hanging, and /health turns 503 so an orchestrator
    restarts the server; /health was 200 before (control)."""
    import threading

    from fastapi.testclient import TestClient
    from server_proc import TINY_ARGS

    from tensorrt_llm import LLM
    from tensorrt_llm.serve.app import create_app

    llm = LLM(str(tiny_llama_dir), **{**TINY_ARGS, "step_timeout_s": 0.5})
    engine, gate = llm._executor.engine, threading.Event()
    forward = engine.forward
    try:
        with TestClient(create_app(llm, "tiny")) as http:
            assert http.get("/health").status_code == 200
            engine.forward = lambda *a, **k: (gate.wait(60), forward(*a, **k))[1]
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
            assert time.monotonic() - t0 < 10
            assert r.status_code >= 500 and "stalled" in r.text, (r.status_code, r.text)
            health = http.get("/health")
            assert health.status_code == 503 and "executor step stalled" in health.text
    finally:
        gate.set()
        llm.shutdown()
