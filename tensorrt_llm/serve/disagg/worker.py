"""The routes a `trtllm-serve --server_role context|generation` worker adds to the OpenAI app.

    GET  /disagg/info          role, model / drafter identity, KV layout, NIXL agent metadata
    GET  /disagg/state         held context requests and the last 512 transfers (pages, bytes in all and
                               per pool, seconds, digests when asked)
    POST /disagg/context       CTX: {"request": <body>, "api": "completions"|"chat", "kv_digest": bool}
                               -> prefill only; the pages stay held until /disagg/release (or
                               hold_timeout_s)
    POST /disagg/release       CTX: {"ctx_request_id": N} (idempotent)
    POST /disagg/generation    GEN: {"request": <body>, "api": ..., "ctx": <the /disagg/context reply
                               + "url">} -> the OpenAI reply of that api (SSE with stream=true); the KV
                               of both pools is pulled over NIXL at admission, then GEN releases it on CTX

`request` is the body of POST /v1/completions ("api": "completions", the default) or of
/v1/chat/completions ("chat"), validated with the aggregated server's request models; the chat
template is applied by each worker (the same checkpoint: the identity check below).

At its first contact with a CTX worker, GEN compares model, drafter and KV layout (pool shapes,
dtypes, tokens_per_block) and refuses a mismatch with a 400 that names the difference.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...llmapi import LLM
from ..._torch.runtime.llm_request import PrefilledKV
from ..app import parse, read_json
from ..errors import OpenAIError
from ..protocol import GENERATION_APIS, ChatCompletionRequest, CompletionRequest
from .transfer import KVTransferAgent, layout_of, pages_digest

logger = logging.getLogger("tensorrt_llm")

Role = Literal["context", "generation"]


def identity_of(llm: LLM) -> dict[str, Any]:
    """Model and drafter identity: the checkpoint's config.json hash and the drafter's own identity."""
    cfg = Path(llm.args.model).expanduser() / "config.json"
    drafter = llm._executor.drafter
    return {"model": hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else str(llm.args.model),
            "drafter": getattr(drafter, "identity", None) if drafter is not None else None,
            "max_draft_len": drafter.max_draft_len if drafter is not None else 0}


def mismatch(mine: dict[str, Any], theirs: dict[str, Any], path: str = "") -> Optional[str]:
    """The first key whose values differ, as `key: here X, peer Y` (None when they agree)."""
    keys = set(mine) | set(theirs)     # plain values first: `tokens_per_block` before the shapes it implies
    for k in sorted(keys, key=lambda k: (isinstance(mine.get(k), dict), k)):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            d = mismatch(a, b, f"{path}{k}.")
            if d:
                return d
        elif a != b:
            return f"{path}{k}: here {a!r}, peer {b!r}"
    return None


def parse_request(body: Any) -> CompletionRequest | ChatCompletionRequest:
    """The worker payload's `request`, as the model of its `api` (400 naming a bad field)."""
    if not isinstance(body, dict):
        raise OpenAIError(f"request body must be a JSON object, got {type(body).__name__}", param="body")
    api = body.get("api", "completions")
    if api not in GENERATION_APIS:
        raise OpenAIError(f"api must be one of {sorted(GENERATION_APIS)}, got {api!r}", param="api")
    return parse(GENERATION_APIS[api], body.get("request"))


class DisaggWorker:
    """One worker's disaggregated state: its NIXL agent, held CTX requests, known CTX peers."""

    def __init__(self, llm: LLM, role: Role, hold_timeout_s: float = 60.0, http_timeout_s: float = 10.0):
        self.llm, self.role = llm, role
        kv = llm._bundle.kv
        self.kv = kv
        self.agent = KVTransferAgent(kv.pools, kv.tokens_per_block, role)
        self.identity = identity_of(llm)
        self.layout = layout_of(kv.pools, kv.tokens_per_block)
        self.hold_timeout_s, self.http_timeout_s = hold_timeout_s, http_timeout_s
        self.held: dict[int, float] = {}                 # CTX: request id -> monotonic time held since
        self.peers: dict[str, str] = {}                  # GEN: CTX url -> its agent name
        self.transfers: deque[dict[str, Any]] = deque(maxlen=512)
        self._releaser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="disagg-release")

    def info(self) -> dict[str, Any]:
        return {"role": self.role, "identity": self.identity, **self.agent.metadata()}

    # ---- CTX ---------------------------------------------------------------------------
    async def context(self, body: Any) -> dict[str, Any]:
        serving = self.llm_serving
        req = parse_request(body)
        req = req.model_copy(update={"stream": False, "stream_options": None})
        ids, handle = serving.submit(req, context_only=True)
        try:
            out = await handle.aresult()
        finally:
            serving.metrics.running.dec()
        c = out.outputs[0]
        reply: dict[str, Any] = {"ctx_request_id": out.request_id, "finish_reason": c.finish_reason,
                                 "text": c.text, "token_ids": list(c.token_ids), "prompt_token_ids": ids,
                                 "agent_name": self.agent.name}
        if c.finish_reason == "error":
            raise OpenAIError(f"context phase failed: {c.error}", status=500, type_="server_error")
        if c.finish_reason == "context":
            self.held[out.request_id] = time.monotonic()
            await asyncio.to_thread(self.agent.wait_device)     # the prefill's KV is written before GEN reads it
            pages = self.kv.request_pages(out.request_id)[:self.kv.pages_for(len(ids))]
            reply.update(out.disaggregated_params, pages=pages)
            if body.get("kv_digest"):
                reply["digest"] = pages_digest(self.kv.pools, pages)
        return reply

    def release(self, rid: int) -> None:
        if self.held.pop(rid, None) is not None:
            self.llm.release_kv(rid)

    async def expire_held(self) -> None:
        """Release what no GEN worker pulled within hold_timeout_s (GEN and router both gone)."""
        while True:
            await asyncio.sleep(min(1.0, self.hold_timeout_s / 4))
            now = time.monotonic()
            for rid, since in list(self.held.items()):
                if now - since > self.hold_timeout_s:
                    logger.warning("context request %d: no GEN pull within %.0f s; pages freed", rid,
                                   self.hold_timeout_s)
                    self.release(rid)

    # ---- GEN ---------------------------------------------------------------------------
    async def handshake(self, url: str) -> str:
        """Agent name of the CTX worker at `url`, after checking that it agrees with this worker."""
        async with httpx.AsyncClient(timeout=self.http_timeout_s) as client:
            try:
                r = await client.get(f"{url}/disagg/info")
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise OpenAIError(f"context worker {url} unreachable: {e}", status=502, type_="server_error") from e
        meta = r.json()
        for what, mine, theirs in (("identity", self.identity, meta.get("identity", {})),
                                   ("KV layout", self.layout, meta.get("layout", {}))):
            diff = mismatch(mine, theirs)
            if diff:
                raise OpenAIError(f"context worker {url} does not match this generation worker ({what} {diff})",
                                  param="ctx", code="disagg_mismatch")
        if meta.get("role") != "context":
            raise OpenAIError(f"{url} is a {meta.get('role')!r} worker, not a context worker", param="ctx")
        try:
            self.agent.add_peer(meta)
        except ValueError as e:          # VRAM on one side, DRAM on the other
            raise OpenAIError(f"context worker {url} does not match this generation worker ({e})",
                              param="ctx", code="disagg_mismatch") from e
        self.peers[url] = meta["agent_name"]
        return meta["agent_name"]

    def _release_on_ctx(self, url: str, rid: int) -> None:
        try:
            httpx.post(f"{url}/disagg/release", json={"ctx_request_id": rid}, timeout=self.http_timeout_s)
        except httpx.HTTPError as e:      # CTX gone: its own hold timeout frees the pages
            logger.warning("release of context request %d on %s failed: %s", rid, url, e)

    def prefilled(self, ctx: dict[str, Any], agent: str) -> PrefilledKV:
        url, rid, remote = ctx["url"], int(ctx["ctx_request_id"]), [int(p) for p in ctx["pages"]]
        pools = ctx.get("pools")

        def pull(first_block: int, pages: list[int]) -> None:   # on the executor thread
            try:
                stats = self.agent.pull(agent, remote[first_block:first_block + len(pages)], pages, pools)
            except Exception:
                self.agent.forget_peer(agent)      # a restarted CTX gets a fresh handshake
                self.peers.pop(url, None)
                raise
            finally:
                self._releaser.submit(self._release_on_ctx, url, rid)
            record = {"ctx_url": url, "ctx_request_id": rid, "first_block": first_block, "pages": pages,
                      "pools": pools or sorted(self.kv.pools), **stats}
            if ctx.get("digest") is not None:
                record["digest"] = pages_digest(self.kv.pools, pages)
            self.transfers.append(record)

        return PrefilledKV(int(ctx["first_token"]), tuple(int(t) for t in ctx.get("draft_tokens", ())), pull)

    async def generation(self, body: Any, http: Request) -> Response:
        req = parse_request(body)
        ctx = body.get("ctx")
        if not isinstance(ctx, dict) or not {"url", "ctx_request_id", "pages", "first_token"} <= set(ctx):
            raise OpenAIError("`ctx` must be the /disagg/context reply plus `url`", param="ctx")
        agent = self.peers.get(ctx["url"])
        if agent is None or agent != ctx.get("agent_name"):     # first contact, or CTX restarted
            agent = await self.handshake(ctx["url"])
        serving = self.llm_serving
        pre = self.prefilled(ctx, agent)
        if req.stream:
            return StreamingResponse(serving.stream(req, prefilled=pre), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await serving.respond(req, http, prefilled=pre))

    @property
    def llm_serving(self):
        return self.app.state.serving

    def state(self) -> dict[str, Any]:
        return {"role": self.role, "held": sorted(self.held), "transfers": list(self.transfers),
                "kv_active_sequences": len(self.kv.seqs), "speculative": self.llm.get_stats().get("speculative")}


def add_disagg_routes(app: FastAPI, llm: LLM, role: Role, hold_timeout_s: float = 60.0) -> DisaggWorker:
    """Attach the worker routes of `role` to the app `create_app(llm, ...)` made."""
    w = DisaggWorker(llm, role, hold_timeout_s)
    w.app = app

    @app.get("/disagg/info")
    async def info() -> dict[str, Any]:
        return w.info()

    @app.get("/disagg/state")
    async def state() -> dict[str, Any]:
        return w.state()

    if role == "context":
        @app.on_event("startup")
        async def _start_expiry() -> None:
            app.state.expiry = asyncio.create_task(w.expire_held())

        @app.post("/disagg/context")
        async def context(request: Request) -> dict[str, Any]:
            return await w.context(await read_json(request))

        @app.post("/disagg/release")
        async def release(request: Request) -> dict[str, Any]:
            body = await read_json(request)
            w.release(int(body.get("ctx_request_id", -1)))
            return {"released": True}
    else:
        @app.post("/disagg/generation")
        async def generation(request: Request) -> Response:
            return await w.generation(await read_json(request), request)
    return w
