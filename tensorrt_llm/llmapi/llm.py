"""`LLM`: the offline/online entry point (TensorRT-LLM's LLM API over the PyTorch backend)."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..sampling_params import SamplingParams
from .llm_args import TorchLlmArgs
from .outputs import GenerationResult, RequestOutput
from .tokenizer import TokenizerWrapper

logger = logging.getLogger("tensorrt_llm")

PromptInput = Union[str, Sequence[int]]


class LLM:
    """Load a checkpoint and serve generate requests with continuous batching.

    `LLM(model=PATH, **args)` or `LLM(model="args.yaml")` (a YAML of TorchLlmArgs whose
    `model` key names the checkpoint), or `LLM(args=TorchLlmArgs(...))`.
    """

    def __init__(self, model: Optional[str] = None, *, args: Optional[TorchLlmArgs] = None, **kwargs: Any):
        if args is None:
            if model is not None and str(model).endswith((".yaml", ".yml")):
                args = TorchLlmArgs.from_yaml(model, **kwargs)
            else:
                if model is None:
                    raise ValueError("LLM needs `model` (a checkpoint folder or a YAML args file)")
                args = TorchLlmArgs(model=str(model), **kwargs)
        elif model is not None or kwargs:
            raise ValueError("pass either `args` or model/keyword arguments, not both")
        self.args = args
        from .._torch.pyexecutor.py_executor_creator import create_py_executor
        self.tokenizer = TokenizerWrapper(args.tokenizer or args.model)
        self._bundle = create_py_executor(args, self.tokenizer)
        self._executor = self._bundle.executor
        self._ids = itertools.count()
        self._executor.start()

    # ---- info --------------------------------------------------------------------------
    @property
    def capacity_report(self) -> dict[str, Any]:
        """KV pools (shapes, dtype, bytes/token, max_tokens) and resolved attention backends."""
        return self._bundle.report

    @property
    def max_seq_len(self) -> int:
        return self._bundle.max_seq_len

    def get_stats(self) -> dict[str, Any]:
        kv = self._bundle.kv.report()
        stats = {"iterations": self._executor.iterations, "kv_cache": kv,
                 "prefix_cache": kv["reuse"]}
        if self._executor.spec is not None:
            stats["speculative"] = self._executor.spec.stats()
        return stats

    def reset_kv_peak(self) -> None:
        """Restart get_stats()["kv_cache"]["peak_used_pages"], the most KV pages in use since."""
        self._bundle.kv.reset_peak()

    # ---- generation --------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def _to_ids(self, prompt: PromptInput) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) for t in ids):
            raise ValueError("token-id prompts must be a list of ints")
        return None, ids

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self._bundle.model.config.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) + 1 > self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len} "
                             "(prompt + at least one output token must fit)")
        if not self.args.enable_chunked_prefill and len(ids) > self.args.max_num_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens > max_num_tokens {self.args.max_num_tokens} "
                             "and chunked prefill is disabled")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_seq_len {self.max_seq_len}")
        need = len(ids) + params.max_tokens + self._executor.scheduler.spec_slack
        if self._bundle.kv.pages_for(need) > self._bundle.kv.num_pages:
            raise ValueError(f"request needs {need} tokens of KV but the pool holds "
                             f"{self._bundle.kv.max_tokens}")

    def _make_request(self, prompt: PromptInput, params: Optional[SamplingParams], streaming: bool,
                      context_only: bool):
        """Tokenize and validate one prompt -> (LlmRequest, its GenerationResult); enqueues nothing."""
        from .._torch.pyexecutor.llm_request import LlmRequest
        params = params or SamplingParams()
        text, ids = self._to_ids(prompt)
        self._validate(ids, params)
        rid = next(self._ids)
        end_ids = set() if params.ignore_eos else (
            {params.end_id} if params.end_id is not None else set(self.tokenizer.eos_token_ids))
        req = LlmRequest(rid, ids, params, end_ids=frozenset(end_ids), context_only=context_only)
        handle = GenerationResult(rid, text, ids, self.tokenizer.decode, params.stop_strings,
                                  params.include_stop_str_in_output, streaming)
        return req, handle

    def generate_async(self, prompt: PromptInput, sampling_params: Optional[SamplingParams] = None,
                       streaming: bool = False, context_only: bool = False) -> GenerationResult:
        req, handle = self._make_request(prompt, sampling_params, streaming, context_only)
        self._executor.enqueue_request(req, handle._update)
        return handle

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 ) -> Union[RequestOutput, list[RequestOutput]]:
        """Blocking generation. A single prompt returns one RequestOutput, a list returns a list.
        Every prompt is validated before any is submitted (a bad one raises and nothing runs), then
        all are submitted as one group, so the step batches, and with them the numerics, repeat
        from run to run."""
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                              and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, SamplingParams):
            if len(sampling_params) != len(plist):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(plist)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(plist)
        made = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                made.append(self._make_request(p, sp, False, False))
            except ValueError as e:
                raise ValueError(str(e) if single else f"prompt {i}: {e}") from e
        self._executor.enqueue_requests([(req, handle._update) for req, handle in made])
        outs = [handle.result() for _, handle in made]
        return outs[0] if single else outs

    def shutdown(self) -> None:
        self._executor.shutdown()
        spec = self._executor.spec
        if spec is not None and self.args.speculative_config and self.args.speculative_config.accept_stats_dir:
            spec.write_stats(Path(self.args.speculative_config.accept_stats_dir))

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
