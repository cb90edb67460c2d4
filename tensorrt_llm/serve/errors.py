"""OpenAI-style errors: one exception type and the JSON body every failed request gets.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError


class OpenAIError(Exception):
    """A request the server refuses (status 4xx) or fails (5xx); `param` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _loc(loc: tuple) -> str:
    """pydantic location -> OpenAI param path: ("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in ("str", "int", "float", "list[int]", "list[str]") or "[" in str(part) or "-" in str(part):
            continue        # a union member's tag, not a field
        else:
            out += f".{part}"
    return out


def from_validation_error(e: ValidationError) -> OpenAIError:
    """400 naming the first invalid field (unknown fields say so)."""
    errs = e.errors(include_url=False)
    first = errs[0]
    loc = _loc(tuple(first["loc"]))
    param = loc or (first.get("ctx") or {}).get("param")
    if first["type"] == "extra_forbidden":
        msg = f"unknown parameter: {param}"
        others = [_loc(tuple(x["loc"])) for x in errs[1:] if x["type"] == "extra_forbidden"]
        if others:
            msg = f"unknown parameters: {', '.join([param] + others)}"
    else:
        msg = f"{loc}: {first['msg']}" if loc else first["msg"]
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more error(s))"
    return OpenAIError(msg, param=param)
