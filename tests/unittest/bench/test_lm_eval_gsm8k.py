"""`python -m tensorrt_llm.bench.lm_eval_gsm8k` end to end on the tiny Llama (CPU): `trtllm-serve` per arm
(no-spec, tiny DSpark-GQA / -MLA drafters) with lm-eval's local-completions against it, then lm-eval's `hf`
model; plus the task file's few-shot exemplars against lm-eval's bundled GSM8K list.

lm-eval is not installed in CI (too heavy; `pip install -e '.[eval]'`): every test here that needs it is
skipped cleanly when `lm_eval` cannot be imported.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tensorrt_llm.bench import lm_eval_gsm8k as lg

# Short questions in the tiny tokenizer's alphabet, so 1 shot + question + 8 tokens fit max_seq_len 512.
TINY_DOCS = [
    {"question": "what is 2 + 3?", "answer": "2 + 3 = 5.\n#### 5"},
    {"question": "the quick brown fox has 4 legs. how many legs do 2 foxes have?", "answer": "2 * 4 = 8.\n#### 8"},
    {"question": "hello world, what is 10 - 7?", "answer": "10 - 7 = 3.\n#### 3"},
    {"question": "once upon a time there were 6 blocks. 2 were freed. how many are left?",
     "answer": "6 - 2 = 4.\n#### 4"},
]


def _lm_eval():
    return pytest.importorskip("lm_eval", reason="lm-eval is not installed (CI does not install it: '.[eval]')")


def test_task_template_has_one_placeholder_and_local_copy_points_at_the_data(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TINY_DOCS))
    assert lg.check_data(data) == len(TINY_DOCS)
    task = yaml.safe_load(lg.write_task(tmp_path / "tasks", data).read_text())
    assert task["task"] == lg.TASK and task["num_fewshot"] == 5
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data.resolve())
    assert task["generation_kwargs"]["until"] == ["Question:", "</s>", "<|im_end|>", "\n\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        lg.check_data(bad)


def test_fewshot_exemplars_are_lm_evals_bundled_gsm8k_list_in_gsm8k_answer_form():
    lm_eval = _lm_eval()
    cot = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml").read_text())
    ours = yaml.safe_load(lg.TASK_TEMPLATE.read_text())
    assert ours["fewshot_config"]["sampler"] == "first_n"
    samples = ours["fewshot_config"]["samples"]
    assert len(samples) == ours["num_fewshot"] == 5
    for mine, ref in zip(samples, cot["fewshot_config"]["samples"][:5]):
        assert mine["question"] == ref["question"]
        m = re.fullmatch(r"(.*) The answer is (\d+)\.", ref["target"], re.S)
        assert mine["answer"] == f"{m.group(1)}\n#### {m.group(2)}"
    # negative control: the 6th bundled exemplar is not among ours
    assert cot["fewshot_config"]["samples"][5]["question"] not in {s["question"] for s in samples}


def test_compare_counts_differing_generations():
    gens = {"nospec": {0: "a", 1: "b"}, "gqa": {0: "a", 1: "b"}, "mla": {0: "a", 1: "c"}}
    same = lg.compare(gens, "nospec")
    assert same["gqa"]["same"] == 2 and same["mla"]["same"] == 1 and same["mla"]["differing_doc_ids"] == [1]
    with pytest.raises(ValueError, match="doc ids"):
        lg.compare({"nospec": {0: "a"}, "hf": {1: "a"}}, "nospec")


def test_end_to_end_tiny_model_three_engine_arms_and_hf(tiny_llama_dir, tiny_drafters, tmp_path, capsys):
    _lm_eval()
    data = tmp_path / "tiny_gsm8k.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TINY_DOCS))
    out = tmp_path / "report.json"
    rc = lg.main(["--model", str(tiny_llama_dir), "--drafter-gqa", tiny_drafters["gqa"],
                  "--drafter-mla", tiny_drafters["mla"], "--data", str(data), "--limit", "3",
                  "--num-fewshot", "1", "--max-gen-toks", "8", "--max-seq-len", "512", "--kv-tokens", "2048",
                  "--num-concurrent", "3", "--hf-batch-size", "3", "--work-dir", str(tmp_path / "work"),
                  "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    arms = {r["arm"]: r for r in report["arms"]}
    assert list(arms) == ["nospec", "gqa", "mla", "hf"]
    for r in arms.values():
        assert r["n"] == 3 and 0.0 <= r["strict-match"] <= 1.0 and 0.0 <= r["flexible-extract"] <= 1.0
    # T=0: the drafters change the steps, never the tokens
    assert report["engine_arms_identical"] is True
    for arm in ("gqa", "mla"):
        assert report["same_generations"][arm] == {"reference": "nospec", "same": 3, "of": 3, "differing_doc_ids": []}
        assert arms[arm]["generations_sha256_16"] == arms["nospec"]["generations_sha256_16"]
        assert arms[arm]["acceptance_length"] >= 1.0 and arms[arm]["verify_steps"] > 0
        assert arms[arm]["requests_failed"] == 0
    assert arms["nospec"]["acceptance_length"] is None and arms["nospec"]["generation_tokens"] > 0
    assert arms["nospec"]["engine_args"]["kv_cache_config"]["enable_block_reuse"] is True
    assert "DSpark-MLA" in capsys.readouterr().out


def test_engine_yaml_reaches_every_engine_arm_and_bad_yaml_is_refused(tmp_path, capsys):
    a = lg.make_parser().parse_args(["--engine-yaml", "{attn_backend: TRITON, use_cuda_graph: true}",
                                     "--hf-dtype", "bfloat16"])
    a.engine_yaml = {"attn_backend": "TRITON", "use_cuda_graph": True}
    for arm in ("nospec", "gqa"):
        args = lg.engine_args(arm, a)
        assert args["attn_backend"] == "TRITON" and args["use_cuda_graph"] is True
        assert ("speculative_config" in args) == (arm == "gqa")
    assert a.hf_dtype == "bfloat16"
    for bad, why in (("[1, 2]", "not a YAML mapping"), ("{a: [", "not valid YAML")):
        with pytest.raises(SystemExit):
            lg.main(["--engine-yaml", bad, "--work-dir", str(tmp_path)])
        assert why in capsys.readouterr().err
