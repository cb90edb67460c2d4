"""Per-step host (Python) time of a CUDA-graph decode step, measured on the CPU.

    python -m tensorrt_llm.bench.host_overhead [--batch-sizes 1 16 64] [--json out.json] [--profile 64]

On the GPU a graph replay of SmolLM2-135M costs about 1 ms; everything else of a decode step
is host code. This runs the real host path on the CPU, with only the model faked:

* `PyExecutor.step` (real) with a real `Scheduler`, `KVCacheManager` (prefix caching on),
  `Sampler` and LLM-API `GenerationResult` callbacks over a real tokenizer;
* `ModelEngine.forward` (real) -> `CUDAGraphRunner.run` (real: `plan`, `load_inputs`,
  the FLASHINFER backend's `prepare` = `build_step_pages`), whose persistent buffers live on
  the CPU (their copies are CPU memcpys here, host-to-device copies on a GPU) and whose graph
  "replay" runs a fake model: next token = a fixed text stream indexed by (input id, position),
  as one-hot logits over a 1024-token vocabulary.

Each request has a ~200-token prompt and 256 output tokens; timing covers the decode steps
while the requests hold between `--warmup` and `--warmup + --steps` output tokens (so block
commits and page allocations at every 32 tokens are included). Components per step:

    schedule        Scheduler.schedule
    segments        PyExecutor.step before the forward (ensure_capacity, ForwardSegment)
    graph_inputs    CUDAGraphRunner.plan + load_inputs without backend.prepare
                    (slot mapping, block tables, padding, copies into the persistent buffers)
    step_pages      backend.prepare (flashinfer build_step_pages; flashinfer's own plan is not run)
    forward_other   the rest of ModelEngine.forward / CUDAGraphRunner.run (logits clone, ...)
    bookkeeping     PyExecutor.step after the forward (argmax .tolist(), _append, stop checks,
                    commit, remove_finished) without the callbacks and without the argmax itself
    callbacks       LLM-API GenerationResult._update (non-streaming; streaming in `*_stream` rows)

`total` is the whole step without the fake replay and without `argmax_cpu`, the CPU argmax
over the [B, 1024] fake logits (a kernel on a GPU; measured apart, reported, not counted).
Each value is the mean per timed step of one fresh run, in microseconds, the minimum over
`--rounds` runs (other load on the machine only ever adds time). Not measured here:
flashinfer's own `plan`, kernel launches and device syncs (the GPU-side host costs).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .._torch.attention_backend.flashinfer_backend import FlashInferAttention
from .._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
from .._torch.runtime.cuda_graph import GraphCache
from .._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from .._torch.runtime.llm_request import LlmRequest
from .._torch.pyexecutor.model_engine import ModelEngine
from .._torch.pyexecutor.py_executor import PyExecutor
from .._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from .._torch.runtime.sampler import Sampler
from .._torch.pyexecutor.scheduler import Scheduler
from ..llmapi.outputs import GenerationResult
from ..llmapi.tokenizer import TokenizerWrapper
from ..sampling_params import SamplingParams

REAL_TOKENIZER_DIR = Path.home() / ".cache" / "tensorrt_llm" / "models" / "smollm2-135m-instruct"
COMPONENTS = ("schedule", "segments", "graph_inputs", "step_pages", "forward_other", "bookkeeping",
              "callbacks")
FAKE_VOCAB = 1024   # fake logits width; stream tokens are ids below it

TEXT = (
    "The history of computing is a story of layers. Engineers built transistors, then logic gates, "
    "then processors, and each layer hid the details of the one below it. A programmer who writes a "
    "loop today rarely thinks about the voltage on a wire, yet every instruction still moves charge "
    "through silicon. Large language models add one more layer: a person describes what they want in "
    "plain words, and the model writes text, code or a plan. Serving such a model well means keeping "
    "the accelerator busy. Requests arrive at random times, their prompts differ in length, and each "
    "one stops when it has said enough. A good scheduler packs many requests into every step, reuses "
    "the keys and values of shared prefixes, and never lets the host fall behind the device. When "
    "the model is small, the device finishes a step in about a millisecond, and any time the host "
    "spends in Python between two steps is time the device sits idle. That is why serving engines "
    "capture the model in a graph, prepare the next step's inputs with a few vectorised operations, "
    "and avoid synchronising with the device more than once per step.")


# ---- tokenizer ------------------------------------------------------------------------------
def load_tokenizer(path: Optional[str], workdir: Path) -> TokenizerWrapper:
    """The given tokenizer folder, else SmolLM2's when fetched, else a tiny byte-level BPE."""
    if path:
        return TokenizerWrapper(path)
    if (REAL_TOKENIZER_DIR / "tokenizer.json").is_file():
        return TokenizerWrapper(REAL_TOKENIZER_DIR)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=FAKE_VOCAB, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([TEXT] * 4, trainer)
    tk.save(str(workdir / "tokenizer.json"))
    (workdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return TokenizerWrapper(workdir)


def token_stream(tok: TokenizerWrapper) -> list[int]:
    """Token ids of TEXT below FAKE_VOCAB, never an end id (the fake model's output stream)."""
    ends = set(tok.eos_token_ids)
    ids = [t for t in tok.encode(TEXT) if t < FAKE_VOCAB and t not in ends]
    if len(ids) < 64:
        raise ValueError(f"tokenizer yields only {len(ids)} stream tokens below {FAKE_VOCAB}")
    return ids


# ---- fake model + host-only graph runner -------------------------------------------------------
class _FakeModel(torch.nn.Module):
    """Stands in for the target: next token = stream[(31 * input_id + position) % len(stream)]."""

    def __init__(self, stream: Sequence[int]):
        super().__init__()
        self.stream = torch.tensor(stream, dtype=torch.long)

    def forward(self, input_ids, positions, kv_caches, md, backend, capture_layer_ids):
        return torch.stack([input_ids, positions], dim=-1), []    # "hidden" [T, 2]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        nxt = self.stream[(31 * hidden[:, 0] + hidden[:, 1]) % len(self.stream)]
        logits = torch.nn.functional.one_hot(nxt, FAKE_VOCAB)          # [T, FAKE_VOCAB]
        return logits.float() if float32 else logits.to(torch.bfloat16)


class _HostGraphCache(GraphCache):
    """A graph cache whose "replay" runs the fake model on the entry's persistent inputs (timed apart:
    the GPU work), so the real runner's host path runs without CUDA."""

    def __init__(self, timer: "StepTimer"):
        super().__init__(torch.device("cpu"))
        self.timer = timer

    def replay(self, entry, forward):
        if entry.graph is None:
            entry.graph = "host"
            self.num_captures += 1
        t0 = time.perf_counter()
        entry.outputs = forward(entry)
        self.timer.add("replay", time.perf_counter() - t0)
        entry.replays += 1
        self.num_replays += 1
        return entry.outputs


class _HostGraphRunner(CUDAGraphRunner):
    """The real runner with CPU buffers and a fake replay (no CUDA needed)."""

    def __init__(self, timer: "StepTimer", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = torch.device("cpu")    # built for "cuda" (its check), buffers on the CPU
        self.graphs = _HostGraphCache(timer)


# ---- timing ---------------------------------------------------------------------------------------
class StepTimer:
    """Accumulates seconds per key while `on`; `marks` holds the current step's timestamps."""

    def __init__(self):
        self.acc: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self.on = False

    def add(self, key: str, dt: float) -> None:
        if self.on:
            self.acc[key] = self.acc.get(key, 0.0) + dt

    def wrap(self, fn: Callable, key: str, mark: bool = False) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                self.add(key, t1 - t0)
                if mark:
                    self.marks[key + "_enter"], self.marks[key + "_exit"] = t0, t1
        return timed


def build(batch: int, tok: TokenizerWrapper, stream: list[int], streaming: bool, prompt_len: int,
          max_tokens: int, tokens_per_block: int, max_seq_len: int, max_batch_size: int, seed: int
          ) -> tuple[PyExecutor, StepTimer]:
    timer = StepTimer()
    per_req = -(-(prompt_len + max_tokens + 2) // tokens_per_block)
    kv = KVCacheManager([KVCacheSpec("target", "gqa", 1, 2, 1, 1, torch.float32)], batch * per_req + 64,
                        tokens_per_block, max_seq_len, torch.device("cpu"), enable_block_reuse=True,
                        cache_salt="bench")
    backend = FlashInferAttention()
    model = _FakeModel(stream)
    engine = ModelEngine(model, kv, backend, torch.device("cpu"))
    engine.graph_runner = _HostGraphRunner(timer, model, kv, backend, engine.kv_caches, torch.device("cuda"),
                                           max_batch_size)
    sched = Scheduler(kv, max_batch_size, max(batch * prompt_len, 8192), True, 1, spec_slack=1)
    ex = PyExecutor(engine, sched, Sampler(0, torch.device("cpu")), kv, tok.decode)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens)
    for rid in range(batch):
        prompt = [rng.choice(stream) for _ in range(prompt_len)]
        req = LlmRequest(rid, prompt, params, end_ids=frozenset(tok.eos_token_ids), streaming=streaming)
        handle = GenerationResult(rid, None, prompt, tok.decode, params.stop_strings,
                                  params.include_stop_str_in_output, streaming)
        ex.enqueue_request(req, timer.wrap(handle._update, "callbacks"))
    ex._drain_incoming()
    # component timers (wrapping bound methods on the instances only)
    runner = engine.graph_runner
    runner.plan = timer.wrap(runner.plan, "graph_inputs")
    runner.load_inputs = timer.wrap(runner.load_inputs, "graph_inputs")
    backend.prepare = timer.wrap(backend.prepare, "step_pages")
    sched.schedule = timer.wrap(sched.schedule, "schedule", mark=True)
    engine.forward = timer.wrap(engine.forward, "forward", mark=True)
    return ex, timer


def run_once(batch: int, streaming: bool, args, tok, stream, seed: int,
             profiler: Optional[cProfile.Profile] = None) -> dict[str, float]:
    """Mean µs per timed decode step of each component, for one fresh run."""
    ex, timer = build(batch, tok, stream, streaming, args.prompt_len, args.max_tokens,
                      args.tokens_per_block, args.max_seq_len, args.max_batch_size, seed)
    running = ex.scheduler.running
    steps = 0
    while ex.scheduler.has_work and steps < args.steps:
        n_out = min((len(r.output_token_ids) for r in running), default=0)
        timing = n_out >= args.warmup and all(r.remaining_prompt() == 0 for r in running)
        timer.on = timing
        if timing and profiler is not None:
            profiler.enable()
        timer.marks.clear()
        t0 = time.perf_counter()
        ex.step()
        t1 = time.perf_counter()
        if timing and profiler is not None:
            profiler.disable()
        if timing:
            m = timer.marks
            timer.add("step", t1 - t0)
            timer.add("segments", m["forward_enter"] - m["schedule_exit"])
            timer.add("post", t1 - m["forward_exit"])
            steps += 1
    if steps == 0:
        raise ValueError("no decode step was timed (warmup + steps beyond max_tokens?)")
    if ex.engine.graph_runner.graphs.num_replays < steps:
        raise RuntimeError(f"only {ex.engine.graph_runner.graphs.num_replays} of {steps} timed steps replayed a graph")
    acc = {k: v * 1e6 / steps for k, v in timer.acc.items()}
    g = lambda k: acc.get(k, 0.0)  # noqa: E731
    out = {
        "schedule": g("schedule"),
        "graph_inputs": g("graph_inputs") - g("step_pages"),
        "step_pages": g("step_pages"),
        "forward_other": g("forward") - g("graph_inputs") - g("replay"),
        "callbacks": g("callbacks"),
    }
    argmax = _argmax_us(batch)
    out["segments"] = g("segments")
    out["bookkeeping"] = g("post") - g("callbacks") - argmax
    out["total"] = g("step") - g("replay") - argmax
    out["argmax_cpu"] = argmax
    return out


def _argmax_us(batch: int, reps: int = 50) -> float:
    """µs of the executor's `logits.argmax(-1)` on [batch, FAKE_VOCAB] CPU logits (best of reps)."""
    logits = torch.randn(batch, FAKE_VOCAB)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        logits.argmax(-1)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(args) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(args.tokenizer, Path(tmp))
        stream = token_stream(tok)
        results: dict[str, Any] = {}
        for b in args.batch_sizes:
            row = {}
            for streaming in (False, True):
                runs = [run_once(b, streaming, args, tok, stream, seed=r) for r in range(args.rounds)]
                med = {k: min(r[k] for r in runs) for k in runs[0]}
                if streaming:
                    row["callbacks_stream"] = med["callbacks"]
                    row["total_stream"] = med["total"]
                else:
                    row.update(med)
            results[str(b)] = row
        prof_text = None
        if args.profile:
            prof = cProfile.Profile()
            run_once(args.profile, args.profile_streaming, args, tok, stream, seed=0, profiler=prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile_top)
            prof_text = s.getvalue()
    return {"us_per_step": results, "profile": prof_text,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine()}}


def format_table(results: dict[str, dict[str, float]]) -> str:
    bs = list(results)
    rows = list(COMPONENTS) + ["total", "callbacks_stream", "total_stream", "argmax_cpu"]
    lines = ["| µs per step | " + " | ".join(f"B={b}" for b in bs) + " |",
             "|---|" + "---|" * len(bs)]
    for r in rows:
        lines.append(f"| {r} | " + " | ".join(f"{results[b][r]:.0f}" for b in bs) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=64, help="output tokens before timing starts")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=5, help="fresh runs per cell (minimum reported)")
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2's, else a tiny BPE)")
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="cProfile one run at batch B")
    ap.add_argument("--profile-streaming", action="store_true")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.warmup + args.steps > args.max_tokens - 1:
        raise ValueError(f"--warmup ({args.warmup}) + --steps ({args.steps}) must stay below "
                         f"--max-tokens ({args.max_tokens})")
    if max(args.batch_sizes) > args.max_batch_size:
        raise ValueError(f"batch size {max(args.batch_sizes)} > --max-batch-size {args.max_batch_size}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = measure(args)
    print(format_table(out["us_per_step"]))
    if out["profile"]:
        print(out["profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
