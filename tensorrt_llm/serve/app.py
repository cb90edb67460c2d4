"""The FastAPI app of `trtllm-serve`: routes, request parsing and error responses.

    GET  /v1/models                 the served model (id = the MODEL argument)
    POST /v1/completions            OpenAI completions (SSE with stream=true)
    POST /v1/chat/completions       OpenAI chat completions (SSE with stream=true)
    GET  /health                    200 while the engine serves, 503 after a fatal engine error (or a stalled step)
    GET  /version                   {"version": ...}
    GET  /metrics                   Prometheus text (see metrics.py)
    POST /tokenize, /detokenize     vLLM's request / response shapes

Bodies are parsed here (not by FastAPI's signature binding) so that malformed JSON, unknown fields,
unsupported OpenAI parameters and bad types all give one OpenAI-style 400 naming the field.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..llmapi import LLM
from .errors import OpenAIError, from_validation_error
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                       TokenizeCompletionRequest)
from .serving import OpenAIServing

logger = logging.getLogger("tensorrt_llm")
M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}", param="body") from e


# Idle keep-alive connections of the servers live this long (uvicorn's default, 5 s, races pooled
# clients such as openai's: a request sent on a connection the server is closing fails with
# "Server disconnected without sending a response").
KEEP_ALIVE_S = 75


def parse(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise OpenAIError(f"request body must be a JSON object, got {type(body).__name__}", param="body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


def create_app(llm: LLM, model_name: str) -> FastAPI:
    """The app serving `llm` as `model_name`; the caller owns `llm` (and shuts it down)."""
    app = FastAPI(title="trtllm-serve", version=__version__)
    metrics = ServerMetrics(llm.get_stats)
    serving = OpenAIServing(llm, model_name, metrics)
    created = int(time.time())
    app.state.metrics, app.state.serving = metrics, serving

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        if 400 <= e.status < 500:
            metrics.rejected.labels(request.url.path).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> Response:
        fatal = llm._executor.fatal_error    # set when the executor loop died (every request then fails)
        if fatal is not None:
            return JSONResponse(OpenAIError(f"engine stopped: {fatal}", status=503,
                                            type_="server_error").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tensorrt_llm", "max_model_len": llm.max_seq_len}]}

    async def generate(request: Request, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
        req = parse(kind, await read_json(request))
        if req.stream:
            return StreamingResponse(serving.stream(req), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await serving.respond(req, request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        chat = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        serving.check_model(req.model)
        if chat:
            try:
                text = llm.tokenizer.apply_chat_template([{"role": m.role, "content": m.text} for m in req.messages],
                                                         req.add_generation_prompt)
            except ValueError as e:
                raise OpenAIError(f"chat template: {e}", param="messages") from e
        else:
            text = req.prompt
        ids = llm.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        strs = [llm.tokenizer.tk.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_seq_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        req = parse(DetokenizeRequest, await read_json(request))
        serving.check_model(req.model)
        vocab = llm.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids out of the tokenizer's range [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app
