"""Request models of the OpenAI-compatible server (strict pydantic; responses are plain dicts).

Unknown fields are rejected (`extra="forbid"`). OpenAI parameters this engine does not implement are
declared so that their neutral value (`n=1`, `echo=false`, `frequency_penalty=0`, ...) is accepted and
any other value is a 400 naming them, never silently ignored. Extensions (vLLM's names): `top_k`,
`ignore_eos`, `return_token_ids`.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_SEED = 2 ** 64


def request_error(kind: str, param: str, message: str) -> PydanticCustomError:
    """A whole-request validation error that still names its field (ctx["param"])."""
    return PydanticCustomError(kind, message, {"param": param})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _WithUnsupported(_Strict):
    """A request with OpenAI parameters that are accepted only at their neutral value."""

    # field -> values that mean "not used"; any other non-null value is rejected
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def unsupported(self) -> list[str]:
        bad = []
        for name, neutral in self.UNSUPPORTED.items():
            v = getattr(self, name)
            if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
                bad.append(name)
        return bad

    @model_validator(mode="after")
    def _reject_unsupported(self):
        bad = self.unsupported()
        if bad:
            raise request_error("unsupported_parameter", bad[0],
                                f"unsupported parameter{'s' if len(bad) > 1 else ''}: {', '.join(bad)} (this "
                                f"server does not implement {'them' if len(bad) > 1 else 'it'}; leave unset)")
        return self


class StreamOptions(_Strict):
    include_usage: StrictBool = Field(default=False, description="Send a last chunk with `usage`.")


class _SamplingFields(_WithUnsupported):
    """Sampling and stopping fields shared by completions and chat."""

    model: StrictStr = Field(description="A model id of /v1/models.")
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, description="Max new tokens.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass; 1 = disabled.")
    top_k: StrictInt = Field(default=0, ge=0, description="Extension: top-k; 0 = disabled.")
    seed: Optional[StrictInt] = Field(default=None, ge=0, lt=MAX_SEED, description="Sampling seed.")
    stop: Union[None, StrictStr, list[StrictStr]] = Field(
        default=None, description="Up to 4 stop strings (excluded from the text).")
    stream: StrictBool = Field(default=False, description="Server-sent events, one chunk per step.")
    stream_options: Optional[StreamOptions] = Field(default=None, description="Only with stream=true.")
    ignore_eos: StrictBool = Field(default=False, description="Extension: generate past end of sequence.")
    return_token_ids: StrictBool = Field(
        default=False, description="Extension (vLLM): add `token_ids` to each choice and `prompt_token_ids`.")
    user: Optional[StrictStr] = Field(default=None, description="End-user id; recorded nowhere.")
    n: Optional[StrictInt] = Field(default=None, description="Only 1 is supported.")
    frequency_penalty: Optional[float] = Field(default=None, description="Only 0 is supported.")
    presence_penalty: Optional[float] = Field(default=None, description="Only 0 is supported.")
    logit_bias: Optional[dict[str, Any]] = Field(default=None, description="Not supported.")

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise request_error("invalid_value", "stream_options", "stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is one string or one list of token ids."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "n": (1,), "best_of": (1,), "echo": (False,), "frequency_penalty": (0.0, 0),
        "presence_penalty": (0.0, 0), "logit_bias": ({},), "logprobs": (), "suffix": ()}

    prompt: Union[StrictStr, list[StrictInt]] = Field(description="Text or token ids (one prompt).")
    best_of: Optional[StrictInt] = Field(default=None, description="Only 1 is supported.")
    echo: Optional[StrictBool] = Field(default=None, description="Only false is supported.")
    logprobs: Optional[StrictInt] = Field(default=None, description="Not supported.")
    suffix: Optional[StrictStr] = Field(default=None, description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
            raise ValueError("a batch of prompts is not supported; send one prompt per request")
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt is empty")
        return v


class TextPart(_Strict):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="Message author.")
    content: Union[StrictStr, list[TextPart]] = Field(description="Text, or a list of text parts.")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="Only plain text is supported.")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions; messages go through the checkpoint's chat template."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "n": (1,), "frequency_penalty": (0.0, 0), "presence_penalty": (0.0, 0), "logit_bias": ({},),
        "logprobs": (False,), "top_logprobs": (), "tools": ([],), "tool_choice": ("none",),
        "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (), "audio": (),
        "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "store": (False,),
        "metadata": (), "service_tier": (), "web_search_options": ()}

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, description="= max_tokens.")
    response_format: Optional[ResponseFormat] = Field(default=None, description="Only {'type': 'text'}.")
    logprobs: Optional[StrictBool] = Field(default=None, description="Only false is supported.")
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None
    audio: Optional[Any] = None
    modalities: Optional[list[StrictStr]] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[StrictStr] = None
    store: Optional[StrictBool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[StrictStr] = None
    web_search_options: Optional[Any] = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise request_error("invalid_value", "max_completion_tokens",
                                "set max_tokens or max_completion_tokens, not both")
        return self

    @property
    def output_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text} for m in self.messages]


# the request model of each generation endpoint, by the name disaggregated workers are sent (`api`)
GENERATION_APIS: dict[str, type[_SamplingFields]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape). add_special_tokens defaults to false: the ids
    /v1/completions feeds the model for the same prompt."""

    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with messages (vLLM's shape): the chat template, then the tokenizer."""

    model: Optional[StrictStr] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape)."""

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]
