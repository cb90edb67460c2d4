"""`LLM`: the offline/online entry point (TensorRT-LLM's LLM API over the PyTorch backend)."""
from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import numbers
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from ..sampling_params import SamplingParams
from .llm_args import TorchLlmArgs
from .outputs import GenerationResult, RequestOutput
from .tokenizer import TokenizerWrapper

if TYPE_CHECKING:
    from .._torch.runtime.llm_request import PrefilledKV

logger = logging.getLogger("tensorrt_llm")

PromptInput = Union[str, Sequence[int]]

# LLMs not shut down yet: stopped at interpreter exit, before teardown (an executor thread still
# running into teardown aborts the process: "terminate called without an active exception")
_LIVE_LLMS: "weakref.WeakSet[LLM]" = weakref.WeakSet()


def _freeze_startup_heap() -> None:
    """Keep a started engine's heap out of the collector's full passes.

    A built engine holds ~0.2M tracked objects (~0.5M with inductor regions: FX graphs, guards, compiled
    code) that live as long as it does. Every oldest-generation pass walks all of them: a stop-the-world
    pause (~60 ms eager, ~220 ms with inductor for one SmolLM2 engine on a CPU: `bench/gc_heap.py`) in
    whichever step triggers it, while the serving loop's own objects are freed by reference counting. So the heap is
    collected once and moved to the permanent generation (`gc.freeze`, as vLLM's engine core does);
    `LLM.shutdown` moves it back (`gc.unfreeze`), so a stopped engine's cycles are collected again."""
    gc.collect()
    gc.freeze()


@atexit.register
def _shutdown_live_llms() -> None:
    for llm in list(_LIVE_LLMS):
        llm.shutdown()


def _is_one_prompt(prompts: Any) -> bool:
    """A string or a flat sequence of token ids (list, tuple, numpy array) is one prompt."""
    if isinstance(prompts, str):
        return True
    try:
        return len(prompts) > 0 and isinstance(prompts[0], numbers.Number)
    except TypeError:           # a generator of prompts, or not a sequence at all
        return False


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
        self._submit_lock = threading.Lock()     # orders submissions against shutdown()
        self._shut_down = False
        self._executor.start()
        _LIVE_LLMS.add(self)
        _freeze_startup_heap()

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
        ex = self._executor
        stats = {"iterations": ex.iterations, "kv_cache": kv, "prefix_cache": kv["reuse"],
                 "steps": {"total": ex.iterations, "with_prompt_chunks": ex.prompt_steps,
                           "read_in_flight_first": ex.reads_before_launch,
                           "prompts_beside_in_flight": ex.prompts_beside_flight,
                           "prompts_beside_one_graph": ex.prompts_beside_one_graph,
                           "prompts_read_late": ex.prompts_read_late, **dataclasses.asdict(ex.engine.paths),
                           "seconds": ex.step_seconds, "seconds_with_prompt_chunks": ex.prompt_step_seconds,
                           "seconds_reading_tokens": ex.read_wait_seconds}}
        if self._executor.drafter is not None:
            stats["speculative"] = self._executor.drafter.stats()
        return stats

    def reset_kv_peak(self) -> None:
        """Restart get_stats()["kv_cache"]["peak_used_pages"], the most KV pages in use since."""
        self._bundle.kv.reset_peak()

    def reset_speculative_stats(self) -> None:
        """Start a new window for get_stats()["speculative"] (acceptance histogram, AL, draft counts):
        they count the verify steps since the last reset (since construction before any)."""
        if self._executor.drafter is not None:
            self._executor.drafter.reset_stats()

    # ---- generation --------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def _to_ids(self, prompt: PromptInput) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        try:
            items = list(prompt)
        except TypeError:
            raise ValueError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}") from None
        for i, t in enumerate(items):      # numpy integers are ids too; floats and bools are not
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"token id {i} of the prompt is {t!r} ({type(t).__name__}), not an int")
        return None, [int(t) for t in items]

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self._bundle.model.config.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        for name, toks in (("end_id", [] if params.end_id is None else [params.end_id]),
                           ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in toks if t < 0 or t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} out of the vocabulary [0, {vocab})")
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
                      context_only: bool = False, prefilled: Optional["PrefilledKV"] = None):
        """Tokenize and validate one prompt -> (LlmRequest, its GenerationResult); enqueues nothing."""
        from .._torch.runtime.llm_request import LlmRequest
        params = params or SamplingParams()
        text, ids = self._to_ids(prompt)
        self._validate(ids, params)
        rid = next(self._ids)
        end_ids = set() if params.ignore_eos else (
            {params.end_id} if params.end_id is not None else set(self.tokenizer.eos_token_ids))
        req = LlmRequest(rid, ids, params, end_ids=frozenset(end_ids), context_only=context_only,
                         prefilled=prefilled, streaming=streaming)
        handle = GenerationResult(rid, text, ids, self.tokenizer.decode, params.stop_strings,
                                  params.include_stop_str_in_output, streaming, abort=self.abort,
                                  stream_interval=self.args.stream_interval)
        return req, handle

    def _submit(self, made: list) -> None:
        """Enqueue (request, handle) pairs as one group; raises once the LLM is shut down."""
        with self._submit_lock:
            if self._shut_down:
                raise RuntimeError("this LLM was shut down; create a new LLM to generate")
            self._executor.enqueue_requests([(req, handle._update) for req, handle in made])

    def generate_async(self, prompt: PromptInput, sampling_params: Optional[SamplingParams] = None,
                       streaming: bool = False, *, context_only: bool = False,
                       prefilled: Optional["PrefilledKV"] = None) -> GenerationResult:
        """Submit one prompt. Disaggregated serving (`serve/disagg/`): `context_only` runs the prefill
        step only (finish reason "context"; the pages stay until `release_kv`); `prefilled` continues
        a request whose prefill ran on a context worker (its KV is pulled at admission)."""
        if context_only and prefilled is not None:
            raise ValueError("a request is either context_only or prefilled, not both")
        made = self._make_request(prompt, sampling_params, streaming, context_only, prefilled)
        self._submit([made])
        return made[1]

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 ) -> Union[RequestOutput, list[RequestOutput]]:
        """Blocking generation. A single prompt returns one RequestOutput, a list returns a list.
        Every prompt is validated before any is submitted (a bad one raises and nothing runs), then
        all are submitted as one group, so the step batches, and with them the numerics, repeat
        from run to run."""
        single = _is_one_prompt(prompts)
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
                made.append(self._make_request(p, sp, False))
            except ValueError as e:
                raise ValueError(str(e) if single else f"prompt {i}: {e}") from e
        self._submit(made)
        outs = [handle.result() for _, handle in made]
        return outs[0] if single else outs

    def release_kv(self, request_id: int) -> None:
        """Free the pages a finished context-only request kept (at the engine's next step; idempotent)."""
        self._executor.release_kv(request_id)

    def abort(self, request_id: int) -> None:
        """Cancel a request by id (`GenerationResult.abort()` calls this), honoured at the engine's
        next step: its KV pages are freed and its `result()` returns the tokens so far with
        finish_reason "aborted". An unknown or finished id is ignored."""
        self._executor.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine (idempotent; also run at interpreter exit for an LLM not shut down).
        Requests still queued or running finish with an error, so their callers return; later
        `generate` calls raise RuntimeError."""
        with self._submit_lock:
            if self._shut_down:
                return
            self._shut_down = True
        _LIVE_LLMS.discard(self)
        self._executor.shutdown()
        gc.unfreeze()    # its heap (and any other engine's, re-frozen when the next one starts) is collectable again
        spec = self._executor.drafter
        if spec is not None and self.args.speculative_config and self.args.speculative_config.accept_stats_dir:
            spec.write_stats(Path(self.args.speculative_config.accept_stats_dir))

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
