"""HF transformers `generate` baseline on the same checkpoint folder and token ids.

Static batching: the prompts are cut, in order, into batches of ``batch_size``; each batch is
left-padded and generates exactly ``max_new_tokens`` tokens greedily (``min_new_tokens`` =
``max_new_tokens``, so EOS never ends a sequence early). Throughput counts only real output
tokens: ``num_prompts * max_new_tokens / total time``.

With ``static_cache`` (default: on CUDA) ``generate`` uses ``cache_implementation="static"``,
for which transformers compiles the decode step with ``torch.compile`` on CUDA; batches are
then padded to a multiple of 64 tokens so only a few shapes get compiled. transformers is
imported inside, so the rest of the bench does not need it.
"""
from __future__ import annotations

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
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, L] int64, attention_mask [B, L] int64 (0 on the left padding)."""
    width = max(len(p) for p in batch)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


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
    def generate(self, batch: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Greedy, exactly ``max_new_tokens`` per prompt. Returns the new tokens [B, max_new_tokens]."""
        multiple = PAD_MULTIPLE_STATIC if self.static_cache else 1
        ids, mask = _left_pad(batch, self.pad_id, multiple, self.device)
        kwargs: dict[str, Any] = {"cache_implementation": "static"} if self.static_cache else {}
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id, **kwargs)
        return out[:, ids.shape[1]:]

    def run(self, prompts: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int) -> dict[str, Any]:
        """Time all ``prompts`` in batches of ``batch_size`` after one warm-up batch.

        The warm-up runs the first batch (full length with a static cache, where it triggers
        compilation; 4 tokens otherwise).
        """
        if batch_size < 1 or not prompts:
            raise ValueError("need batch_size >= 1 and at least one prompt")
        batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
        self.generate(batches[0], max_new_tokens if self.static_cache else min(4, max_new_tokens))
        self._sync()
        start = time.perf_counter()
        batch_times = []
        for b in batches:
            t0 = time.perf_counter()
            new = self.generate(b, max_new_tokens)
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
            "static_cache": self.static_cache, "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def run_hf_baseline(model_dir: Union[str, Path], prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
                    max_new_tokens: int, device: Optional[str] = None, dtype: str = "auto",
                    static_cache: Optional[bool] = None) -> list[dict[str, Any]]:
    """Load ``model_dir`` once and return one ``HFBaseline.run`` result per batch size."""
    hf = HFBaseline(model_dir, device, dtype, static_cache)
    return [hf.run(prompts, bs, max_new_tokens) for bs in batch_sizes]
