"""Drafter-training data (`tools/dspark_data.py`): sharded and sampled regeneration, answers per
prompt, ShareGPT turn export and prompt selection, on the tiny target."""
from __future__ import annotations

import json

import pytest

from dspark_tiny import tiny_config
from tensorrt_llm.tools.dspark_data import answer_seed, load_data, regenerate, shard_file
from tensorrt_llm.tools.train_dspark import _split, main


def test_sharded_regeneration_from_gzip_prompts(tiny_target, tmp_path):
    """Shards i::n (separate `--stage data --shard i` runs, here with grouped admission) together
    equal the unsharded data."""
    import gzip
    import yaml
    whole = tiny_config(tiny_target, tmp_path / "whole" / "x", "gqa")
    ref = regenerate(whole)
    gz = tmp_path / "prompts.json.gz"
    gz.write_bytes(gzip.compress((tiny_target / "prompts.json").read_bytes()))
    cfg = tiny_config(tiny_target, tmp_path / "sh" / "x", "gqa", steps=2, eval_every=1)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prompts_file": str(gz), "num_shards": 2,
                                                                      "gen_batch": 3, "gen_admit_min_slots": 2})})
    path = tmp_path / "sh.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(exclude_none=True)))
    assert main(["--config", str(path), "--stage", "data", "--shard", "1"]) == 0
    with pytest.raises(SystemExit, match="shard 0 has not finished"):
        main(["--config", str(path), "--stage", "train"])
    assert main(["--config", str(path), "--stage", "data", "--shard", "0"]) == 0
    rows = load_data(cfg)
    by_prompt = {tuple(r["prompt_ids"]): r["output_ids"] for r in ref}
    assert len(rows) == len(ref) == 12
    assert [tuple(r["prompt_ids"]) for r in rows] == [tuple(r["prompt_ids"]) for r in ref[0::2] + ref[1::2]]
    assert all(by_prompt[tuple(r["prompt_ids"])] == r["output_ids"] for r in rows)
    assert main(["--config", str(path), "--stage", "train"]) == 0
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--stage", "train", "--shard", "0"])
    with pytest.raises(ValueError, match="outside"):
        regenerate(cfg, 2)


def test_sampled_regeneration_is_seeded(tiny_target, tmp_path):
    """data.temperature > 0 (more answers per prompt): reproducible for a seed, other answers than
    greedy (the control), other answers for another train.seed; the seed is part of the cache meta."""
    def sampled(name: str, seed: int) -> list[dict]:
        cfg = tiny_config(tiny_target, tmp_path / name / "x", "gqa", seed=seed)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"temperature": 0.7})})
        rows = regenerate(cfg)
        meta = json.loads(cfg.cache_file.with_suffix(".meta.json").read_text())
        assert meta["temperature"] == 0.7 and meta["seed"] == seed
        return rows
    greedy = regenerate(tiny_config(tiny_target, tmp_path / "greedy" / "x", "gqa"))
    a, again, other = sampled("a", 0), sampled("again", 0), sampled("other", 1)
    assert [r["prompt_ids"] for r in a] == [r["prompt_ids"] for r in greedy]
    assert a == again
    assert sum(x["output_ids"] != y["output_ids"] for x, y in zip(a, greedy)) >= 6
    assert sum(x["output_ids"] != y["output_ids"] for x, y in zip(a, other)) >= 6
    # sharded: each answer's seed follows its prompt, not its place in a shard, so three shards give
    # the unsharded answers (with per-shard seeds, shard 1's first prompt drew shard 0's first stream)
    cfg = tiny_config(tiny_target, tmp_path / "sh" / "x", "gqa", seed=0)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"temperature": 0.7, "num_shards": 3})})
    for shard in range(3):
        regenerate(cfg, shard)
    by_prompt = {tuple(r["prompt_ids"]): r["output_ids"] for r in a}
    rows = load_data(cfg)
    assert len(rows) == len(a) and all(by_prompt[tuple(r["prompt_ids"])] == r["output_ids"] for r in rows)
    assert json.loads(shard_file(cfg, 1).with_suffix(".meta.json").read_text())["seeds_by"] == "prompt"
    seeds = [answer_seed(s, p, k) for s in range(3) for p in range(2000) for k in range(3)]
    assert len(set(seeds)) == len(seeds)
    assert answer_seed(0, 5, 0) == 5 and answer_seed(1, 5, 1) != answer_seed(0, 6, 1)  # seeds don't shift into each other


def test_answers_per_prompt(tiny_target, tmp_path):
    """data.answers_per_prompt = 2: every prompt's first answer (the same tokens as one answer per
    prompt), then every prompt's second one from another seed; the held-out split is
    prompt-disjoint; greedy with more than one answer is rejected."""
    def cfg_for(name: str, n: int):
        cfg = tiny_config(tiny_target, tmp_path / name / "x", "gqa")
        return cfg.model_copy(update={"data": cfg.data.model_copy(update={"temperature": 0.9,
                                                                          "answers_per_prompt": n})})
    one = regenerate(cfg_for("one", 1))
    two = regenerate(cfg_for("two", 2))
    assert len(two) == 2 * len(one) == 24
    assert two[:12] == one                                        # answer 0 keeps the one-answer seeds
    assert [r["prompt_ids"] for r in two[12:]] == [r["prompt_ids"] for r in one]
    assert sum(a["output_ids"] != b["output_ids"] for a, b in zip(two[12:], one)) >= 6   # new answers
    tcfg = cfg_for("two", 2).train.model_copy(update={"eval_fraction": 0.2, "eval_max_sequences": 3})
    train_rows, held = _split(two, tcfg, 4)
    held_prompts = {tuple(r["prompt_ids"]) for r in held}
    assert len(held) == 3 and not held_prompts & {tuple(r["prompt_ids"]) for r in train_rows}
    assert len(train_rows) == len(two) - 2 * len(held_prompts)      # the other answers of held prompts
    with pytest.raises(ValueError, match="answers_per_prompt=2 needs data.temperature > 0"):
        tiny_config(tiny_target, tmp_path / "g" / "x", "gqa").data.model_validate(
            {"answers_per_prompt": 2, "prompts_file": str(tiny_target / "prompts.json")})


def test_sharegpt_turns_export_and_prompt_selection(tiny_target, tmp_path):
    """turns='all' yields every first turn before any later turn; export dedupes; select_prompts
    keeps order, applies the chat template, drops over-long prompts and stops at num_prompts."""
    import gzip
    from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper
    from tensorrt_llm.tools.dspark_data import _sharegpt_prompts, export_prompts, select_prompts
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hello world"},
                                           {"from": "gpt", "value": "hi"},
                                           {"from": "human", "value": "tell me a story"}]},
             {"id": "b", "conversations": [{"from": "human", "value": "describe a cat"},
                                           {"from": "gpt", "value": "a cat"},
                                           {"from": "human", "value": "hello world"},
                                           {"from": "gpt", "value": "again"},
                                           {"from": "human", "value": "why is the sky blue? " * 40}]}]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    assert list(_sharegpt_prompts(str(src), "first")) == ["hello world", "describe a cat"]
    assert list(_sharegpt_prompts(str(src), "all")) == ["hello world", "describe a cat", "tell me a story",
                                                        "hello world", "why is the sky blue? " * 40]
    out = tmp_path / "p.json.gz"
    assert export_prompts(str(src), out, "all") == 4          # the repeated "hello world" once
    texts = json.loads(gzip.decompress(out.read_bytes()))
    assert texts[:3] == ["hello world", "describe a cat", "tell me a story"]
    tok = TokenizerWrapper(tiny_target)
    cfg = tiny_config(tiny_target, tmp_path / "x", "gqa")
    data = cfg.data.model_copy(update={"prompts_file": str(out), "num_prompts": 10, "max_prompt_tokens": 40})
    got = select_prompts(data, tok)
    want = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts[:3]]
    assert got == want                                        # the long 4th prompt is dropped
    assert select_prompts(data.model_copy(update={"num_prompts": 2}), tok) == want[:2]
    # skip_prompts: the next fresh prompts after the first ones (skips qualifying prompts only)
    assert select_prompts(data.model_copy(update={"num_prompts": 1, "skip_prompts": 1}), tok) == want[1:2]
    assert select_prompts(data.model_copy(update={"skip_prompts": 2}), tok) == want[2:]
    with pytest.raises(ValueError, match="skip_prompts=3"):
        select_prompts(data.model_copy(update={"skip_prompts": 3}), tok)
    with pytest.raises(ValueError, match="no prompt left"):
        select_prompts(data.model_copy(update={"max_prompt_tokens": 8}), tok)
