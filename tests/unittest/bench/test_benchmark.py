"""`trtllm-bench` in-process on a tiny random Llama, plus its concurrency limiter on a fake LLM."""
from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tensorrt_llm.bench import benchmark as bm
from tensorrt_llm.sampling_params import SamplingParams

_CORPUS = ["the quick brown fox jumps over the lazy dog",
           "what is the capital of france? paris is the capital.",
           "write a haiku about autumn leaves and the sea",
           "explain why the sky is blue in two sentences"] * 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """LlamaConfig(hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512) + a byte-level BPE, no chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() <= 512
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                      bos_token_id=None, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    return d


def _run(argv: list[str], capsys) -> str:
    assert bm.main(argv) == 0
    return capsys.readouterr().out


def test_trtllm_bench_in_process(tiny_model, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    stdout = _run(["--model", str(tiny_model), "--num-requests", "4", "--concurrency", "1", "2",
                   "--max-tokens", "6", "--ignore-eos", "--no-chat-template", "--hf-baseline", "--no-hf-static-cache",
                   "--json", str(out_json)], capsys)
    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "llm_args", "machine", "capacity_report", "results"}
    assert report["config"]["dataset"] == "default" and report["llm_args"]["max_batch_size"] == 2
    rows = report["results"]
    assert [(r["arm"], r["concurrency"]) for r in rows] == [("trtllm", 1), ("trtllm", 2), ("hf", 1), ("hf", 2)]
    cap = report["capacity_report"]["max_tokens"]
    for r in rows:
        assert r["num_requests"] == 4 and r["output_tokens"] == 4 * 6
        assert r["requests_per_s"] > 0 and r["output_tok_s"] > 0
    for r in rows[:2]:
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["ttft_mean_s"] > 0 and r["tpot_mean_s"] > 0
        assert 0 < r["kv_peak_used_tokens"] <= cap == r["kv_capacity_tokens"]
        assert r["speculative"] is None and r["input_tokens"] > 0
    assert rows[2]["static_cache"] is False and rows[2]["device"] == report["capacity_report"]["device"]
    table = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + 4 and "TTFT p99 ms" in table[0]


def test_chat_template_required(tiny_model, capsys):
    with pytest.raises(SystemExit):
        bm.main(["--model", str(tiny_model), "--num-requests", "1", "--concurrency", "1", "--max-tokens", "2"])
    assert "has no chat_template; pass --no-chat-template" in capsys.readouterr().err


def test_build_llm_args_yaml(tiny_model, tmp_path):
    y = tmp_path / "extra.yaml"
    y.write_text("max_batch_size: 3\nkv_cache_config:\n  max_tokens: 256\n")
    a = bm.build_llm_args(str(tiny_model), str(y), [1, 16])
    assert a.max_batch_size == 3 and a.kv_cache_config.max_tokens == 256 and a.model == str(tiny_model)
    assert bm.build_llm_args(str(tiny_model), None, [1, 16]).max_batch_size == 16
    y.write_text("max_batch_sise: 3\n")
    with pytest.raises(ValueError, match="extra.yaml: invalid LLM args"):
        bm.build_llm_args(str(tiny_model), str(y), [1])


def test_build_llm_args_batch_wait_knobs(tiny_model, tmp_path):
    """Batch waiting is set only through the YAML (no CLI flag); bad values name the file."""
    y = tmp_path / "wait.yaml"
    y.write_text("batch_wait_timeout_iters: 4\nbatch_wait_max_tokens_ratio: 0.5\n")
    a = bm.build_llm_args(str(tiny_model), str(y), [64])
    assert (a.batch_wait_timeout_iters, a.batch_wait_max_tokens_ratio) == (4, 0.5)
    off = bm.build_llm_args(str(tiny_model), None, [64])
    assert (off.batch_wait_timeout_iters, off.batch_wait_max_tokens_ratio) == (0, 0.0)
    y.write_text("batch_wait_timeout_iters: 4\nbatch_wait_max_tokens_ratio: 2.0\n")
    with pytest.raises(ValueError, match="(?s)wait.yaml: invalid LLM args.*batch_wait_max_tokens_ratio"):
        bm.build_llm_args(str(tiny_model), str(y), [64])


# ---- the limiter and the stats on a fake LLM (no engine) ---------------------------------
class _FakeLLM:
    """generate_async finishes each request on a timer thread, a few ms after `hold` requests have
    been in flight at once (or 5 s at most: a slow machine's thread start does not decide the
    peak); tracks in-flight."""

    def __init__(self, hold: int = 1):
        self.hold = hold
        self.in_flight = self.peak = self.submitted = self.kv_peak = 0
        self.lock = threading.Lock()
        self.capacity_report = {"tokens_per_block": 32, "max_tokens": 1024}

    def reset_kv_peak(self):            # one KV page per request in flight
        with self.lock:
            self.kv_peak = self.in_flight

    def get_stats(self):
        with self.lock:
            return {"kv_cache": {"num_pages": 32, "free_pages": 32 - self.in_flight,
                                 "peak_used_pages": self.kv_peak},
                    "steps": {"total": 7 + self.submitted, "eager": 7 + self.submitted}}

    def generate_async(self, ids, params):
        with self.lock:
            self.in_flight += 1
            self.submitted += 1
            self.peak = max(self.peak, self.in_flight)
            self.kv_peak = max(self.kv_peak, self.in_flight)
        done = threading.Event()
        out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * params.max_tokens, finish_reason="length",
                                                       error=None)], metrics={})
        t0 = time.perf_counter()

        def finish():
            deadline = time.perf_counter() + 5.0
            while self.peak < self.hold and time.perf_counter() < deadline:
                time.sleep(0.002)
            with self.lock:
                self.in_flight -= 1
            out.metrics.update(ttft_s=0.002, e2e_s=time.perf_counter() - t0)
            done.set()
        threading.Timer(0.02, finish).start()
        return SimpleNamespace(result=lambda timeout=None: (done.wait(), out)[1])


class _StalledLLM:
    """generate_async handles that never finish (a stalled engine), with abort counted."""

    def __init__(self):
        self.aborted = 0

    def get_stats(self):
        return {"kv_cache": {"num_pages": 32, "free_pages": 32, "peak_used_pages": 0}, "steps": {"total": 3}}

    def reset_kv_peak(self):
        pass

    def generate_async(self, ids, params):
        done = threading.Event()

        def result(timeout=None):
            if not done.wait(timeout):
                raise TimeoutError(f"not finished after {timeout} s")

        def abort():
            self.aborted += 1
        return SimpleNamespace(result=result, abort=abort)


def test_a_stalled_level_stops_with_the_thread_stacks(capfd, caplog):
    """A request not finished within request_timeout_s stops the level: RuntimeError naming the level,
    every in-flight request aborted, the step counters and every thread's stack logged once; without
    the timeout the same fake would block forever, and a finishing engine passes under it (control)."""
    llm = _StalledLLM()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="concurrency 3: a request did not finish within 0.2 s"):
        bm.run_concurrency(llm, [[1, 2]] * 10, 3, SamplingParams(max_tokens=4), request_timeout_s=0.2)
    assert time.perf_counter() - t0 < 5.0
    assert llm.aborted == 3                                   # the three in flight; no more submitted
    err = capfd.readouterr().err
    assert err.count("Current thread") + err.count("Thread 0x") >= 4 and "run_concurrency" in err
    assert sum("not finished 0.2 s after its submission" in r.getMessage() for r in caplog.records) == 1
    row = bm.run_concurrency(_FakeLLM(hold=2), [[1, 2, 3]] * 4, 2, SamplingParams(max_tokens=5),
                             request_timeout_s=5.0)
    assert row["num_requests"] == 4


@pytest.mark.parametrize("c", [1, 3, 16])
def test_run_concurrency_caps_in_flight(c):
    llm = _FakeLLM(hold=min(c, 10))
    row = bm.run_concurrency(llm, [[1, 2, 3]] * 10, c, SamplingParams(max_tokens=5))
    assert llm.submitted == 10 and llm.peak == min(c, 10)
    assert row["num_requests"] == 10 and row["output_tokens"] == 50 and row["input_tokens"] == 30
    assert row["kv_peak_used_tokens"] == 32 * min(c, 10) and row["kv_capacity_tokens"] == 1024
    assert row["steps"] == {"total": 10, "eager": 10}        # the level's delta of get_stats()["steps"]


def test_gc_passes_counts_the_collections_inside_it():
    with bm.GcPasses() as passes:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    rep = passes.report()
    assert rep["passes"][0] >= 1 and rep["passes"][2] == 2 and rep["seconds"][2] > 0
    gc.collect(2)           # after the block: not counted (the callback is gone)
    assert passes.report() == rep
    row = bm.run_concurrency(_FakeLLM(hold=1), [[1, 2, 3]] * 2, 1, SamplingParams(max_tokens=5))
    assert set(row["gc"]) == {"passes", "seconds"} and len(row["gc"]["passes"]) == 3


def test_percentile_and_spec_delta():
    assert bm.percentile([], 50) is None
    assert bm.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and bm.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    before = {"accept_histogram": [2, 1, 0], "draft_tokens": 6}
    after = {"accept_histogram": [2, 2, 3], "draft_tokens": 14}
    d = bm._spec_delta(before, after)
    assert d["accept_histogram"] == [0, 1, 3] and d["acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert d["acceptance_rate"] == pytest.approx(7 / 8)
    assert bm._spec_delta(None, None) is None
    table = bm.format_table([{"arm": "x", "concurrency": 1, "requests_per_s": 1.0, "output_tok_s": 2.0,
                              "speculative": d}])
    assert table.splitlines()[-1].endswith("| 2.75 |")


def test_level_prompts_waves_and_min_requests():
    prompts = [[1], [2], [3]]
    assert bm.level_prompts(prompts, 16, None, 99) == prompts             # no waves: every prompt once
    assert bm.level_prompts(prompts, 2, 2) == [[1], [2], [3], [1]]        # waves x C, cycled
    one = bm.level_prompts(prompts, 1, 2, min_requests=16)                # batch 1 on >= 16 requests
    assert len(one) == 16 and one[3] == [1]
    assert len(bm.level_prompts(prompts, 16, 2, min_requests=16)) == 32   # waves x C already above
    with pytest.raises(SystemExit):
        bm.main(["--model", "x", "--min-requests", "0"])
