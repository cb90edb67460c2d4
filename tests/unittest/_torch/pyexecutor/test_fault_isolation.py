"""Fault isolation and request lifecycle in the engine (issue #19 items 1, 2 and 9, the fuzz test and
the CPU soak): requests at the max_seq_len edge with DSpark lookahead, page rounding, abort from
another thread, and random mixes of all of them. Every greedy output that finished equals no-spec
greedy; pages return to the pool when the engine is idle; the engine keeps serving throughout."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest

from tensorrt_llm import LLM, SamplingParams
from tests.unittest._torch.speculative.draft_oracle import future_drafts, patch_draft_oracles


@pytest.fixture(scope="module")
def drafters(tiny_drafters):
    return tiny_drafters


def _llm(target, drafter=None, *, max_seq_len: int, tokens_per_block: int = 16, pool_tokens: int = 4096,
         reuse: bool = True, **kw) -> LLM:
    spec = None if drafter is None else {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    return LLM(str(target), device="cpu", max_seq_len=max_seq_len, speculative_config=spec,
               kv_cache_config={"max_tokens": pool_tokens, "tokens_per_block": tokens_per_block,
                                "enable_block_reuse": reuse}, **kw)


def _pages_in_use(llm: LLM) -> int:
    kv = llm.get_stats()["kv_cache"]
    return kv["num_pages"] - kv["free_pages"]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(n)]


def _mismatch(prompt: list[int], max_tokens: int, out, ref: list[int], stop_id: Optional[int] = None
              ) -> Optional[str]:
    """Why `out` disagrees with the no-spec greedy `ref` of its prompt (None when it agrees).
    A finished output must be ref[:max_tokens] (cut before the first `stop_id`, reason "stop"); an
    aborted one a prefix of that, shorter than it."""
    c = out.outputs[0]
    want = ref[:max_tokens]
    done = "length"
    if stop_id in want:
        want, done = want[:want.index(stop_id)], "stop"
    if not out.finished or c.finish_reason not in (done, "aborted") or c.error is not None:
        return f"prompt len {len(prompt)}: finished={out.finished} reason={c.finish_reason} error={c.error}"
    if c.finish_reason == done and c.token_ids != want:
        return f"prompt len {len(prompt)}, max_tokens {max_tokens}: {c.token_ids} != no-spec {want}"
    if c.finish_reason == "aborted" and (len(c.token_ids) >= max_tokens or c.token_ids != want[:len(c.token_ids)]):
        return f"prompt len {len(prompt)}: aborted output {c.token_ids} is not a short prefix of {want}"
    return None


def _assert_idle(llm: LLM) -> None:
    assert llm._executor.fatal_error is None
    assert _pages_in_use(llm) == 0, llm.get_stats()["kv_cache"]
    assert llm.get_stats()["kv_cache"]["active_sequences"] == 0


# ---- issue #19 item 1: DSpark request ending 0 or 1 token short of max_seq_len ----------------
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("max_seq_len,tokens_per_block", [(64, 16), (100, 8), (512, 16)])
def test_dspark_request_at_max_seq_len_completes(tiny_llama_dir, drafters, bounded, kind, max_seq_len,
                                                 tokens_per_block):
    """On d2a4021 a DSpark request whose prompt + max_tokens ended 0 or 1 token short of max_seq_len
    killed the executor (draft lookahead past the last page: `gather_pages` shape error) and every
    later call raised. It completes, equals no-spec greedy, and the engine serves the next request.
    512 is the tiny model's max_position_embeddings: drafts then look past the model's limit."""
    rng = random.Random(max_seq_len)
    spec = _llm(tiny_llama_dir, drafters[kind], max_seq_len=max_seq_len, tokens_per_block=tokens_per_block)
    ref = _llm(tiny_llama_dir, max_seq_len=max_seq_len, tokens_per_block=tokens_per_block)
    try:
        slack = spec._executor.scheduler.spec_slack
        for short in (0, 1):
            mt = 12 + short
            prompt = _prompt(rng, max_seq_len - mt - short)
            # the case is the one the issue names: the lookahead reaches past max_seq_len
            assert len(prompt) + mt + slack > max_seq_len
            want = ref.generate(prompt, _greedy(mt)).outputs[0].token_ids
            out = bounded(lambda: spec.generate(prompt, _greedy(mt)), timeout=120)
            assert _mismatch(prompt, mt, out, want) is None, out.outputs[0]
            assert out.outputs[0].finish_reason == "length"
            nxt = bounded(lambda: spec.generate("once upon a time", _greedy(6)), timeout=60)
            assert nxt.outputs[0].token_ids == ref.generate("once upon a time", _greedy(6)).outputs[0].token_ids
            _assert_idle(spec)
        assert spec.get_stats()["speculative"]["request_steps"] > 0
        # negative control: the comparison can fail (a reference off by one token differs)
        bad = list(want)
        bad[-1] = (bad[-1] + 1) % 512
        assert _mismatch(prompt, mt, out, bad) is not None
    finally:
        spec.shutdown()
        ref.shutdown()


# ---- issue #19 item 2: page rounding + DSpark slack near max_seq_len -----------------------------
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_page_rounded_reservation_near_max_seq_len_completes(tiny_llama_dir, drafters, bounded, kind):
    """On d2a4021, max_seq_len 128 with 8-token pages, DSpark, prompt 100 + max_tokens 28 raised
    `request 0 reserves 145 tokens > max_seq_len` inside the scheduler: fatal, the caller blocked
    forever and an innocent concurrent request failed too. Both complete and equal no-spec."""
    rng = random.Random(2)
    spec = _llm(tiny_llama_dir, drafters[kind], max_seq_len=128, tokens_per_block=8)
    ref = _llm(tiny_llama_dir, max_seq_len=128, tokens_per_block=8)
    try:
        edge, innocent = _prompt(rng, 100), _prompt(rng, 17)
        assert len(edge) + 28 + spec._executor.scheduler.spec_slack > 128      # the case
        a = spec.generate_async(edge, _greedy(28))
        b = spec.generate_async(innocent, _greedy(20))
        out_a, out_b = bounded(lambda: (a.result(timeout=60), b.result(timeout=60)), timeout=90)
        ref_a, ref_b = (o.outputs[0].token_ids for o in ref.generate([edge, innocent], [_greedy(28), _greedy(20)]))
        assert _mismatch(edge, 28, out_a, ref_a) is None and out_a.outputs[0].finish_reason == "length"
        assert _mismatch(innocent, 20, out_b, ref_b) is None and out_b.outputs[0].finish_reason == "length"
        _assert_idle(spec)
    finally:
        spec.shutdown()
        ref.shutdown()


def test_request_the_pool_can_never_hold_is_refused_at_submission(tiny_llama_dir, drafters, bounded):
    """When the KV pool itself cannot hold a request's whole life (prompt + max_tokens + draft
    slack, page-rounded), submission raises a ValueError naming the need and the limit; nothing
    hangs and the engine keeps serving. The limit is exact: one output token more than the pool
    can hold is refused, exactly as many is served."""
    spec = _llm(tiny_llama_dir, drafters["mla"], max_seq_len=128, tokens_per_block=8, pool_tokens=128)
    try:
        slack = spec._executor.scheduler.spec_slack
        prompt = _prompt(random.Random(3), 100)
        with pytest.raises(ValueError, match=f"needs {100 + 28 + slack} tokens.*holds 128"):
            bounded(lambda: spec.generate_async(prompt, _greedy(28)), timeout=10)
        fits = 128 - slack - 100                     # the most max_tokens this pool can take
        with pytest.raises(ValueError, match="holds 128"):
            spec.generate_async(prompt, _greedy(fits + 1))
        out = bounded(lambda: spec.generate(prompt, _greedy(fits)), timeout=60)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == fits
        _assert_idle(spec)
    finally:
        spec.shutdown()


# ---- a forward error in a step whose prompts run beside the step in flight -------------------
@pytest.mark.parametrize("kind,mode", [("gqa", "inside"), ("mla", "inside"), ("gqa", "beside"), ("mla", "beside"),
                                       ("gqa", "apart")])
def test_forward_error_beside_a_step_in_flight_fails_that_prompt_only(tiny_llama_dir, drafters, bounded, kind,
                                                                      mode):
    """A prompt whose forward raises (not a device fault) while a DSpark step is in flight, its chunk
    beside the running requests' continued segments (in its own graph beside their one-graph step, or
    in one mixed forward with them): that prompt alone finishes with the error, the running requests go
    on, every other output equals no-spec greedy, the pages return and the engine keeps serving.
    "inside": the one-graph step that takes the prompts in its forward raises too (the step then runs
    the prompts beside it, where their own error fails them alone). Checked the other way: the failing
    forward ran with a step in flight. (Before the prompts were failed alone, the running requests of
    that step failed with it: 4 errors instead of 1.)"""
    rng = random.Random(21)
    llm = _llm(tiny_llama_dir, drafters[kind], max_seq_len=256, max_batch_size=4)
    ref = _llm(tiny_llama_dir, max_seq_len=256)
    ex = llm._executor
    real, poisoned, seen = ex.engine.forward, 499, []
    mixed = ex.engine.mixed_step
    if mode == "apart":
        ex.engine.spec_step = None     # every step through `forward`: the prompt in one mixed forward
    if mode == "beside":
        ex.engine.mixed_step = None
    if mode == "inside":
        real_mixed = mixed.run

        def mixed_run(reqs, segments, num_ctx):
            if any(s.start == 0 and list(s.token_ids)[0] == poisoned for s in segments[:num_ctx]):
                raise ValueError("boom: a poisoned prompt in the one-graph step")
            return real_mixed(reqs, segments, num_ctx)
        mixed.run = mixed_run

    def forward(segments, prompt_segments=0):
        if any(len(s.token_ids) and s.start == 0 and list(s.token_ids)[0] == poisoned for s in segments):
            seen.append(ex._spec_inflight is not None)
            raise ValueError("boom: a poisoned prompt")
        return real(segments, prompt_segments)
    ex.engine.forward = forward
    try:
        prompts = [_prompt(rng, rng.randrange(4, 30)) for _ in range(6)]
        prompts[3][0] = poisoned
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, _greedy(48))]
        first = llm.generate_async(prompts[0], _greedy(48), streaming=True)
        handles = [first] + [llm.generate_async(p, _greedy(48)) for p in prompts[1:3]]
        for snap in first:                     # the running requests generate: then the arrivals
            if len(snap.outputs[0].token_ids) >= 4:
                break
        handles += [llm.generate_async(p, _greedy(48)) for p in prompts[3:]]
        outs = bounded(lambda: [h.result(timeout=60) for h in handles], timeout=120)
        failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
        assert failed == [3] and seen and seen[0]
        assert "boom" in outs[3].outputs[0].error
        for i, o in enumerate(outs):
            if i not in failed:
                assert _mismatch(prompts[i], 48, o, want[i]) is None
        _assert_idle(llm)
        again = bounded(lambda: llm.generate(prompts[0], _greedy(48)), timeout=60)
        assert again.outputs[0].token_ids == want[0]
    finally:
        llm.shutdown()
        ref.shutdown()


# ---- issue #19 item 9: abort -----------------------------------------------------------------
@pytest.mark.parametrize("kind", [None, "gqa", "mla"])
def test_abort_from_another_thread_frees_pages_and_spares_others(tiny_llama_dir, drafters, bounded, kind):
    """A long request aborted from another thread finishes "aborted" within a bounded time with a
    prefix of its greedy output; a queued (not yet admitted) request aborts with no tokens; the
    others finish normally and equal no-spec; pages return to zero; aborting an unknown or a
    finished id is harmless and the engine keeps serving."""
    rng = random.Random(9)
    drafter = drafters[kind] if kind else None
    llm = _llm(tiny_llama_dir, drafter, max_seq_len=512, tokens_per_block=8, max_batch_size=2)
    ref = _llm(tiny_llama_dir, max_seq_len=512)
    try:
        p_long, p_other, p_queued, p_late = (_prompt(rng, n) for n in (20, 9, 13, 30))
        want = {len(p): o.outputs[0].token_ids for p, o in zip(
            (p_long, p_other, p_queued, p_late),
            ref.generate([p_long, p_other, p_queued, p_late], _greedy(480)))}
        long = llm.generate_async(p_long, _greedy(480), streaming=True)
        other = llm.generate_async(p_other, _greedy(40))
        queued = llm.generate_async(p_queued, _greedy(40))   # batch full: waits
        late = llm.generate_async(p_late, _greedy(40))
        aborted_at: dict[str, float] = {}

        def abort_queued():
            llm.abort(queued.request_id)

        def abort_long():                                # from this thread, once tokens flow
            for snap in long:
                if len(snap.outputs[0].token_ids) >= 4:
                    aborted_at["long"] = time.monotonic()
                    long.abort()
                    return

        threads = [threading.Thread(target=abort_queued), threading.Thread(target=abort_long)]
        for t in threads:
            t.start()
        outs = bounded(lambda: [h.result(timeout=60) for h in (long, other, queued, late)], timeout=90)
        done_at = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        o_long, o_other, o_queued, o_late = outs
        assert o_long.outputs[0].finish_reason == "aborted" and o_long.outputs[0].error is None
        assert _mismatch(p_long, 480, o_long, want[len(p_long)]) is None
        assert o_queued.outputs[0].finish_reason == "aborted" and o_queued.outputs[0].token_ids == []
        assert done_at - aborted_at["long"] < 30
        for p, o in ((p_other, o_other), (p_late, o_late)):
            assert o.outputs[0].finish_reason == "length" and _mismatch(p, 40, o, want[len(p)]) is None
        _assert_idle(llm)
        for rid in (long.request_id, other.request_id, 10 ** 9, -1):   # finished / unknown ids
            llm.abort(rid)
        again = bounded(lambda: llm.generate(p_other, _greedy(40)), timeout=60)
        assert again.outputs[0].token_ids == o_other.outputs[0].token_ids
        _assert_idle(llm)
    finally:
        llm.shutdown()
        ref.shutdown()


def test_idle_page_check_catches_a_leak(tiny_llama_dir, drafters, monkeypatch):
    """Negative control of `_assert_idle` (used by every test here): a KV manager that forgets to
    free one request leaves pages in use, and the check fails."""
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    orig, leaked = KVCacheManager.free, []

    def leaky_free(self, req_id):
        if not leaked:
            leaked.append(req_id)
            return
        orig(self, req_id)
    with _llm(tiny_llama_dir, drafters["mla"], max_seq_len=64) as llm:
        monkeypatch.setattr(KVCacheManager, "free", leaky_free)
        assert llm.generate("once upon a time", _greedy(8)).outputs[0].finish_reason == "length"
        assert leaked and _pages_in_use(llm) > 0
        with pytest.raises(AssertionError):
            _assert_idle(llm)


# ---- fuzz and soak ---------------------------------------------------------------------------
@dataclass
class Case:
    """One request of a fuzz run and what should happen to it."""

    prompt: list[int]
    max_tokens: int
    sampled: bool = False
    # None | "now" (right after its submission) | "timer" (a timer thread, after `delay` s) |
    # "mid" (a thread streaming it aborts once it has `after` tokens)
    abort: Optional[str] = None
    delay: float = 0.0
    after: int = 0
    refused: Optional[str] = None     # the ValueError text expected at submission
    at_edge: bool = False             # prompt + max_tokens ends at max_seq_len or one short
    stop: bool = False                # stops at a token of its no-spec output (`stop_id`, set later)
    stop_id: Optional[int] = None


@dataclass
class Setup:
    """One LLM of a fuzz run and its cases."""

    kind: Optional[str]
    max_seq_len: int
    tokens_per_block: int
    reuse: bool
    pool_tokens: int
    max_batch_size: int
    max_num_tokens: int
    cases: list[Case] = field(default_factory=list)


def _params(case: Case, seed: int) -> SamplingParams:
    if case.sampled:
        return SamplingParams(max_tokens=case.max_tokens, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
    if case.stop_id is not None:
        return SamplingParams(max_tokens=case.max_tokens, ignore_eos=True, stop_token_ids=[case.stop_id])
    return _greedy(case.max_tokens)


def _submit_and_wait(llm: LLM, cases: list[Case], timeout: float = 120.0) -> list[tuple[Case, object]]:
    """Submit the cases one by one (aborting as each says), then wait for all; returns
    (case, RequestOutput) of the cases not refused. A refusal must be the expected ValueError."""
    handles, timers = [], []
    for i, c in enumerate(cases):
        if c.refused:
            with pytest.raises(ValueError, match=c.refused):
                llm.generate_async(c.prompt, _params(c, i))
            continue
        h = llm.generate_async(c.prompt, _params(c, i), streaming=c.abort == "mid")
        if c.abort == "now":
            h.abort()
        elif c.abort == "timer":
            timers.append(threading.Timer(c.delay, h.abort))
        elif c.abort == "mid":
            timers.append(threading.Thread(target=_abort_after, args=(h, c.after)))
        if c.abort in ("timer", "mid"):
            timers[-1].start()
        handles.append((c, h))
    outs = [(c, h.result(timeout=timeout)) for c, h in handles]
    for t in timers:
        t.join(timeout=10)
    return outs


def _abort_after(handle, n: int) -> None:
    for snap in handle:
        if len(snap.outputs[0].token_ids) >= n:
            handle.abort()
            return


def _check_outputs(outs: list[tuple[Case, object]], ref: dict[tuple, list[int]]) -> list[str]:
    """Every greedy output equals (finished) or prefixes (aborted) no-spec greedy; every sampled
    one finished cleanly with max_tokens tokens or was aborted. Returns the disagreements."""
    bad = []
    for c, out in outs:
        if not c.sampled:
            why = _mismatch(c.prompt, c.max_tokens, out, ref[tuple(c.prompt)], c.stop_id)
        else:
            o = out.outputs[0]
            ok = out.finished and o.error is None and (
                (o.finish_reason == "length" and len(o.token_ids) == c.max_tokens)
                or (o.finish_reason == "aborted" and len(o.token_ids) < c.max_tokens))
            why = None if ok else f"sampled: {o.finish_reason} {o.error} {len(o.token_ids)}/{c.max_tokens}"
        if why:
            bad.append(why)
    return bad


def _references(target, setups: list[Setup]) -> dict[tuple, list[int]]:
    """No-spec greedy of every greedy prompt, as long as its longest max_tokens (a greedy output is
    a prefix of any longer one of the same prompt), from one no-spec LLM in one batch."""
    longest: dict[tuple, int] = {}
    for s in setups:
        for c in s.cases:
            if not c.sampled and not c.refused:
                key = tuple(c.prompt)
                longest[key] = max(longest.get(key, 0), c.max_tokens)
    msl = max(s.max_seq_len for s in setups)
    with _llm(target, max_seq_len=msl, pool_tokens=16384, max_batch_size=64) as ref:
        keys = list(longest)
        outs = ref.generate([list(k) for k in keys], [_greedy(longest[k]) for k in keys])
    return {k: o.outputs[0].token_ids for k, o in zip(keys, outs)}


def _make_cases(rng: random.Random, s: Setup, n: int, bases: list[list[int]], slack: int,
                page_tokens: int, num_pages: int, max_out: int = 40, p_too_long: float = 0.05,
                p_sampled: float = 0.15, p_stop: float = 0.1) -> list[Case]:
    """n random cases for setup `s`: prompts that share prefixes (block reuse) or repeat an earlier
    one, outputs that end exactly at max_seq_len or one short, some too long or over the pool
    (refused at submission), some sampled, some stopping at a stop token, some aborted right after
    submission, from a timer thread or mid-stream."""
    msl, cases = s.max_seq_len, []
    for _ in range(n):
        if cases and rng.random() < 0.15:
            prompt = list(rng.choice(cases).prompt)
        else:
            total = rng.randint(1, msl - 1)
            shared = rng.randint(0, total)
            prompt = rng.choice(bases)[:shared] + _prompt(rng, total - shared)
        room = msl - len(prompt)
        mode = rng.random()
        if mode < 0.2:
            mt = room                                    # ends exactly at max_seq_len
        elif mode < 0.35:
            mt = max(1, room - 1)                        # one short
        elif mode < 0.35 + p_too_long:
            mt = room + 1                                # too long: refused at submission
        else:
            mt = rng.randint(1, max(1, min(room, max_out)))
        c = Case(prompt, mt, sampled=rng.random() < p_sampled, at_edge=len(prompt) + mt in (msl - 1, msl))
        c.stop = not c.sampled and rng.random() < p_stop
        if len(prompt) + mt > msl:
            c.refused = "max_seq_len"
        elif -(-(len(prompt) + mt + slack) // page_tokens) > num_pages:
            c.refused = "pool holds"
        r = rng.random()
        if not c.refused and r < 0.25:
            if r < 0.08:
                c.abort = "now"
            elif r < 0.16 or mt < 2:
                c.abort, c.delay = "timer", rng.uniform(0.0, 0.1)
            else:
                c.abort, c.after = "mid", rng.randint(1, mt - 1)
        cases.append(c)
    return cases


def _oracle_drafts(monkeypatch, truth: dict[tuple, list[int]], seed: int) -> None:
    """The random drafters accept almost nothing, so half of the greedy requests (even ids) get
    the no-spec future as drafts, wrong after a prefix, on both draft paths (the eager step and
    the device step the overlap scheduler continues from): long accepted runs, commits cut by
    max_tokens and lookahead at max_seq_len. The other half keep the drafter's own drafts."""
    patch_draft_oracles(monkeypatch, future_drafts(
        truth, salt=seed, select=lambda r: r.request_id % 2 == 0 and r.sampling_params.greedy))


def _run_setups(target, drafters, setups: list[Setup], rng: random.Random, cases_per_setup: int,
                monkeypatch, wave: Optional[int] = None, **case_kw):
    """Build every setup's cases, the no-spec references, then run each setup on its own LLM
    (oracle drafts for half of the greedy requests). Returns (outputs of all setups, per-setup
    stats, references); asserts the engine survived each."""
    bases = [_prompt(rng, 128) for _ in range(4)]
    slacks: dict[Optional[str], int] = {}
    for s in setups:
        if s.kind not in slacks:      # the DSpark slack of each drafter kind (0 without one)
            with _llm(target, drafters.get(s.kind), max_seq_len=32) as probe:
                slacks[s.kind] = probe._executor.scheduler.spec_slack
        num_pages = -(-s.pool_tokens // s.tokens_per_block)
        s.cases = _make_cases(rng, s, cases_per_setup, bases, slacks[s.kind], s.tokens_per_block, num_pages,
                              **case_kw)
    ref = _references(target, setups)
    for c in (c for s in setups for c in s.cases if c.stop and not c.refused):
        c.stop_id = rng.choice(ref[tuple(c.prompt)][:c.max_tokens])
    _oracle_drafts(monkeypatch, ref, seed=rng.randrange(1 << 30))
    outs, stats = [], []
    for s in setups:
        with _llm(target, drafters.get(s.kind), max_seq_len=s.max_seq_len, tokens_per_block=s.tokens_per_block,
                  pool_tokens=s.pool_tokens, reuse=s.reuse, max_batch_size=s.max_batch_size,
                  max_num_tokens=s.max_num_tokens, enable_chunked_prefill=True) as llm:
            step = wave or len(s.cases)
            got = [o for i in range(0, len(s.cases), step) for o in _submit_and_wait(llm, s.cases[i:i + step])]
            _assert_idle(llm)
            probe = s.cases[0].prompt[:max(1, s.max_seq_len - 4)]
            again = llm.generate(probe, _greedy(3))          # the engine still serves
            assert again.outputs[0].finish_reason == "length"
            _assert_idle(llm)
            outs += got
            stats.append(llm.get_stats())
    return outs, stats, ref


def test_fuzz_engine_survives_and_greedy_equals_no_spec(tiny_llama_dir, drafters, bounded, monkeypatch):
    """300 random cases over 30 LLMs: prompt length, max_tokens (often ending at max_seq_len or
    one short), max_seq_len (up to the model's 512), tokens_per_block, drafter off / GQA / MLA,
    block reuse on / off, pool size (queueing), batch size, chunked prefill, sampled requests, stop
    tokens, aborts right after submission, from timer threads and mid-stream, requests refused at
    submission; oracle drafts for half of the greedy requests (long accepted runs). The engine
    survives every case, pages return to zero when idle, and every greedy output equals
    (finished) or prefixes (aborted) no-spec greedy."""
    rng = random.Random(19)
    kinds = [None, "gqa", "mla"]
    setups = []
    for i in range(30):
        msl = rng.choice([24, 40, 64, 100, 128, 512])
        setups.append(Setup(kind=kinds[i % 3], max_seq_len=msl, reuse=(i // 3) % 2 == 0,
                            tokens_per_block=rng.choice([1, 2, 4, 8, 16, 32, 64]),
                            pool_tokens=rng.choice([msl + 40, 2 * msl + 64, 4096]),
                            max_batch_size=rng.choice([1, 2, 4, 8]), max_num_tokens=rng.choice([16, 64, 256])))
    outs, stats, ref = bounded(lambda: _run_setups(tiny_llama_dir, drafters, setups, rng, 10, monkeypatch),
                               timeout=600)
    bad = _check_outputs(outs, ref)
    assert not bad, f"{len(bad)} of {len(outs)} outputs disagree with no-spec:\n" + "\n".join(bad[:10])
    # the fuzz exercised what it claims
    cases = [c for s in setups for c in s.cases]
    reasons = [o.outputs[0].finish_reason for _, o in outs]
    edge = [c for c, o in outs if c.at_edge and o.outputs[0].finish_reason == "length"]
    assert len(cases) >= 200
    assert reasons.count("aborted") >= 10 and reasons.count("length") >= 100 and reasons.count("stop") >= 10
    assert sum(o.outputs[0].finish_reason == "aborted" and len(o.outputs[0].token_ids) > 0 for _, o in outs) >= 10
    assert sum(c.refused is not None for c in cases) >= 5
    assert len(edge) >= 20
    assert sum(st["prefix_cache"]["hit_blocks"] for st in stats) > 0
    hists = [st["speculative"]["accept_histogram"] for st in stats if "speculative" in st]
    assert sum(h[-1] for h in hists) > 0, hists          # whole blocks of drafts were accepted
    # negative controls: the comparison fails on a reference with its last token changed, and on
    # an aborted output checked against a reference that differs in its first token
    c, o = next((c, o) for c, o in outs if not c.sampled and o.outputs[0].finish_reason == "length")
    wrong = list(ref[tuple(c.prompt)])
    wrong[c.max_tokens - 1] = (wrong[c.max_tokens - 1] + 1) % 512
    assert _check_outputs([(c, o)], {tuple(c.prompt): wrong})
    c, o = next((c, o) for c, o in outs if not c.sampled and len(o.outputs[0].token_ids) > 0
                and o.outputs[0].finish_reason == "aborted")
    wrong = list(ref[tuple(c.prompt)])
    wrong[0] = (wrong[0] + 1) % 512
    assert _check_outputs([(c, o)], {tuple(c.prompt): wrong})


def test_soak_1000_requests_mla_block_reuse_random_aborts(tiny_llama_dir, drafters, bounded, monkeypatch):
    """CPU soak: 1,000 requests of random lengths (shared prefixes, repeats, many ending at
    max_seq_len), about a quarter aborted (right after submission, from timer threads, mid-stream),
    MLA drafter, block reuse on, a pool small enough that requests queue, submitted in waves of
    100. It ends in bounded wall time, no page leaks, and every output that was not aborted equals
    no-spec greedy (aborted ones are prefixes of it)."""
    rng = random.Random(1000)
    soak = Setup(kind="mla", max_seq_len=48, tokens_per_block=8, reuse=True, pool_tokens=320,
                 max_batch_size=8, max_num_tokens=64)
    start = time.monotonic()
    outs, stats, ref = bounded(lambda: _run_setups(tiny_llama_dir, drafters, [soak], rng, 1000, monkeypatch,
                                                   wave=100, max_out=10, p_too_long=0.0, p_sampled=0.0),
                               timeout=180)
    elapsed = time.monotonic() - start
    assert len(outs) == 1000
    bad = _check_outputs(outs, ref)
    assert not bad, f"{len(bad)} of 1000 outputs disagree with no-spec:\n" + "\n".join(bad[:10])
    reasons = [o.outputs[0].finish_reason for _, o in outs]
    assert reasons.count("aborted") >= 100 and reasons.count("length") >= 600
    st = stats[0]
    assert st["prefix_cache"]["hit_blocks"] > 0 and st["speculative"]["accept_histogram"][-1] > 0
    assert st["kv_cache"]["peak_used_pages"] >= st["kv_cache"]["num_pages"] - 8   # the pool filled up
    assert sum(c.at_edge for c, _ in outs) >= 100
    assert elapsed < 180, f"soak took {elapsed:.0f} s"
