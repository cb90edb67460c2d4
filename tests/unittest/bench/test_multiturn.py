"""The teacher-forced multi-turn benchmark on the tiny Llama with a random DSpark drafter (no downloads)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm.bench import multiturn as mt

OPTIONS = {"device": "cpu", "max_seq_len": 512, "kv_cache_config": {"max_tokens": 2048, "tokens_per_block": 8}}


def _conversations() -> list[mt.Conversation]:
    recorded = mt.Conversation("conv-a", "sharegpt", [
        "hello world, what is the capital of france?", "the quick brown fox jumps over the lazy dog",
        "a paged kv cache holds keys and values"],
        ["paris is the capital of france.", "once upon a time there was a tiny model"])
    own_answer = mt.Conversation("q-1", "mtbench", ["speculative decoding drafts several tokens",
                                                    "write a haiku about autumn leaves"], [None])
    return [recorded, own_answer]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_llama_dir) -> str:
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "target")
    d = tmp_path_factory.mktemp("multiturn_drafter")
    DSparkForCausalLMBase.random_init("mla", tc, seed=3, markov_rank=4).save_pretrained(d)
    return str(d)


def _check_report(report: dict) -> None:
    json.dumps(report, allow_nan=False)
    assert set(report) == {"config", "machine", "conversations", "subsets", "engine_prefix_cache", "turns"}
    assert [(c["subset"], c["turns"]) for c in report["conversations"]] == [("sharegpt", 3), ("mtbench", 2)]
    for sub, n_turns in (("sharegpt", 3), ("mtbench", 2)):
        s = report["subsets"][sub]
        assert set(s["arms"]) == {"off", "on", "broken"} and set(s["diffs"]) == {"on-off", "broken-off"}
        for arm, a in s["arms"].items():
            assert a["turns"] == n_turns and a["conversations"] == 1
            assert a["mean_al"] >= 1.0 and a["mean_ttft_s"] > 0 and a["turns_with_al"] == n_turns
            assert a["se_al"] is None                       # one conversation: no clustered SE
            assert a["outputs_identical_to_off"] is (None if arm == "off" else True)
        assert s["arms"]["off"]["prefix_hit_rate"] == 0.0
        assert s["arms"]["on"]["prefix_hit_rate"] > 0 and s["arms"]["broken"]["prefix_hit_rate"] > 0
        for d in s["diffs"].values():
            assert set(d) == {"mean", "se", "t", "df", "n", "clusters"} and d["n"] == n_turns
    eng = report["engine_prefix_cache"]
    assert eng["off"]["hit_rate"] == 0.0 and eng["on"]["hit_rate"] > 0
    assert eng["on"]["draft_hit_rate"] == eng["on"]["hit_rate"]
    on_turns = report["turns"]["on"]
    assert on_turns[0]["cached_tokens"] == 0 and on_turns[1]["cached_tokens"] > 0   # later turns hit
    assert all(r["verify_steps"] > 0 and r["al"] == 1 + r["accepted_drafts"] / r["verify_steps"] for r in on_turns)
    assert [r["prompt_tokens"] for r in on_turns] == [r["prompt_tokens"] for r in report["turns"]["off"]]


def test_run_multiturn_core(tiny_llama_dir, drafter):
    convs = _conversations()
    report = mt.run_multiturn(convs, str(tiny_llama_dir), drafter, max_new_tokens=8, llm_options=OPTIONS)
    _check_report(report)
    assert convs[1].answers == [None]                       # the caller's conversations are not mutated


def test_history_answer_is_teacher_forced(tiny_llama_dir):
    conv = _conversations()[1]
    copy = mt.Conversation(conv.conv_id, conv.subset, list(conv.user_turns), list(conv.answers))
    mt.fill_history([copy], str(tiny_llama_dir), OPTIONS, max_new_tokens=8)
    assert isinstance(copy.answers[0], str)
    msgs = copy.messages(1)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"] == copy.answers[0]
    with pytest.raises(ValueError, match="never generated"):
        conv.messages(1)


def test_main_cli(tiny_llama_dir, drafter, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mt, "load_sharegpt_conversations", lambda n, *a, **k: _conversations()[:1])
    monkeypatch.setattr(mt, "load_mtbench_conversations", lambda n, *a, **k: _conversations()[1:])
    out = tmp_path / "mt.json"
    assert mt.main(["--model", str(tiny_llama_dir), "--drafter", drafter, "--max-new-tokens", "8",
                    "--num-conversations", "1", "--device", "cpu", "--max-seq-len", "512",
                    "--tokens-per-block", "8", "--kv-max-tokens", "2048", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check_report(report)
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + 6 and "Δ AL vs off" in table[0]


def test_clustered_mean_matches_hand_computation():
    # clusters a: [1, 2], b: [4]; mean 7/3; residual sums a: -5/3, b: 5/3
    r = mt.clustered_mean([1.0, 2.0, 4.0], ["a", "a", "b"])
    assert r["mean"] == pytest.approx(7 / 3)
    assert r["se"] == pytest.approx(math.sqrt(2 * (25 / 9 + 25 / 9)) / 3)
    assert r["t"] == pytest.approx(r["mean"] / r["se"]) and r["df"] == 1 and r["clusters"] == 2
    assert mt.clustered_mean([1.0, 1.0], ["a", "b"])["t"] is None          # zero SE: no t
    assert mt.clustered_mean([], [])["mean"] is None


def test_break_draft_reuse_writes_tail_over_the_reused_prefix(make_llm, tiny_llama_dir, drafter):
    import time

    from tensorrt_llm import SamplingParams
    from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import chain_hash

    with pytest.raises(ValueError, match="drafter"):
        mt.break_draft_reuse(make_llm(tiny_llama_dir, kv_cache_config={"max_tokens": 256}))
    outs = {}
    for broken in (False, True):
        llm = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark", "speculative_model": drafter},
                       kv_cache_config={"max_tokens": 1024, "tokens_per_block": 8, "enable_block_reuse": True})
        if broken:
            mt.break_draft_reuse(llm)
        kv, ids = llm._bundle.kv, list(range(3, 40))
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        def first_page():
            while llm._executor.scheduler.has_work or kv.seqs:
                time.sleep(0.005)
            page = kv.pool.lookup(chain_hash(None, ids[:8], kv.cache_salt), ids[:8])
            return kv.pools["draft"][:, page].clone(), kv.pools["target"][:, page].clone()

        llm.generate(ids, params)
        draft0, target0 = first_page()
        out = llm.generate(ids + [41, 42, 43], params)
        assert out.metrics["num_cached_prompt_tokens"] == 32
        draft1, target1 = first_page()
        assert torch.equal(target1, target0)                  # the target KV is never touched
        assert torch.equal(draft1, draft0) != broken          # only the broken arm overwrites the prefix
        outs[broken] = out.outputs[0].token_ids
    assert outs[True] == outs[False]                          # lossless either way
