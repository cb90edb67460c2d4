"""Disaggregated CTX/GEN serving on one CPU host: two worker processes + routers, KV over NIXL (UCX tcp).

(a) the pulled pages of both pools are byte-identical to the CTX pages; (b) greedy outputs through the
router (plain and streamed, completions and chat) equal aggregated `LLM.generate` (chat: on the
chat-templated prompt), and the router refuses a bad chat body with the aggregated server's 400; (c)
the acceptance histogram on GEN equals the aggregated one at GEN batch 1 and 8, and a router that
leaves the draft pool behind gives the same tokens with fewer accepted drafts (negative control); (d)
GEN killed mid-request -> an error within the timeout and CTX frees the pages; a dead GEN -> the router
releases the CTX pages itself.

Model: the tiny target of tests/unittest/tools/dspark_tiny.py with the MLA drafter trained on it
(data/tiny_dspark_mla, see its README): AL ~1.4 on its prompts, so a missing draft pool shows. The
random `tiny_drafters` accept ~1% of drafts and barely read the prompt's context.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.serve.app import parse
from tensorrt_llm.serve.errors import OpenAIError
from tensorrt_llm.serve.protocol import ChatCompletionRequest

from server_proc import free_port, spawn_cli, wait_healthy

pytest.importorskip("nixl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from dspark_tiny import PROMPTS as TEXTS  # noqa: E402
from dspark_tiny import build_tiny_target  # noqa: E402  (the drafter-training tests' tiny target)

DATA = Path(__file__).resolve().parent / "data" / "tiny_dspark_mla"
PROMPTS: list[list[int]] = json.loads((DATA / "prompts.json").read_text())

KV = {"max_tokens": 1024, "tokens_per_block": 16}
MAX_TOKENS = 24
MODEL: list[str] = []      # the served model id (the target folder), set by the cluster fixture


def _args(target: Path, drafter: str) -> dict:
    return {"device": "cpu", "kv_cache_config": KV,
            "speculative_config": {"decoding_type": "DSpark", "speculative_model": drafter}}


def _spawn(argv: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return spawn_cli([*argv, "--port", str(port)], log), f"http://127.0.0.1:{port}"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


class Cluster:
    def __init__(self, tmp: Path, target: Path, drafter: str):
        self.tmp, self.target, self.procs = tmp, target, []
        cfg = tmp / "worker.yaml"
        cfg.write_text(yaml.safe_dump(_args(target, drafter)))
        self.cfg = cfg

    def worker(self, role: str, name: str, hold_timeout: float = 60.0) -> tuple[subprocess.Popen, str, Path]:
        log = self.tmp / f"{name}.log"
        proc, url = _spawn([str(self.target), "--config", str(self.cfg), "--server_role", role, "--host",
                            "127.0.0.1", "--log_level", "warning", "--kv_hold_timeout", str(hold_timeout)], log)
        self.procs.append(proc)
        return proc, url, log

    def router(self, name: str, ctx: list[str], gen: list[str], **extra) -> tuple[subprocess.Popen, str, Path]:
        port = free_port()
        cfg = self.tmp / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "context_servers": {"urls": ctx},
                                       "generation_servers": {"urls": gen}, **extra}))
        log = self.tmp / f"{name}.log"
        proc = spawn_cli(["disaggregated", "-c", str(cfg), "--log_level", "warning"], log)
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, target):
    c = Cluster(tmp_path_factory.mktemp("disagg"), target, str(DATA))
    MODEL[:] = [str(target)]
    try:
        ctx = c.worker("context", "ctx")
        gen = c.worker("generation", "gen")
        for proc, url, log in (ctx, gen):
            wait_healthy(proc, url, log)
        routers = {"full": c.router("router", [ctx[1]], [gen[1]], request_timeout_s=20),
                   "target_only": c.router("router_t", [ctx[1]], [gen[1]], transfer_pools=["target"])}
        for proc, url, log in routers.values():
            wait_healthy(proc, url, log)
        c.ctx, c.gen = ctx[1], gen[1]
        c.routers = {k: v[1] for k, v in routers.items()}
        yield c
    finally:
        for p in c.procs:
            _kill(p)


@pytest.fixture(scope="module")
def aggregated(target):
    llm = LLM(str(target), **_args(target, str(DATA)))
    try:
        yield llm
    finally:
        llm.shutdown()


def _prompts(n: int) -> list[list[int]]:
    return PROMPTS[:n]


def _complete(url: str, prompt: list[int], stream: bool = False, max_tokens: int = MAX_TOKENS) -> list[int]:
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                assert "error" not in d, d
                ids += d["choices"][0].get("token_ids", [])
    return ids


def _events(url: str, path: str, body: dict) -> list[dict]:
    """The data chunks of a streamed reply (without [DONE])."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


def _state(url: str) -> dict:
    return httpx.get(f"{url}/disagg/state", timeout=10).json()


def _hist(url: str) -> list[int]:
    return _state(url)["speculative"]["accept_histogram"]


def _agg_hist(llm: LLM, prompts: list[list[int]], one_by_one: bool) -> tuple[list[list[int]], list[int]]:
    llm.reset_speculative_stats()
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = [llm.generate(x, p) for x in prompts] if one_by_one else llm.generate(prompts, p)
    return [o.outputs[0].token_ids for o in outs], llm.get_stats()["speculative"]["accept_histogram"]


def _wait_idle(url: str, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        s = _state(url)
        if not s["held"] and s["kv_active_sequences"] == 0:
            return s
        if time.monotonic() > end:
            raise AssertionError(f"{url} still holds KV: {s['held']}, {s['kv_active_sequences']} sequences")
        time.sleep(0.05)


def test_pages_byte_identical(cluster, aggregated):
    prompt = _prompts(3)[2]
    c = httpx.post(f"{cluster.ctx}/disagg/context", timeout=60, json={
        "request": {"model": MODEL[0], "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, "kv_digest": True})
    assert c.status_code == 200, c.text
    ctx = c.json()
    assert ctx["finish_reason"] == "context" and ctx["draft_tokens"] and ctx["pages"]
    g = httpx.post(f"{cluster.gen}/disagg/generation", timeout=60, json={
        "request": {"model": MODEL[0], "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}, "ctx": {**ctx, "url": cluster.ctx}})
    assert g.status_code == 200, g.text
    rec = [t for t in _state(cluster.gen)["transfers"] if t["ctx_request_id"] == ctx["ctx_request_id"]][-1]
    assert sorted(rec["digest"]) == ["draft", "target"]
    assert rec["digest"] == ctx["digest"]
    assert sorted(rec["pool_bytes"]) == ["draft", "target"] and sum(rec["pool_bytes"].values()) == rec["bytes"]
    assert rec["bytes"] > 0 and len(rec["pages"]) == len(ctx["pages"]) == -(-len(prompt) // KV["tokens_per_block"])
    want = aggregated.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert g.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids
    _wait_idle(cluster.ctx)


def test_router_greedy_equals_aggregated(cluster, aggregated):
    prompts = _prompts(4)
    want, _ = _agg_hist(aggregated, prompts, one_by_one=True)
    url = cluster.routers["full"]
    assert [_complete(url, p) for p in prompts] == want
    assert [_complete(url, p, stream=True) for p in prompts] == want
    _wait_idle(cluster.ctx)


CHATS = [[{"role": "user", "content": TEXTS[5]}],
         [{"role": "system", "content": TEXTS[3]}, {"role": "user", "content": TEXTS[1]}]]


@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, 1])        # 1: the request ends on CTX
def test_router_chat_equals_aggregated(cluster, aggregated, max_tokens):
    url = cluster.routers["full"]
    for messages in CHATS:
        ids = aggregated.tokenizer.encode(aggregated.apply_chat_template(messages))
        want = aggregated.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        want_ids, want_text = want.outputs[0].token_ids, want.outputs[0].text
        body = {"model": MODEL[0], "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
        choice = got["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want_text}
        assert choice["token_ids"] == want_ids and got["prompt_token_ids"] == ids
        assert choice["finish_reason"] == "length"
        assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": max_tokens,
                                "total_tokens": len(ids) + max_tokens}
        chunks = _events(url, "/v1/chat/completions",
                         {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        steps = [c["choices"][0] for c in chunks if c["choices"]]
        assert "".join(s["delta"].get("content", "") for s in steps) == want_text
        assert [t for s in steps for t in s["token_ids"]] == want_ids
        assert steps[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == max_tokens
    _wait_idle(cluster.ctx)


def test_router_chat_refusals_and_model_card(cluster):
    """The router refuses what the aggregated server refuses, with its 400 body; /v1/models and /tokenize
    come from a worker."""
    url = cluster.routers["full"]
    ok = {"model": MODEL[0], "messages": CHATS[0], "max_tokens": 4}
    params = []
    for bad in ({**ok, "logprobs": True}, {**ok, "n": 2}, {**ok, "messages": []}, {**ok, "bogus": 1},
                {**ok, "max_tokens": 4, "max_completion_tokens": 4}):
        with pytest.raises(OpenAIError) as want:
            parse(ChatCompletionRequest, bad)
        r = httpx.post(f"{url}/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json() == want.value.body(), r.text
        params.append(r.json()["error"]["param"])
    assert params == ["logprobs", "n", "messages", "bogus", "max_completion_tokens"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**ok, "model": "other"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL[0] and card["max_model_len"] > 0
    tok = [httpx.post(f"{u}/tokenize", json={"messages": CHATS[0]}, timeout=30).json() for u in (url, cluster.ctx)]
    assert tok[0] == tok[1] and tok[0]["count"] > 0
    _wait_idle(cluster.ctx)


def test_bench_client_through_router(cluster, tmp_path):
    """`trtllm-bench --backend openai` (streamed chat) against the router: the model card and /tokenize come
    from a worker; the router has no /metrics (no AL), `--metrics-url` reads the GEN worker's."""
    from tensorrt_llm.bench import benchmark as bm
    argv = ["--backend", "openai", "--base-url", cluster.routers["full"], "--num-requests", "4", "--concurrency", "2",
            "--max-tokens", "24", "--ignore-eos"]
    als = []
    for extra in ([], ["--metrics-url", cluster.gen]):
        out = tmp_path / f"bench{len(als)}.json"
        assert bm.main([*argv, *extra, "--json", str(out)]) == 0
        row = json.loads(out.read_text())["results"][0]
        assert row["failures"] == 0, row["first_error"]
        assert row["output_tokens"] == 4 * 24
        als.append(row["acceptance_length"])
    # (the default prompts are not the drafter's training chats: it accepts ~nothing on them)
    assert als[0] is None and als[1] is not None and als[1] >= 1.0
    _wait_idle(cluster.ctx)


@pytest.mark.parametrize("batch", [1, 8])
def test_acceptance_on_gen_equals_aggregated(cluster, aggregated, batch):
    prompts = _prompts(8)
    want, agg = _agg_hist(aggregated, prompts, one_by_one=batch == 1)

    def run(router: str) -> tuple[list[list[int]], list[int]]:
        before = _hist(cluster.gen)
        with cf.ThreadPoolExecutor(batch) as pool:
            got = list(pool.map(lambda p: _complete(cluster.routers[router], p), prompts))
        return got, [a - b for a, b in zip(_hist(cluster.gen), before)]

    got, hist = run("full")
    assert got == want
    assert hist == agg and sum(hist[1:]) > 0          # some drafts accepted: AL > 1
    got_t, hist_t = run("target_only")                # negative control: no draft-context KV moved
    assert got_t == want
    accepted = lambda h: sum(i * n for i, n in enumerate(h))
    assert accepted(hist_t) < accepted(hist), (hist_t, hist)
    _wait_idle(cluster.ctx)


def test_layout_mismatch_refused_at_first_contact(cluster, target, tmp_path):
    """A CTX worker with another tokens_per_block: GEN refuses it with a 400 naming the key."""
    other = Cluster(tmp_path, target, str(DATA))
    args = _args(target, str(DATA))
    args["kv_cache_config"] = {**KV, "tokens_per_block": 32}
    other.cfg.write_text(yaml.safe_dump(args))
    try:
        proc, url, log = other.worker("context", "ctx_tpb32")
        wait_healthy(proc, url, log)
        fake = {"url": url, "agent_name": "?", "ctx_request_id": 0, "pages": [0], "first_token": 5}
        r = httpx.post(f"{cluster.gen}/disagg/generation", timeout=30, json={
            "request": {"model": MODEL[0], "prompt": PROMPTS[0], "max_tokens": 4}, "ctx": fake})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "does not match" in msg and "tokens_per_block: here 16, peer 32" in msg, msg
    finally:
        for p in other.procs:
            _kill(p)


def test_gen_dies_mid_request(cluster):
    proc, gen_url, log = cluster.worker("generation", "gen_fault")
    wait_healthy(proc, gen_url, log)
    rproc, router, rlog = cluster.router("router_fault", [cluster.ctx], [gen_url], request_timeout_s=10)
    wait_healthy(rproc, router, rlog)
    body = {"model": MODEL[0], "prompt": _prompts(1)[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = None
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:                       # GEN has pulled the KV and streams tokens
            if line.startswith("data: "):
                break
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert time.monotonic() - t0 < 15
    assert any("error" in json.loads(ln[6:]) for ln in rest if ln != "data: [DONE]"), rest
    _wait_idle(cluster.ctx)
    # the GEN worker is gone: the router fails the request at once and frees the CTX pages itself
    r = httpx.post(f"{router}/v1/completions", json={**body, "stream": False, "max_tokens": 8}, timeout=30)
    assert r.status_code == 502 and "generation worker" in r.json()["error"]["message"]
    _wait_idle(cluster.ctx)


def test_ctx_unreachable_fails_fast(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    proc, router, log = cluster.router("router_dead_ctx", [dead], [cluster.gen], request_timeout_s=10)
    end = time.monotonic() + 60
    while True:                     # the router is up once it answers (its /health is 503: no CTX)
        try:
            if httpx.get(f"{router}/health", timeout=2).status_code == 503:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < end and proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    t0 = time.monotonic()
    r = httpx.post(f"{router}/v1/completions", timeout=30,
                   json={"model": MODEL[0], "prompt": PROMPTS[0], "max_tokens": 4})
    assert r.status_code == 502 and "context worker" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
