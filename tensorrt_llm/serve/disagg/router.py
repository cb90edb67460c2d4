"""`trtllm-serve disaggregated -c disagg.yaml`: the router in front of CTX and GEN workers.

    POST /v1/completions        CTX /disagg/context (prefill: first token + first drafts, pages held),
    POST /v1/chat/completions   then GEN /disagg/generation (pulls both pools' pages, decodes); streamed
                                through when stream=true. The body is validated here with the
                                aggregated server's request models (the same 400s); the workers apply
                                the chat template, so replies equal the aggregated server's.
    GET  /v1/models             answered by the first CTX worker that answers (all workers serve one
    POST /tokenize, /detokenize model: GEN checks it at first contact)
    GET  /health                200 when at least one CTX and one GEN worker answer /health

Faults: a worker that cannot be reached, or a GEN worker that sends nothing for
`request_timeout_s`, ends that request with an OpenAI error (502 / an SSE error chunk); the router
then releases the CTX pages itself (idempotent with GEN's own release after its pull). A worker that
comes back at the same URL is used again (no state is kept about it besides its load).
"""
from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Optional

import httpx
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..app import KEEP_ALIVE_S, parse, read_json
from ..errors import OpenAIError
from ..protocol import GENERATION_APIS, ChatCompletionRequest, CompletionRequest
from ..serving import ChunkWriter, response_body, sse

logger = logging.getLogger("tensorrt_llm")


class WorkerGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    urls: list[str] = Field(min_length=1, description="worker base URLs, e.g. http://host:8001")


class DisaggConfig(BaseModel):
    """disagg.yaml (TensorRT-LLM's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hostname: str = Field("localhost", description="address the router binds")
    port: int = Field(8000, ge=0, lt=65536, description="port the router binds")
    context_servers: WorkerGroup = Field(description="CTX workers (trtllm-serve --server_role context)")
    generation_servers: WorkerGroup = Field(description="GEN workers (trtllm-serve --server_role generation)")
    router: Literal["round_robin", "least_loaded"] = Field("least_loaded", description="worker choice")
    request_timeout_s: float = Field(60.0, gt=0, description="longest wait for a worker's next byte")
    transfer_pools: Optional[list[Literal["target", "draft"]]] = Field(
        None, description="diagnostic: the KV pools GEN pulls (default all; ['target'] leaves the "
                          "drafter's context KV behind, the acceptance-length negative control)")

    @classmethod
    def from_yaml(cls, path: str) -> "DisaggConfig":
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a disaggregated config is a YAML mapping, got {type(data).__name__}")
        return cls.model_validate(data)


class _Pool:
    """Round robin or least loaded (fewest requests in flight, ties in round-robin order)."""

    def __init__(self, urls: list[str], policy: str):
        self.urls, self.policy = [u.rstrip("/") for u in urls], policy
        self.load = {u: 0 for u in self.urls}
        self._rr = itertools.cycle(range(len(self.urls)))

    def pick(self) -> str:
        start = next(self._rr)
        order = self.urls[start:] + self.urls[:start]
        return order[0] if self.policy == "round_robin" else min(order, key=lambda u: self.load[u])


def _error(message: str, status: int = 502) -> OpenAIError:
    return OpenAIError(message, status=status, type_="server_error")


def create_router_app(cfg: DisaggConfig) -> FastAPI:
    app = FastAPI(title="trtllm-serve disaggregated")
    ctx_pool = _Pool(cfg.context_servers.urls, cfg.router)
    gen_pool = _Pool(cfg.generation_servers.urls, cfg.router)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(5.0, cfg.request_timeout_s))
    client = httpx.AsyncClient(timeout=timeout)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.on_event("shutdown")
    async def _close() -> None:
        await client.aclose()

    @app.get("/health")
    async def health() -> Response:
        for pool in (ctx_pool, gen_pool):
            ok = False
            for u in pool.urls:
                try:
                    ok = (await client.get(f"{u}/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    continue
                if ok:
                    break
            if not ok:
                return JSONResponse(_error("no healthy worker in " + ", ".join(pool.urls), 503).body(),
                                    status_code=503)
        return Response(status_code=200)

    async def release(ctx_url: str, rid: int) -> None:
        try:
            await client.post(f"{ctx_url}/disagg/release", json={"ctx_request_id": rid}, timeout=5.0)
        except httpx.HTTPError as e:      # CTX gone: nothing is held any more
            logger.warning("release of %d on %s failed: %s", rid, ctx_url, e)

    async def context_phase(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        url = ctx_pool.pick()
        ctx_pool.load[url] += 1
        try:
            r = await client.post(f"{url}/disagg/context", json=payload)
        except httpx.HTTPError as e:
            raise _error(f"context worker {url} failed: {type(e).__name__}: {e}") from e
        finally:
            ctx_pool.load[url] -= 1
        if r.status_code != 200:
            raise _passthrough(r)
        return url, r.json()

    async def on_ctx_worker(method: str, path: str, body: Any = None) -> Response:
        """The first CTX worker that answers, as it answered (model card, tokenizer routes)."""
        errors = []
        for url in ctx_pool.urls:
            try:
                r = await client.request(method, f"{url}{path}", json=body)
            except httpx.HTTPError as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        raise _error("no context worker answered " + path + ": " + "; ".join(errors))

    @app.get("/v1/models")
    async def models() -> Response:
        return await on_ctx_worker("GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await on_ctx_worker("POST", "/tokenize", await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await on_ctx_worker("POST", "/detokenize", await read_json(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("completions", await read_json(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate("chat", await read_json(request))

    async def generate(api: str, body: Any) -> Response:
        req = parse(GENERATION_APIS[api], body)
        ctx_url, c = await context_phase({"request": body, "api": api})
        if c["finish_reason"] != "context":          # ended at its first token (stop / max_tokens 1)
            return _finished_on_ctx(req, c)
        ctx = {**c, "url": ctx_url}
        if cfg.transfer_pools is not None:
            ctx["pools"] = list(cfg.transfer_pools)
        gen_url = gen_pool.pick()
        gen_pool.load[gen_url] += 1
        payload = {"request": body, "api": api, "ctx": ctx}
        rid = int(c["ctx_request_id"])
        try:
            resp = await client.send(client.build_request("POST", f"{gen_url}/disagg/generation", json=payload),
                                     stream=True)
        except httpx.HTTPError as e:
            gen_pool.load[gen_url] -= 1
            await release(ctx_url, rid)
            raise _error(f"generation worker {gen_url} failed: {type(e).__name__}: {e}") from e
        if resp.status_code != 200 or not req.stream:
            try:
                raw = await resp.aread()
            except httpx.HTTPError as e:
                raise _error(f"generation worker {gen_url} failed mid-request: {type(e).__name__}: {e}") from e
            finally:
                await resp.aclose()
                gen_pool.load[gen_url] -= 1
                await release(ctx_url, rid)
            return Response(raw, status_code=resp.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                yield sse(_error(f"generation worker {gen_url} failed mid-request: "
                                 f"{type(e).__name__}: {e}").body()).encode()
                yield sse("[DONE]").encode()
            finally:
                await resp.aclose()
                gen_pool.load[gen_url] -= 1
                await release(ctx_url, rid)

        return StreamingResponse(relay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _passthrough(r: httpx.Response) -> OpenAIError:
    """A worker's error reply (already OpenAI-shaped) as the router's."""
    try:
        err = r.json()["error"]
        return OpenAIError(err["message"], status=r.status_code, param=err.get("param"),
                           type_=err.get("type", "invalid_request_error"), code=err.get("code"))
    except (ValueError, KeyError, TypeError):
        return _error(f"worker answered {r.status_code}: {r.text[:200]}", r.status_code)


def _finished_on_ctx(req: CompletionRequest | ChatCompletionRequest, c: dict[str, Any]) -> Response:
    """The reply of a request that ended on CTX at its first token, shaped as the aggregated server's."""
    text, ids, finish, prompt = c["text"], c["token_ids"], c["finish_reason"], c["prompt_token_ids"]
    if not req.stream:
        return JSONResponse(response_body(req, req.model, text, finish, ids, prompt))
    chunks = ChunkWriter(req, req.model)
    out = chunks.chunk("", [], None, role=True) if chunks.chat else ""
    out += chunks.chunk(text, ids, finish)
    if req.include_usage_chunk:
        out += chunks.usage(len(prompt), len(ids))
    return Response(out + sse("[DONE]"), media_type="text/event-stream")


def main(argv: list[str]) -> int:
    import argparse

    import uvicorn
    p = argparse.ArgumentParser(prog="trtllm-serve disaggregated")
    p.add_argument("-c", "--config_file", "--config", dest="config", required=True, help="disagg.yaml")
    p.add_argument("--log_level", "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = DisaggConfig.from_yaml(a.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    uvicorn.run(create_router_app(cfg), host=cfg.hostname, port=cfg.port, log_level=a.log_level,
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0


__all__ = ["DisaggConfig", "create_router_app", "main"]
