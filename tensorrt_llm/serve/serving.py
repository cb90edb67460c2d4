"""OpenAI completions and chat completions over `LLM.generate_async` (one asyncio task per request).

A request is tokenized, checked against the context limits (400 naming the field), turned into
`SamplingParams` and submitted; the executor thread hands its outputs to the event loop through
`GenerationResult`'s asyncio queue (no thread per request). A client that disconnects aborts its
request (`GenerationResult.abort()`), which frees its KV pages at the engine's next step.

Streaming sends one SSE chunk per engine step that produced text. With stop strings, the last
(longest stop - 1) characters are held back until the request ends, so a streamed prefix of a stop
string is never sent: the concatenated chunks always equal the non-streamed text.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from pydantic import ValidationError
from starlette.requests import Request

from ..llmapi import LLM, RequestOutput
from ..llmapi.outputs import GenerationResult
from ..sampling_params import SamplingParams
from .errors import OpenAIError, from_validation_error
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("tensorrt_llm")

AnyRequest = Union[CompletionRequest, ChatCompletionRequest]
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions


def sse(data: Union[dict, str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only http.disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage_body(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def response_body(req: AnyRequest, model: str, text: str, finish: Optional[str], token_ids: list[int],
                  prompt_ids: list[int]) -> dict[str, Any]:
    """The non-streamed reply (completion or chat) of a finished request."""
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage_body(len(prompt_ids), len(token_ids))}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        body["prompt_token_ids"] = list(prompt_ids)
    return body


class ChunkWriter:
    """The SSE chunks of one streamed request (one id and `created` for all of them)."""

    def __init__(self, req: AnyRequest, model: str):
        self.req, self.model = req, model
        self.chat = isinstance(req, ChatCompletionRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: Optional[str], new_ids: list[int], finish: Optional[str], role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if self.req.return_token_ids:
            choice["token_ids"] = new_ids
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.req.include_usage_chunk:
            body["usage"] = None
        return sse(body)

    def usage(self, n_prompt: int, n_out: int) -> str:
        """The last chunk of `stream_options.include_usage`."""
        return sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": [], "usage": usage_body(n_prompt, n_out)})


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(self, llm: LLM, model_name: str, metrics: ServerMetrics):
        self.llm, self.model_name, self.metrics = llm, model_name, metrics

    # ---- request -> engine -------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"model {model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def prompt_ids(self, req: AnyRequest) -> list[int]:
        tk = self.llm.tokenizer
        if isinstance(req, ChatCompletionRequest):
            try:
                text = self.llm.apply_chat_template(req.template_messages())
            except ValueError as e:     # no template, or the template refused the conversation
                raise OpenAIError(f"chat template: {e}", param="messages") from e
            return tk.encode(text)
        # token ids are range-checked by the engine (a ValueError -> 400)
        return tk.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)

    def sampling_params(self, req: AnyRequest, prompt_len: int) -> SamplingParams:
        """Context-length checks (400 naming the field) and the engine's SamplingParams."""
        limit = self.llm.max_seq_len
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if prompt_len + 1 > limit:
            raise OpenAIError(f"this model's maximum context length is {limit} tokens; the {field} has "
                              f"{prompt_len} tokens (at least one output token must fit)", param=field)
        if isinstance(req, ChatCompletionRequest):
            max_tokens, limit_field = req.output_limit, (
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
            if max_tokens is None:
                max_tokens = limit - prompt_len
        else:
            max_tokens, limit_field = req.max_tokens, "max_tokens"
            if max_tokens is None:
                max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise OpenAIError(f"this model's maximum context length is {limit} tokens; you requested "
                              f"{prompt_len + max_tokens} ({prompt_len} in the {field}, {max_tokens} in "
                              f"{limit_field})", param=limit_field)
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos)
        except ValidationError as e:
            raise from_validation_error(e) from e

    def submit(self, req: AnyRequest, **engine_kw: Any) -> tuple[list[int], GenerationResult]:
        """engine_kw: `LLM.generate_async`'s disaggregated-serving keywords (serve/disagg/worker.py)."""
        self.check_model(req.model)
        ids = self.prompt_ids(req)
        params = self.sampling_params(req, len(ids))
        try:
            handle = self.llm.generate_async(ids, params, streaming=req.stream, **engine_kw)
        except ValueError as e:
            # the engine's own checks: prompt token ids out of the vocabulary, or a request that can
            # never fit the KV pool (fixed by a smaller max_tokens)
            field = "prompt" if str(e).startswith("prompt") and isinstance(req, CompletionRequest) else "max_tokens"
            raise OpenAIError(str(e), param=field) from e
        except RuntimeError as e:       # the engine stopped
            raise OpenAIError(str(e), status=503, type_="server_error") from e
        self.metrics.running.inc()
        return ids, handle

    def _finished(self, reason: str, ids: list[int], out: Optional[RequestOutput]) -> None:
        self.metrics.running.dec()
        c = out.outputs[0] if out is not None else None
        self.metrics.record_finished(reason, len(ids), len(c.token_ids) if c else 0,
                                     out.metrics if out is not None else {})

    # ---- responses ---------------------------------------------------------------------
    async def respond(self, req: AnyRequest, http: Request, **engine_kw: Any) -> dict[str, Any]:
        """Non-streaming: wait for the result, or abort it when the client disconnects first."""
        ids, handle = self.submit(req, **engine_kw)
        result = asyncio.ensure_future(handle.aresult())
        gone = asyncio.ensure_future(wait_for_disconnect(http))
        try:
            done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                self._finished("aborted", ids, None)
                handle.abort()
        if result not in done:      # nobody reads this reply
            raise OpenAIError("client closed the request", status=499)
        out = result.result()
        c = out.outputs[0]
        self._finished(c.finish_reason or "error", ids, out)
        if c.finish_reason == "error":
            raise OpenAIError(f"request failed in the engine: {c.error}", status=500, type_="server_error")
        return response_body(req, self.model_name, c.text, c.finish_reason, list(c.token_ids), ids)

    def stream(self, req: AnyRequest, **engine_kw: Any) -> AsyncIterator[str]:
        """Submit now (so a bad request is a 400 before any byte is sent), then stream SSE chunks."""
        ids, handle = self.submit(req, **engine_kw)
        return self._stream(req, ids, handle)

    async def _stream(self, req: AnyRequest, ids: list[int], handle: GenerationResult) -> AsyncIterator[str]:
        chunks = ChunkWriter(req, self.model_name)
        hold = max((len(s) for s in SamplingParams(stop=req.stop).stop_strings), default=1) - 1
        sent_text, sent_ids, out = "", 0, None
        try:
            if chunks.chat:
                yield chunks.chunk("", [], None, role=True)
            async for out in handle:
                c = out.outputs[0]
                if out.finished:
                    break
                visible = c.text[:len(c.text) - hold] if hold else c.text
                if len(visible) > len(sent_text) or (req.return_token_ids and len(c.token_ids) > sent_ids):
                    delta = visible[len(sent_text):]
                    yield chunks.chunk(delta, c.token_ids[sent_ids:], None)
                    sent_text, sent_ids = sent_text + delta, len(c.token_ids)
        finally:
            if out is None or not out.finished:     # the client went away (or the loop is closing)
                self._finished("aborted", ids, out)
                handle.abort()
        c = out.outputs[0]
        self._finished(c.finish_reason or "error", ids, out)
        if c.finish_reason == "error":
            yield sse(OpenAIError(f"request failed in the engine: {c.error}", status=500,
                                  type_="server_error").body())
            yield sse("[DONE]")
            return
        if not c.text.startswith(sent_text):        # cannot happen for byte-level BPE; say so if it does
            logger.warning("request %d: streamed text is not a prefix of the final text", out.request_id)
        yield chunks.chunk(c.text[len(sent_text):], c.token_ids[sent_ids:], c.finish_reason)
        if req.include_usage_chunk:
            yield chunks.usage(len(ids), len(c.token_ids))
        yield sse("[DONE]")
