"""HF transformers `generate` baseline on the same checkpoint folder and token ids.

Static batching: the prompts are cut, in order, into batches of ``batch_size``; each batch is
left-padded and generates exactly ``max_new_tokens`` tokens greedily (``min_new_tokens`` =
``max_new_tokens``, so EOS never ends a sequence early). Throughput counts only real output
tokens: ``num_prompts * max_new_tokens / total time``.

With ``static_cache`` (default: on CUDA) ``generate`` uses ``cache_implementation="static"``,
for which transformers compiles the decode step with ``torch.compile`` on CUDA; `run` pads every
batch to one width (the longest prompt of the run, rounded up to 64 tokens), so the compiled step
of each batch size is traced once, by the warm-up batch, and the timed batches reuse it. transformers is
imported inside, so the rest of the bench does not need it.

`HFProcess` runs an `HFBaseline` in a child process (the side-by-side driver's HF arm): its
`torch.compile` CUDA-graph trees clear cuBLAS workspaces process-wide whenever they record, and
the memory of a workspace that an engine's captured graph still uses can then be handed out
again; a separate process keeps the two apart (same GPU, never at the same time).
"""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

PAD_MULTIPLE_STATIC = 64


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":   # same rule as TorchLlmArgs.dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _left_pad(batch: Sequence[Sequence[int]], pad_id: int, multiple: int,
              device: torch.device, width: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, L] int64, attention_mask [B, L] int64 (0 on the left padding); L is the
    longest prompt rounded up to `multiple`, or `width` when given (at least the longest)."""
    longest = max(len(p) for p in batch)
    if width is not None and width < longest:
        raise ValueError(f"pad width {width} < the longest prompt ({longest} tokens)")
    width = width if width is not None else -(-longest // multiple) * multiple
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def static_pad_width(prompts: Sequence[Sequence[int]]) -> int:
    """The one padded prompt width of a static-cache run: the longest prompt, rounded up to 64."""
    return -(-max(len(p) for p in prompts) // PAD_MULTIPLE_STATIC) * PAD_MULTIPLE_STATIC


class HFBaseline:
    """One loaded HF model, run at several batch sizes."""

    def __init__(self, model_dir: Union[str, Path], device: Optional[str] = None, dtype: str = "auto",
                 static_cache: Optional[bool] = None):
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise ImportError("--hf-baseline needs `transformers` (pip install transformers)") from e
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _dtype(dtype, self.device)
        self.static_cache = self.device.type == "cuda" if static_cache is None else static_cache
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        cfg = self.model.config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, (list, tuple)) else (pad or 0))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, batch: Sequence[Sequence[int]], max_new_tokens: int,
                 pad_width: Optional[int] = None) -> torch.Tensor:
        """Greedy, exactly ``max_new_tokens`` per prompt. Returns the new tokens [B, max_new_tokens].
        pad_width: left-pad every prompt to this many tokens (default: the batch's own width)."""
        multiple = PAD_MULTIPLE_STATIC if self.static_cache else 1
        ids, mask = _left_pad(batch, self.pad_id, multiple, self.device, pad_width)
        kwargs: dict[str, Any] = {"cache_implementation": "static"} if self.static_cache else {}
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id, **kwargs)
        return out[:, ids.shape[1]:]

    def run(self, prompts: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int,
            pad_width: Optional[int] = None) -> dict[str, Any]:
        """Time all ``prompts`` in batches of ``batch_size`` after one warm-up batch.

        The warm-up runs the first batch (full length with a static cache, where it triggers
        compilation; 4 tokens otherwise). With a static cache every batch is padded to
        `pad_width` (default: `static_pad_width(prompts)`).
        """
        if batch_size < 1 or not prompts:
            raise ValueError("need batch_size >= 1 and at least one prompt")
        batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
        # one padded width for the run: every batch of this size has the warm-up's compiled shape
        width = (pad_width or static_pad_width(prompts)) if self.static_cache else None
        self.generate(batches[0], max_new_tokens if self.static_cache else min(4, max_new_tokens), width)
        self._sync()
        start = time.perf_counter()
        batch_times = []
        for b in batches:
            t0 = time.perf_counter()
            new = self.generate(b, max_new_tokens, width)
            self._sync()
            batch_times.append(time.perf_counter() - t0)
            if new.shape[1] != max_new_tokens:
                raise RuntimeError(f"HF generate returned {new.shape[1]} tokens, expected {max_new_tokens}")
        elapsed = time.perf_counter() - start
        n_out = len(prompts) * max_new_tokens
        return {
            "batch_size": batch_size, "num_requests": len(prompts), "elapsed_s": elapsed,
            "output_tokens": n_out, "output_tok_s": n_out / elapsed, "requests_per_s": len(prompts) / elapsed,
            # every request of a static batch finishes with its batch
            "e2e_mean_s": sum(t * len(b) for t, b in zip(batch_times, batches)) / len(prompts),
            "batch_times_s": batch_times, "pad_width": width,
            "static_cache": self.static_cache, "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def run_hf_baseline(model_dir: Union[str, Path], prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
                    max_new_tokens: int, device: Optional[str] = None, dtype: str = "auto",
                    static_cache: Optional[bool] = None) -> list[dict[str, Any]]:
    """Load ``model_dir`` once and return one ``HFBaseline.run`` result per batch size."""
    hf = HFBaseline(model_dir, device, dtype, static_cache)
    return [hf.run(prompts, bs, max_new_tokens) for bs in batch_sizes]


class HFProcess:
    """`HFBaseline` in a spawned child process: `generate` and `run` as on the baseline (ids come
    back as lists); every call waits at most `timeout_s`; `close` ends the child."""

    def __init__(self, model_dir: Union[str, Path], device: Optional[str] = None, dtype: str = "auto",
                 static_cache: Optional[bool] = None, timeout_s: float = 1800.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self._proc = ctx.Process(target=_serve_hf, args=(child, str(model_dir), device, dtype, static_cache),
                                 name="hf-baseline", daemon=True)
        self._proc.start()
        child.close()
        self._reply("loading the HF model")

    def _reply(self, what: str) -> Any:
        if not self._conn.poll(self.timeout_s):
            self.close()
            raise RuntimeError(f"HF baseline process: no answer within {self.timeout_s:.0f} s ({what})")
        try:
            status, value = self._conn.recv()
        except EOFError as e:
            raise RuntimeError(f"HF baseline process exited ({what}; exit code {self._proc.exitcode})") from e
        if status != "ok":
            raise RuntimeError(f"HF baseline process failed ({what}): {value}")
        return value

    def generate(self, batch: Sequence[Sequence[int]], max_new_tokens: int,
                 pad_width: Optional[int] = None) -> list[list[int]]:
        self._conn.send(("generate", ([list(p) for p in batch], max_new_tokens, pad_width)))
        return self._reply("generate")

    def run(self, prompts: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int,
            pad_width: Optional[int] = None) -> dict[str, Any]:
        self._conn.send(("run", ([list(p) for p in prompts], batch_size, max_new_tokens, pad_width)))
        return self._reply("run")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)
        self._conn.close()


def _serve_hf(conn, model_dir: str, device: Optional[str], dtype: str, static_cache: Optional[bool]) -> None:
    """The child of `HFProcess`: load, answer ("ok", value) or ("error", message) per request."""
    try:
        hf = HFBaseline(model_dir, device, dtype, static_cache)
    except Exception as e:   # reported to the parent, which raises
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        try:
            if op == "generate":
                conn.send(("ok", hf.generate(*args).tolist()))
            elif op == "run":
                conn.send(("ok", hf.run(*args)))
            else:
                conn.send(("error", f"unknown request {op!r}"))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
