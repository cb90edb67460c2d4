"""Strict pydantic configuration for the LLM API (TensorRT-LLM names).

Configuration enters the engine only through these models. They are frozen once
validated: nothing downstream mutates them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

# resolver.KNOWN_BACKENDS + AUTO; CUTEDSL is a drafter's choice only (TorchLlmArgs.attn_backend refuses it)
AttentionBackendName = Literal["AUTO", "VANILLA", "FLASHINFER", "TRITON", "CUTEDSL"]
KvDtypeName = Literal["auto", "bfloat16", "float16", "float32", "fp8"]
ModelDtypeName = Literal["auto", "bfloat16", "float16", "float32"]
PathStr = Annotated[str, AfterValidator(os.path.expanduser)]     # a file or folder path; `~` expanded


class StrictBaseModel(BaseModel):
    """Base for every config: unknown keys are errors, validated objects are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class KvCacheConfig(StrictBaseModel):
    """Paged KV cache sizing and behaviour."""

    free_gpu_memory_fraction: float = Field(
        default=0.9, gt=0.0, le=1.0,
        description="Fraction of free device memory (after weights) given to the KV pools "
        "when `max_tokens` is not set.")
    max_tokens: Optional[int] = Field(
        default=None, ge=1,
        description="Token capacity of the KV pool(s). Overrides free_gpu_memory_fraction. "
        "With a drafter, both target and draft pools get this capacity (token parity).")
    tokens_per_block: int = Field(
        default=32, ge=1, le=1024, description="Tokens per KV page (block).")
    enable_block_reuse: bool = Field(
        default=False, description="Prefix caching: reuse full, verified blocks across requests.")
    dtype: KvDtypeName = Field(
        default="auto", description="Target KV pool dtype; 'auto' = model dtype. "
        "'fp8' = float8_e4m3fn storage (the drafter pool keeps its own dtype).")
    cpu_kv_budget_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024,
        description="Memory budget for the KV pools on CPU, where free device memory is not "
        "meaningful and `max_tokens` is not set.")

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"tokens_per_block must be a power of two, got {v}")
        return v


class DSparkDecodingConfig(StrictBaseModel):
    """DSpark block-draft speculative decoding (drafter fed the target's hidden states)."""

    decoding_type: Literal["DSpark"] = Field(
        default="DSpark", description="Discriminator of the speculative_config union.")
    speculative_model: PathStr = Field(
        description="Path to the drafter checkpoint folder (config.json + safetensors).")
    max_draft_len: Optional[int] = Field(
        default=None, ge=1,
        description="Drafts verified per step; <= the trained block size (default: block size "
        "with shift_label, block size - 1 without).")
    attention_backend: AttentionBackendName = Field(
        default="AUTO", description="Attention backend for the drafter. CUTEDSL: TRITON's paged attention with "
        "the queries' and K / latent rows' RMSNorm + RoPE and their page-bounded append as one CuTe DSL launch "
        "per layer (CUDA sm90+, the 'cutedsl' extra; a drafter with layer regions and half-rotation RoPE, else "
        "the load raises). AUTO: with CUDA graphs, CUTEDSL where its support predicate holds, else TRITON.")
    mla_fold_output: bool = Field(
        default=False, description="MLA drafters: fold W_UV into o_proj at load, so each layer takes its "
        "absorbed attention's latent output to the hidden size in one [hidden, heads x kv_lora_rank] GEMM "
        "instead of the per-head W_UV product and o_proj (folded in float32, stored in the drafter's dtype). "
        "Needs an MLA drafter without quant_config, else the load raises.")
    mla_fold_query: bool = Field(
        default=False, description="MLA drafters: fold W_UK into the q projection (q_proj, or q_b_proj with "
        "q_lora) at load, so each layer gets its absorbed attention's per-head [q_nope W_UK | q_pe] from one "
        "[heads x (kv_lora_rank + rope), q input] GEMM instead of the q GEMM and the per-head W_UK product "
        "(folded in float32, stored in the drafter's dtype). Needs an MLA drafter without quant_config, else "
        "the load raises.")
    mask_token_id: Optional[int] = Field(
        default=None, ge=0, description="Override of dspark_config.mask_token_id.")
    target_layer_ids: Optional[list[int]] = Field(
        default=None, description="Override of dspark_config.target_layer_ids.")
    accept_stats_dir: Optional[PathStr] = Field(
        default=None, description="Folder for dspark_accept_stats_rank{r}.json (None: not written).")
    draft_len_schedule: Optional[dict[int, int]] = Field(
        default=None, description="Generating requests in a step -> drafts verified per request (TensorRT-LLM's "
        "schedule): {4: 8, 16: 4, 64: 2} verifies 8 drafts at 1-4 requests, 4 at 5-16, 2 at 17-64 and none "
        "above 64 (such steps decode one token per request). Values <= max_draft_len, not increasing with "
        "the batch; the drafter always drafts its whole block. None: max_draft_len at every batch size.")

    @field_validator("draft_len_schedule")
    @classmethod
    def _check_schedule(cls, v: Optional[dict[int, int]]) -> Optional[dict[int, int]]:
        if v is None:
            return v
        if not v:
            raise ValueError("draft_len_schedule must not be empty (leave it out for max_draft_len everywhere)")
        prev = None
        for batch in sorted(v):
            n = v[batch]
            if batch < 1 or n < 0:
                raise ValueError(f"draft_len_schedule entry {batch}: {n} needs a batch size >= 1 and a draft "
                                 "length >= 0")
            if prev is not None and n > prev:
                raise ValueError(f"draft_len_schedule must not increase with the batch size: {batch}: {n} after "
                                 f"{prev}")
            prev = n
        return dict(sorted(v.items()))


SpeculativeConfig = Annotated[Union[DSparkDecodingConfig], Field(discriminator="decoding_type")]


class TorchCompileConfig(StrictBaseModel):
    """torch.compile inside the engine (inductor; the engine's own CUDA graphs capture its kernels)."""

    enable_inductor: bool = Field(
        default=True, description="Compile the position-wise halves of every target decoder layer (the "
        "norms, RoPE, SwiGLU and residual adds between the GEMMs) with inductor: a few fused kernels "
        "instead of ~25 small ones per layer; with a DSpark drafter its layers, context K/V (latent) "
        "projections, context features and greedy draft chain too (capacity report `drafter_regions`). "
        "Costs a one-time compile per process (tens of seconds).")


class TorchLlmArgs(StrictBaseModel):
    """Arguments of `LLM(...)`; also the shape of a YAML `--extra_llm_api_options` file."""

    model: PathStr = Field(description="Path to an HF-format checkpoint folder.")
    tokenizer: Optional[PathStr] = Field(default=None, description="Tokenizer folder (default: model).")
    dtype: ModelDtypeName = Field(
        default="auto", description="Weight/activation dtype; 'auto' = bfloat16 on CUDA, float32 on CPU.")
    device: Optional[str] = Field(
        default=None, description="'cuda', 'cuda:N' or 'cpu'; default CUDA when available.")
    max_batch_size: int = Field(default=64, ge=1, description="Max requests in flight per step.")
    max_num_tokens: int = Field(
        default=2048, ge=1, description="Token budget per step (chunked prefill splits prompts).")
    max_seq_len: Optional[int] = Field(
        default=None, ge=2, description="Max prompt + output tokens; default the model's.")
    enable_chunked_prefill: bool = Field(
        default=True, description="Split long prompts over steps to respect max_num_tokens.")
    attn_backend: AttentionBackendName = Field(
        default="AUTO", description="Attention backend of the target model (CUTEDSL is a drafter backend: "
        "speculative_config.attention_backend).")
    use_cuda_graph: bool = Field(
        default=False, description="Capture decode/verify steps in CUDA graphs (CUDA only). Every graph a "
        "step may replay (each batch bucket and verify width, each prompt-chunk token bucket up to 2048 tokens, "
        "the one-graph DSpark step) is captured at startup, so no serving step waits for a capture; "
        "capacity_report['cuda_graphs'] says how many and how long it took.")
    disable_overlap_scheduler: bool = Field(
        default=False, description="Turn off the overlap scheduler: by default a step's tokens stay on the "
        "device as the next step's inputs and are read (stop criteria applied) one step later, while the "
        "GPU runs that step; outputs are the same either way. A DSpark verify step continues from the "
        "device rows of the step in flight (anchor, drafts, committed count) when the drafter launches "
        "its drafts on the device and the target attention backend reads KV lengths there (TRITON, "
        "VANILLA); capacity_report['overlap_scheduler'] says whether it does.")
    step_timeout_s: Optional[float] = Field(
        default=300.0, gt=0, description="An executor step (its launches, reads and waits) still running after "
        "this many seconds ends the engine: its thread's stack is logged, every queued and in-flight request "
        "finishes with an error naming the stall, and later calls raise (as after a device fault), so no "
        "caller waits forever on a GPU or host wait that never completes. null: no limit.")
    torch_compile_config: Optional[TorchCompileConfig] = Field(
        default=None, description="torch.compile regions in the target model; absent: eager PyTorch ops.")
    kv_cache_config: KvCacheConfig = Field(
        default_factory=KvCacheConfig, description="Paged KV cache settings.")
    speculative_config: Optional[SpeculativeConfig] = Field(
        default=None, description="Speculative decoding; `decoding_type` selects the kind.")
    seed: int = Field(default=0, description="Default seed for sampling without a per-request seed.")
    batch_wait_timeout_iters: int = Field(
        default=0, ge=0,
        description="Batch waiting: hold newly arrived context requests (prefill not started) for up to "
        "this many iterations while generation requests are running, so that arrivals accumulate "
        "into fewer prefill steps. Never waits when no request is generating, never delays a "
        "started (chunked) prefill, and releases the held requests into a step that already has a "
        "prefill in flight; after this many iterations the held requests are scheduled. "
        "0 disables batch waiting (arrivals are scheduled at once).")
    batch_wait_max_tokens_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Batch waiting: stop holding as soon as the held requests' prompt tokens reach "
        "this ratio x max_num_tokens. 0 disables the token threshold (only "
        "batch_wait_timeout_iters ends a wait); > 0 needs batch_wait_timeout_iters > 0.")
    batch_admit_min_slots: int = Field(
        default=1, ge=1,
        description="Slot grouping: while requests are generating, admit queued requests only once "
        "min(this, queued, max_batch_size) batch slots are free, so they start together in one "
        "prefill step instead of one mixed step each (offline batches larger than max_batch_size). "
        "Never waits when nothing is generating. 1 admits as soon as a slot frees.")
    stream_interval: int = Field(
        default=1, ge=1,
        description="Streaming: a streamed request's snapshot (and so a server's SSE chunk) is made at its "
        "first token, then every this many executor steps that gave it tokens, and when it finishes; "
        "the tokens in between arrive with the next snapshot. Larger values cut the per-step "
        "streaming work (detokenizing, hand-offs to the event loop, one SSE event per request per "
        "step) at high concurrency without delaying the first token. 1 streams every step. "
        "Non-streaming outputs are unaffected.")

    @field_validator("attn_backend")
    @classmethod
    def _target_backend(cls, v: str) -> str:
        if v == "CUTEDSL":
            raise ValueError("attn_backend CUTEDSL is the DSpark drafter's norm + RoPE prep backend; set it as "
                             "speculative_config.attention_backend (the target takes AUTO, VANILLA, FLASHINFER "
                             "or TRITON)")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TorchLlmArgs":
        if self.device is not None and not (
                self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.max_num_tokens < self.max_batch_size and not self.enable_chunked_prefill:
            raise ValueError("max_num_tokens must be >= max_batch_size")
        if self.batch_wait_max_tokens_ratio > 0 and self.batch_wait_timeout_iters == 0:
            raise ValueError(f"batch_wait_max_tokens_ratio={self.batch_wait_max_tokens_ratio} only shortens "
                             "a batch wait; it needs batch_wait_timeout_iters > 0")
        return self

    @classmethod
    def from_yaml(cls, path: Union[str, Path], **overrides) -> "TorchLlmArgs":
        """Load args from a YAML file; keyword overrides win. Unknown keys raise.

        Paths in the file (`model`, `tokenizer`, `speculative_config.speculative_model`,
        `speculative_config.accept_stats_dir`) may start with `~`; a relative one resolves against
        the YAML file's folder, not the working directory, so a config folder can be moved as a
        whole. Overrides are taken as given (relative to the working directory).
        """
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"LLM args YAML not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: invalid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{p}: top level must be a mapping, got {type(data).__name__}")
        folder = p.parent.absolute()
        data = _anchor_paths(data, ("model", "tokenizer"), folder)
        if isinstance(data.get("speculative_config"), dict):
            data["speculative_config"] = _anchor_paths(
                data["speculative_config"], ("speculative_model", "accept_stats_dir"), folder)
        data.update(overrides)
        try:
            return cls(**data)
        except Exception as e:  # re-raise with the file name
            raise ValueError(f"{p}: invalid LLM args: {e}") from e


def _anchor_paths(data: dict[str, Any], keys: tuple[str, ...], folder: Path) -> dict[str, Any]:
    """`data` with its string values under `keys` made paths: `~` expanded, relative ones joined to
    `folder` (other values are left for validation to report)."""
    out = dict(data)
    for k in keys:
        if isinstance(out.get(k), str):
            v = Path(out[k]).expanduser()
            out[k] = str(v if v.is_absolute() else folder / v)
    return out
