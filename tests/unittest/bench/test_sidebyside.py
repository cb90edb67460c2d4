"""tensorrt_llm.bench.sidebyside: rotation, request counts, median / min-max arithmetic (negative
control: the mean is not what is reported), arm parsing, the anchor's parsing, and a tiny CPU run of
two arms (HF + engine) whose JSON / markdown shape is checked."""
from __future__ import annotations

import json
import statistics
import textwrap

import pytest

from tensorrt_llm.bench import sidebyside as sbs


def _row(arm, c, tok_s, r, al=None, tpot=None, ttft=None):
    return {"arm": arm, "concurrency": c, "output_tok_s": tok_s, "round": r, "num_requests": 16,
            "tpot_mean_s": tpot, "speculative": None if al is None else {"acceptance_length": al},
            "ttft_mean_s": ttft, "ttft_p99_s": None if ttft is None else 3 * ttft}


def test_rotated_and_level_requests():
    assert sbs.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert sbs.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert sbs.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    # each arm leads exactly once in len(arms) rounds
    assert sorted(sbs.rotated("abc", r)[0] for r in range(3)) == ["a", "b", "c"]
    prompts = [[1], [2], [3]]
    assert sbs.level_requests(prompts, 1, 2, 16) == [prompts[i % 3] for i in range(16)]
    assert len(sbs.level_requests(prompts, 64, 2, 16)) == 128
    assert len(sbs.level_requests(prompts, 16, 2, 16)) == 32


def test_summarize_median_min_max_and_ratio():
    # tok/s chosen so that mean != median: a reported mean would fail the checks below
    rows = [_row("spec", 1, v, r, al=a, tpot=t, ttft=f) for r, (v, a, t, f) in
            enumerate([(100.0, 3.0, 0.010, 0.004), (110.0, 2.0, 0.030, 0.002), (400.0, 2.5, 0.020, 0.009)])]
    rows += [_row("base", 1, v, r) for r, v in enumerate([50.0, 55.0, 60.0])]
    rows += [_row("spec", 16, v, r, al=2.8) for r, v in enumerate([1000.0, 2000.0, 3000.0, 4000.0])]
    out = sbs.summarize(rows, ["base", "spec"], ratio_to="base")
    assert [(e["arm"], e["concurrency"]) for e in out] == [("base", 1), ("spec", 1), ("spec", 16)]
    spec1 = out[1]
    assert spec1["output_tok_s"] == {"median": 110.0, "min": 100.0, "max": 400.0, "n": 3}
    assert spec1["output_tok_s"]["median"] != pytest.approx(statistics.mean([100.0, 110.0, 400.0]))
    assert spec1["acceptance_length"] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 3}
    assert spec1["tpot_mean_s"]["median"] == pytest.approx(0.020)
    assert spec1["ratio_to"]["median_over_median"] == pytest.approx(110.0 / 55.0)
    # same-round ratios 100/50, 110/55, 400/60: their median 2.0, not the 6.67 of round 2 alone
    assert spec1["ratio_to"]["per_round"] == pytest.approx({"median": 2.0, "min": 2.0, "max": 400.0 / 60.0, "n": 3})
    assert out[0]["acceptance_length"] is None and out[0]["ratio_to"]["median_over_median"] == 1.0
    assert out[2]["output_tok_s"]["median"] == 2500.0           # even count: midpoint
    assert out[2]["ratio_to"] is None                            # no base row at C=16
    md = sbs.format_markdown(out)
    lines = md.splitlines()
    assert len(lines) == 2 + 3 and "x base" in lines[0]
    assert spec1["ttft_mean_s"]["median"] == pytest.approx(0.004) and spec1["ttft_p99_s"]["max"] == pytest.approx(0.027)
    assert ("| spec | 1 | 3 | 16 | 110 (100-400) | 20.00 (10.00-30.00) | 4.0 / 12.0 | 2.50 (2.00-3.00) | "
            "2.00 (rounds 2.00-6.67) |") in lines
    assert "| spec | 16 | 4 | 16 | 2,500 (1,000-4,000) | - | - | 2.80 (2.80-2.80) | - |" in lines
    compact = sbs.format_compact(out).splitlines()
    assert compact[0] == "| arm | C=1 tok/s | C=16 tok/s | AL |"
    assert compact[2:] == ["| base | 55 (50-60) | - |  |", "| spec | 110 (100-400) | 2,500 (1,000-4,000) | 2.50 / 2.80 |"]


def test_summarize_step_counts_median_over_rounds():
    """Engine rows carry the level's `get_stats()["steps"]`: the summary holds their medians and the
    median ms per step (elapsed / total of each round, not a ratio of medians); rows without counts
    (HF) have none, and the markdown gets a steps table for the engine arms only."""
    steps = [{"total": 100, "one_graph": 80, "with_prompt_chunks": 20, "seconds": 0.9,
              "seconds_with_prompt_chunks": 0.45, "seconds_reading_tokens": 0.09},
             {"total": 200, "one_graph": 150, "with_prompt_chunks": 50, "seconds": 0.5,
              "seconds_with_prompt_chunks": 0.1, "seconds_reading_tokens": 0.3},
             {"total": 400, "one_graph": 390, "with_prompt_chunks": 10, "seconds": 0.8,
              "seconds_with_prompt_chunks": 0.2, "seconds_reading_tokens": 0.4}]
    rows = [{**_row("spec", 64, 1000.0, r), "steps": st, "elapsed_s": el}
            for r, (st, el) in enumerate(zip(steps, [1.0, 0.5, 0.8]))]
    rows += [_row("hf", 64, 500.0, r) for r in range(3)]
    out = sbs.summarize(rows, ["spec", "hf"], ratio_to=None)
    assert out[0]["steps"] == {"total": 200, "one_graph": 150, "with_prompt_chunks": 20, "seconds": 0.8,
                               "seconds_with_prompt_chunks": 0.2, "seconds_reading_tokens": 0.3,
                               "ms_per_step": pytest.approx(2.5),   # 10.0 / 2.5 / 2.0
                               "prompt_step_time_share": pytest.approx(0.25),   # 0.5 / 0.2 / 0.25 per round
                               "read_wait_share": pytest.approx(0.5)}           # 0.1 / 0.6 / 0.5 per round
    assert out[1]["steps"] is None
    md = sbs.format_markdown(out).splitlines()
    assert ("| arm | C | steps | ms / step | time in prompt steps | time waiting for the GPU | one_graph "
            "| with_prompt_chunks |") in md
    assert "| spec | 64 | 200 | 2.50 | 25% | 50% | 150 | 20 |" in md
    assert sum(line.startswith("| hf |") for line in md) == 1                 # the tok/s table only


def test_parse_arm(tmp_path):
    assert sbs.parse_arm("hf=hf").is_hf
    a = sbs.parse_arm("fi={attn_backend: FLASHINFER, use_cuda_graph: true}")
    assert a.name == "fi" and a.llm_args == {"attn_backend": "FLASHINFER", "use_cuda_graph": True}
    y = tmp_path / "g.yaml"
    y.write_text("speculative_config: {decoding_type: DSpark, speculative_model: /x}\n")
    assert sbs.parse_arm(f"gqa={y}").llm_args["speculative_config"]["speculative_model"] == "/x"
    for bad in ["nospec", "=hf", "x=[1, 2]", "x={model: /m}"]:
        with pytest.raises(ValueError):
            sbs.parse_arm(bad)


def test_run_anchor_parses_the_scripts_json(tmp_path):
    fake = tmp_path / "anchor.py"
    fake.write_text(textwrap.dedent("""\
        import json, sys
        res = {}
        for s in sys.argv[1:]:
            b, q = map(int, s.split("x"))
            res[f"bs{b}-q{q}"] = {"compiled_graph_ms": 0.5 * b ** 0.5 * q, "kernels_per_step": 330}
        print("bs=... noise line")
        print(json.dumps(res))
        """))
    out = sbs.run_anchor(str(fake), ["1x1", "16x1", "1x9", "16x9"])
    assert "error" not in out
    assert [c["batch"] for c in out["ceiling"]] == [1, 16]
    assert out["ceiling"][1]["decode_ms"] == pytest.approx(2.0)
    assert out["ceiling"][1]["ceiling_tok_s"] == pytest.approx(16 * 1000 / 2.0)
    assert out["ceiling"][0]["verify9_ms"] == pytest.approx(4.5)
    assert "| anchor.py | 16 | 2.000 | 8,000 | 18.000 | 330 |" in sbs.format_markdown([], out)
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)\n")
    assert "error" in sbs.run_anchor(str(bad), ["1x1"])


def test_validation_errors(tiny_llama_dir):
    args = sbs.make_parser().parse_args(["--model", str(tiny_llama_dir), "--concurrency", "1"])
    with pytest.raises(ValueError, match="engine arm"):
        sbs.run_sidebyside(args, [sbs.Arm("hf")])
    with pytest.raises(ValueError, match="unique"):
        sbs.run_sidebyside(args, [sbs.Arm("a", {}), sbs.Arm("a", {})])
    args.ratio_to = "nope"
    with pytest.raises(ValueError, match="ratio-to"):
        sbs.run_sidebyside(args, [sbs.Arm("a", {})])


def test_tiny_cpu_run_two_arms(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompts": ["the quick brown fox", "once upon a time"]}))
    out = tmp_path / "out"
    engine = "{device: cpu, attn_backend: VANILLA, kv_cache_config: {max_tokens: 2048, tokens_per_block: 16}}"
    rc = sbs.main(["--model", str(tiny_llama_dir), "--prompts-file", str(prompts), "--arm", "hf=hf",
                   "--arm", f"eng={engine}", "--concurrency", "1", "--rounds", "1", "--max-tokens", "4",
                   "--warmup-tokens", "2", "--min-requests", "2", "--ratio-to", "eng", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "sidebyside.json").read_text())
    assert [(r["arm"], r["round"], r["position"], r["concurrency"]) for r in rep["rows"]] == \
        [("hf", 0, 0, 1), ("eng", 0, 1, 1)]
    for r in rep["rows"]:
        assert r["num_requests"] == 2 and r["output_tokens"] == 8 and r["output_tok_s"] > 0
    assert [(e["arm"], e["concurrency"], e["rounds"]) for e in rep["summary"]] == [("hf", 1, 1), ("eng", 1, 1)]
    for e, r in zip(rep["summary"], rep["rows"]):
        s = e["output_tok_s"]
        assert s["median"] == s["min"] == s["max"] == r["output_tok_s"]   # one round: all three are that round
    eng = rep["summary"][1]
    assert eng["ratio_to"]["median_over_median"] == pytest.approx(1.0)
    assert rep["arms"][1]["llm_args"]["attn_backend"] == "VANILLA"
    md = (out / "sidebyside.md").read_text()
    assert "| hf | 1 | 1 | 2 |" in md and "| eng | 1 | 1 | 2 |" in md
    assert "| arm | C=1 tok/s | AL |" in md
    assert "| eng | 1 |" in capsys.readouterr().out


def test_rounds_zero_builds_and_warms_only(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hello world"]))
    engine = "{device: cpu, attn_backend: VANILLA, kv_cache_config: {max_tokens: 1024}}"
    args = sbs.make_parser().parse_args(["--model", str(tiny_llama_dir), "--prompts-file", str(prompts),
                                         "--concurrency", "1", "2", "--rounds", "0", "--max-tokens", "4"])
    rep = sbs.run_sidebyside(args, [sbs.parse_arm(f"a={engine}")])
    assert rep["rows"] == [] and rep["summary"] == []
    assert [t["event"] for t in rep["timeline"]] == ["built + warmed a"]


def test_deadline_stops_before_a_round_that_would_overrun(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hello world"]))
    engine = "{device: cpu, attn_backend: VANILLA, kv_cache_config: {max_tokens: 1024}}"
    args = sbs.make_parser().parse_args(["--model", str(tiny_llama_dir), "--prompts-file", str(prompts),
                                         "--concurrency", "1", "--rounds", "3", "--max-tokens", "2",
                                         "--min-requests", "1", "--deadline-s", "1e-6"])
    rep = sbs.run_sidebyside(args, [sbs.parse_arm(f"a={engine}"), sbs.parse_arm(f"b={engine}")])
    assert [(r["arm"], r["round"]) for r in rep["rows"]] == [("a", 0), ("b", 0)]   # round 0 always runs
    assert rep["timeline"][-1]["event"].startswith("stopped before round 1")
    assert [e["rounds"] for e in rep["summary"]] == [1, 1]


def _fake_anchor(tmp_path, body="", name="anchor.py"):
    fake = tmp_path / name
    fake.write_text(textwrap.dedent("""\
        import json, sys, time
        {body}
        print(json.dumps({{f"bs{{s.split('x')[0]}}-q{{s.split('x')[1]}}": {{"compiled_graph_ms": 1.0}}
                          for s in sys.argv[1:]}}))
        """).format(body=body))
    return str(fake)


def test_anchor_runs_after_the_rounds_in_the_time_they_leave(tiny_llama_dir, tmp_path):
    """The anchor runs last (the arms' rounds first), in what --deadline-s leaves, and the rounds keep
    --anchor-timeout-s of the deadline free for it; with no time left it is reported as not run. An
    anchor past its limit is an error entry, not a crash."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hello world"]))
    engine = "{device: cpu, attn_backend: VANILLA, kv_cache_config: {max_tokens: 1024}}"
    base = ["--model", str(tiny_llama_dir), "--prompts-file", str(prompts), "--concurrency", "1",
            "--max-tokens", "2", "--min-requests", "1", "--anchor-shapes", "1x1", "4x1"]
    args = sbs.make_parser().parse_args(base + ["--rounds", "2", "--anchor", _fake_anchor(tmp_path),
                                                "--deadline-s", "1e6", "--anchor-timeout-s", "60"])
    rep = sbs.run_sidebyside(args, [sbs.parse_arm(f"a={engine}")])
    events = [t["event"] for t in rep["timeline"]]
    assert [e.split(" (")[0] for e in events] == ["built + warmed a", "round 0 done", "round 1 done", "anchor done"]
    assert [c["batch"] for c in rep["anchor"]["ceiling"]] == [1, 4]
    # the rounds keep the anchor's time: a deadline inside it stops them after round 0
    args = sbs.make_parser().parse_args(base + ["--rounds", "3", "--anchor", _fake_anchor(tmp_path),
                                                "--deadline-s", "1e4", "--anchor-timeout-s", "1e4"])
    rep = sbs.run_sidebyside(args, [sbs.parse_arm(f"a={engine}")])
    assert [r["round"] for r in rep["rows"]] == [0]
    assert rep["timeline"][-2]["event"].endswith("less --anchor-timeout-s")
    assert "ceiling" in rep["anchor"]
    # no time left: not run
    args = sbs.make_parser().parse_args(base + ["--rounds", "1", "--anchor", _fake_anchor(tmp_path),
                                                "--deadline-s", "1e-6"])
    rep = sbs.run_sidebyside(args, [sbs.parse_arm(f"a={engine}")])
    assert rep["anchor"]["error"].startswith("not run: no time left")
    slow = sbs.run_anchor(_fake_anchor(tmp_path, "time.sleep(5)", "slow.py"), ["1x1"], timeout_s=0.5)
    assert slow["error"].startswith("anchor did not finish within")


def test_host_note_names_step_time_gpu_wait_and_full_gc_passes():
    """The per-round log line of an engine row: ms per step, the share of step time waiting for the GPU,
    and full GC passes when there were any; an HF row (no step counts, no gc) gets nothing."""
    row = {"steps": {"total": 400, "seconds": 0.8, "seconds_reading_tokens": 0.2},
           "gc": {"passes": [30, 2, 0], "seconds": [0.01, 0.002, 0.0]}}
    assert sbs._host_note(row) == ", 2.00 ms/step, 25% waiting for the GPU"
    row["gc"] = {"passes": [30, 2, 1], "seconds": [0.01, 0.002, 0.222]}
    assert sbs._host_note(row) == ", 2.00 ms/step, 25% waiting for the GPU, 1 full GC pass(es), 222 ms"
    assert sbs._host_note({"output_tok_s": 9000.0}) == ""
