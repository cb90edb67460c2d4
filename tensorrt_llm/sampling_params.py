"""Per-request sampling parameters (TensorRT-LLM's `SamplingParams`)."""
from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request samples and stops.

    temperature == 0 (or top_k == 1) means greedy. Stop strings are matched on the
    detokenized output and excluded from the returned text.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=32, description="Max new tokens to generate (>= 1).")
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy; finite.")
    top_k: int = Field(default=0, ge=0, description="0 = disabled.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass; 1 = disabled.")
    seed: Optional[int] = Field(default=None, ge=0, lt=2**64, description="Per-request RNG seed in [0, 2**64).")
    stop: Union[None, str, list[str]] = Field(default=None, description="Stop string(s).")
    end_id: Optional[int] = Field(
        default=None, description="End-of-sequence token id (default: the tokenizer's eos).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(default=False, description="Keep generating past end_id.")
    include_stop_str_in_output: bool = Field(
        default=False, description="Keep the matched stop string in the text.")

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
