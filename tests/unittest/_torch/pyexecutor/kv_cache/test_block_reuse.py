"""Prefix caching that the drafter follows: hash chain, LRU, ref counts, publish rules, and
end-to-end checks that a reused prefix carries the right draft-pool context.

Engine tests use tokens_per_block 8 and prompts that share long prefixes, submitted one
after the other so later prompts hit the blocks earlier ones published.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool, chain_hash
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.runtime.step import StepCommit
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker

P = 8
TARGET = KVCacheSpec("target", "gqa", 1, 2, 1, 4, torch.float32)
DRAFT = KVCacheSpec("draft", "mla", 1, 1, 1, 4, torch.float32)


def _manager(draft: bool, num_pages: int = 16) -> KVCacheManager:
    return KVCacheManager([TARGET, DRAFT] if draft else [TARGET], num_pages, P, 256,
                          torch.device("cpu"), enable_block_reuse=True, cache_salt="s")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(n)]


def _publish(kv: KVCacheManager, rid: int, toks: list[int]) -> list[int]:
    """Run request `rid` over `toks` as the executor would (all committed, draft written); return pages."""
    kv.add_sequence(rid, toks, len(toks))
    kv.ensure_capacity(rid, len(toks))
    if kv.has_draft_pool:
        kv.mark_draft_written(rid, len(toks))
    kv.commit(rid, toks, len(toks))
    return list(kv.seqs[rid].pages)


def _hashed(kv: KVCacheManager) -> list:
    return [b for b in kv.pool.blocks if b.block_hash is not None]


# ---- the pool and the manager, without a model -------------------------------------------
def test_chain_hash():
    a, b = list(range(P)), list(range(1, P + 1))
    assert chain_hash(None, a, "s") == chain_hash(None, tuple(a), "s")
    h = chain_hash(None, a, "s")
    assert chain_hash(h, b, "s") == chain_hash(chain_hash(None, a, "s"), b, "s")
    others = [chain_hash(None, b, "s"), chain_hash(h, a, "s"), chain_hash(None, a, "t"),
              chain_hash(chain_hash(None, b, "s"), b, "s")]
    assert h not in others and chain_hash(h, b, "s") not in others
    assert len(set(others)) == len(others)


def test_lru_eviction_order_and_hash_removal():
    pool = BlockPool(4, enable_reuse=True)
    bids = [pool.allocate() for _ in range(4)]
    hashes = [chain_hash(None, [i] * P, "s") for i in range(4)]
    for bid, h in zip(bids, hashes):
        pool.register(bid, h, [bid] * P)
    for bid in (2, 0, 3, 1):
        pool.release(bid)
    assert list(pool.free_queue) == [2, 0, 3, 1] and pool.num_free == 4
    pool.touch(0)                                    # a hit takes an idle cached block back
    assert pool.blocks[0].ref_count == 1 and 0 not in pool.free_queue
    assert pool.allocate() == 2                      # least recently freed goes first
    assert pool.lookup(hashes[2], [2] * P) is None and hashes[2] not in pool.hash_to_block
    assert pool.blocks[2].block_hash is None and pool.stats.evictions == 1
    assert pool.allocate() == 3
    pool.release(0)                                  # freed after 1: evicted after it
    assert [pool.allocate(), pool.allocate()] == [1, 0]
    assert pool.hash_to_block == {} and pool.stats.evictions == 4
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()


def test_manager_frees_tail_first():
    kv = _manager(draft=False)
    pages = _publish(kv, 1, list(range(3, 3 + 3 * P)))
    kv.free(1)
    assert list(kv.pool.free_queue)[-3:] == pages[::-1]


def test_ref_counts_shared_prefix():
    rng = random.Random(0)
    kv = _manager(draft=True)
    prefix = _tokens(rng, 3 * P + 2)
    _publish(kv, 1, prefix)
    kv.free(1)
    kv.add_sequence(2, prefix[:3 * P] + _tokens(rng, 5), 40)
    kv.add_sequence(3, prefix[:3 * P] + _tokens(rng, 9), 40)
    shared = list(kv.seqs[2].pages)
    assert shared == kv.seqs[3].pages and len(shared) == 3
    assert [kv.pool.blocks[b].ref_count for b in shared] == [2, 2, 2]
    kv.ensure_capacity(2, 30)
    kv.ensure_capacity(3, 40)
    kv.free(2)
    assert [kv.pool.blocks[b].ref_count for b in shared] == [1, 1, 1]
    kv.free(3)
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    assert kv.pool.num_free == kv.available_pages() == kv.num_pages


def test_commit_publishes_only_committed_full_blocks():
    rng = random.Random(1)
    toks = _tokens(rng, 4 * P + 3)
    kv = _manager(draft=False)
    kv.add_sequence(1, toks, len(toks))
    kv.ensure_capacity(1, len(toks))
    kv.commit(1, toks, 2 * P + 5)                    # the rest are unverified drafts
    assert [b.token_ids for b in _hashed(kv)] == [tuple(toks[:P]), tuple(toks[P:2 * P])]
    # committed count past the returned tokens (a stop inside an accepted run): no short block
    kv.commit(1, toks[:3 * P - 1], 3 * P + 2)
    assert len(_hashed(kv)) == 2
    kv.commit(1, toks, len(toks))
    assert [b.token_ids for b in _hashed(kv)] == [tuple(toks[i * P:(i + 1) * P]) for i in range(4)]
    # with a draft pool a block is published only once its draft context is written
    kv2 = _manager(draft=True)
    kv2.add_sequence(1, toks, len(toks))
    kv2.ensure_capacity(1, len(toks))
    kv2.commit(1, toks, len(toks))
    assert _hashed(kv2) == []
    kv2.mark_draft_written(1, P + 3)
    kv2.commit(1, toks, len(toks))
    assert [b.token_ids for b in _hashed(kv2)] == [tuple(toks[:P])] and _hashed(kv2)[0].draft_valid


def test_match_prefix_stops_at_missing_draft_context():
    rng = random.Random(2)
    toks = _tokens(rng, 5 * P)
    kv = _manager(draft=True)
    pages = _publish(kv, 1, toks)
    kv.free(1)
    query = toks + _tokens(rng, 3)
    assert kv.match_prefix_peek(query) == pages
    kv.pool.blocks[pages[2]].draft_valid = False     # target KV cached, draft context not
    assert kv.match_prefix_peek(query) == pages[:2]
    assert kv.pool.stats.draft_recompute_blocks == 0  # a peek does not count
    assert kv.add_sequence(2, query, len(query) + 4) == 2 * P
    rep = kv.report()["reuse"]
    assert rep["draft_recompute_blocks"] == 1 and rep["hit_blocks"] == 2
    assert rep["reused_tokens"] == rep["draft_reused_tokens"] == 2 * P
    assert rep["lookup_tokens"] == len(toks) + len(query)
    assert rep["hit_rate"] == rep["draft_hit_rate"] == pytest.approx(2 * P / (len(toks) + len(query)))
    assert _manager(draft=False).report()["reuse"]["draft_hit_rate"] is None


# ---- the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafters(tiny_drafters):
    return tiny_drafters


def _engine(make_llm, target, drafter=None, reuse=True, **kw):
    spec = {"decoding_type": "DSpark", "speculative_model": drafter} if drafter else None
    return make_llm(target, speculative_config=spec,
                    kv_cache_config={"max_tokens": 1024, "tokens_per_block": P, "enable_block_reuse": reuse},
                    **kw)


def _settle(llm, timeout: float = 30.0) -> None:
    """Wait until the executor finished its step (result() returns mid-step) and freed everything."""
    end = time.time() + timeout
    while llm._executor.scheduler.has_work or llm._bundle.kv.seqs:
        if time.time() > end:
            raise TimeoutError("executor did not go idle")
        time.sleep(0.005)


def _sequential(llm, max_tokens: int = 12, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompts with long shared prefixes, one at a time; the third extends the first's answer."""
    rng = random.Random(seed)
    system = _tokens(rng, 37)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for make in (lambda: system + _tokens(rng, 11), lambda: system + _tokens(rng, 5),
                 lambda: runs[0][0] + runs[0][1] + _tokens(rng, 6), lambda: system[:20] + _tokens(rng, 9),
                 lambda: runs[0][0]):
        prompt = make()
        runs.append((prompt, llm.generate(prompt, params).outputs[0].token_ids))
    _settle(llm)
    return runs


@pytest.mark.parametrize("kind", [None, "gqa", "mla"])
def test_reuse_on_matches_off(make_llm, tiny_llama_dir, drafters, kind):
    drafter = drafters[kind] if kind else None
    results, stats = {}, {}
    for reuse in (False, True):
        llm = _engine(make_llm, tiny_llama_dir, drafter, reuse)
        results[reuse] = _sequential(llm)
        stats[reuse] = llm.get_stats()["prefix_cache"]
        kv = llm._bundle.kv
        assert all(b.ref_count == 0 for b in kv.pool.blocks) and kv.pool.num_free == kv.num_pages
    assert results[True] == results[False]
    assert stats[False]["hit_rate"] == 0.0 and stats[False]["reused_tokens"] == 0
    assert stats[True]["hit_rate"] > 0.3 and stats[True]["reused_tokens"] % P == 0
    if kind:
        assert stats[True]["draft_hit_rate"] == stats[True]["hit_rate"]


def test_shared_prefix_in_flight_has_ref_count_two(make_llm, tiny_llama_dir, drafters, monkeypatch):
    seen = []
    orig = KVCacheManager.add_sequence

    def spy(self, req_id, token_ids, reserve):
        cached = orig(self, req_id, token_ids, reserve)
        seen.append([self.pool.blocks[b].ref_count for b in self.seqs[req_id].pages[:cached // P]])
        return cached
    monkeypatch.setattr(KVCacheManager, "add_sequence", spy)
    llm = _engine(make_llm, tiny_llama_dir, drafters["gqa"])
    rng = random.Random(5)
    prefix = _tokens(rng, 4 * P)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate(prefix + _tokens(rng, 3), params)
    _settle(llm)
    llm.generate([prefix + _tokens(rng, 4), prefix + _tokens(rng, 7)], params)
    _settle(llm)
    assert seen[1:] == [[1] * 4, [2] * 4]
    kv = llm._bundle.kv
    assert all(b.ref_count == 0 for b in kv.pool.blocks) and kv.pool.num_free == kv.num_pages


# ---- partial hit: the drafter's context for the reused prefix and the tail ---------------
def _by_position(kv: KVCacheManager, pool: str, pages: list[int], n: int) -> torch.Tensor:
    """[n, layers, planes, heads, D] context of positions 0..n-1 gathered through `pages`."""
    pos = torch.arange(n)
    return kv.pools[pool][:, torch.tensor(pages)[pos // P], :, :, pos % P, :].clone()


@pytest.fixture
def snapshots(monkeypatch):
    """(kv id, request id) -> (draft ctx, target KV) per position, taken just before `free`."""
    snaps = {}
    orig = KVCacheManager.free

    def free(self, req_id):
        seq = self.seqs.get(req_id)
        if seq is not None and self.has_draft_pool:
            n = min(seq.num_draft_valid_tokens, len(seq.pages) * P)
            snaps[(id(self), req_id)] = (_by_position(self, "draft", seq.pages, n),
                                         _by_position(self, "target", seq.pages, n))
        orig(self, req_id)
    monkeypatch.setattr(KVCacheManager, "free", free)
    return snaps


def _zero_reused_draft_pages(monkeypatch):
    orig = KVCacheManager.add_sequence

    def broken(self, req_id, token_ids, reserve):
        cached = orig(self, req_id, token_ids, reserve)
        self.pools["draft"][:, self.seqs[req_id].pages[:cached // P]] = 0
        return cached
    monkeypatch.setattr(KVCacheManager, "add_sequence", broken)


def _tail_from_position_zero(monkeypatch):
    orig = DSparkWorker._write_context     # the draft-context write of every path (arrivals too)

    def broken(self, commits, captured):
        commits = [StepCommit(c.req, c.row0, c.start - c.req.num_cached_prompt if c.start < c.req.prompt_len
                              else c.start, c.count) for c in commits]
        return orig(self, commits, captured)
    monkeypatch.setattr(DSparkWorker, "_write_context", broken)


def _partial_hit(make_llm, target, drafter, snaps, monkeypatch, breakage=None):
    """Prompt B reuses A's first 4 blocks; returns (cached, on, off) snapshots of B."""
    rng = random.Random(7)
    prefix = _tokens(rng, 4 * P + 3)
    a, b = prefix + _tokens(rng, 6), prefix + _tokens(rng, 13)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with monkeypatch.context() as m:
        if breakage is not None:
            breakage(m)
        on = _engine(make_llm, target, drafter, reuse=True)
        on.generate(a, params)
        _settle(on)
        out_on = on.generate(b, params)
        _settle(on)
    off = _engine(make_llm, target, drafter, reuse=False)
    out_off = off.generate(b, params)
    _settle(off)
    assert out_on.outputs[0].token_ids == out_off.outputs[0].token_ids     # lossless either way
    snap_on = snaps[(id(on._bundle.kv), out_on.request_id)]
    snap_off = snaps[(id(off._bundle.kv), out_off.request_id)]
    n = min(snap_on[0].shape[0], snap_off[0].shape[0])
    assert n >= len(b) + 1
    return out_on.metrics["num_cached_prompt_tokens"], [s[:n] for s in snap_on], [s[:n] for s in snap_off], len(b)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_partial_hit_draft_context_matches_fresh_prefill(make_llm, tiny_llama_dir, drafters, snapshots,
                                                         monkeypatch, kind):
    cached, (d_on, t_on), (d_off, t_off), prompt_len = _partial_hit(
        make_llm, tiny_llama_dir, drafters[kind], snapshots, monkeypatch)
    assert cached == 4 * P
    assert d_on.abs().amax() > 0.1                               # real context, not zeros
    for lo, hi in ((0, cached), (cached, prompt_len), (prompt_len, d_on.shape[0])):
        assert (d_on[lo:hi] - d_off[lo:hi]).abs().max() <= 1e-5, (lo, hi)   # prefix, tail, outputs
        assert (t_on[lo:hi] - t_off[lo:hi]).abs().max() <= 1e-5, (lo, hi)


@pytest.mark.parametrize("breakage", [_zero_reused_draft_pages, _tail_from_position_zero])
def test_partial_hit_negative_controls(make_llm, tiny_llama_dir, drafters, snapshots, monkeypatch, breakage):
    cached, (d_on, t_on), (d_off, t_off), _ = _partial_hit(
        make_llm, tiny_llama_dir, drafters["mla"], snapshots, monkeypatch, breakage)
    assert cached == 4 * P
    assert (d_on - d_off).abs().max() > 0.1                     # far outside 1e-5
    assert (t_on - t_off).abs().max() <= 1e-5                   # the target never noticed


# ---- only verified tokens are hashed -----------------------------------------------------
def _bad_hashed_blocks(kv: KVCacheManager, sequences) -> list:
    """Hashed blocks that are not a full, block-aligned chunk (with its chain hash) of a sequence."""
    expected = {}
    for seq in sequences:
        parent = None
        for i in range(len(seq) // P):
            chunk = tuple(seq[i * P:(i + 1) * P])
            parent = chain_hash(parent, chunk, kv.cache_salt)
            expected[parent] = chunk
    return [b for b in _hashed(kv) if expected.get(b.block_hash) != b.token_ids]


def _accept_all(self, req, verified, num_drafts):
    """Broken verifier: trusts every verified draft (then appends the verified row's last token)."""
    out = list(req.draft_tokens)[:num_drafts] + [verified[-1]]
    self.stats_.record(len(out) - 1, num_drafts)
    req.draft_tokens, req.draft_probs = [], None
    return out


@pytest.mark.parametrize("broken", [False, True])
def test_only_verified_tokens_are_hashed(make_llm, tiny_llama_dir, drafters, monkeypatch, broken):
    truth = _sequential(_engine(make_llm, tiny_llama_dir, reuse=False))      # no drafter
    if broken:
        monkeypatch.setattr(DSparkWorker, "accept", _accept_all)
    llm = _engine(make_llm, tiny_llama_dir, drafters["gqa"])
    runs = _sequential(llm)
    spec = llm.get_stats()["speculative"]
    kv = llm._bundle.kv
    assert spec["draft_tokens"] > 0 and len(_hashed(kv)) >= 10
    bad = _bad_hashed_blocks(kv, [p + o for p, o in truth])
    if broken:
        assert runs != truth and bad                       # the check sees unverified drafts
    else:
        assert runs == truth and spec["acceptance_rate"] < 0.5 and bad == []


def test_stop_inside_accepted_run_publishes_no_short_block(make_llm, tiny_llama_dir, drafters, monkeypatch):
    """Oracle drafts are all accepted; a stop token inside the run leaves num_computed past the output."""
    rng = random.Random(3)
    prompt = _tokens(rng, 21)
    base = _engine(make_llm, tiny_llama_dir, reuse=False).generate(
        prompt, SamplingParams(max_tokens=24, ignore_eos=True)).outputs[0].token_ids
    orig = DSparkWorker._draft_group

    def oracle(self, reqs, s):
        orig(self, reqs, s)
        for req in reqs:
            k = len(req.draft_tokens)
            req.draft_tokens = (base[len(req.output_token_ids):] + [7] * k)[:k]
    monkeypatch.setattr(DSparkWorker, "_draft_group", oracle)
    # the arrival drafts through the eager draft block (where the oracle sits), not the device draft step
    monkeypatch.setattr(DSparkWorker, "_launch_from_last", lambda self, commits, captured: [c.req for c in commits])
    monkeypatch.setattr(DSparkWorker, "draft_arrivals", lambda self, commits, anchors, captured: None)
    llm = _engine(make_llm, tiny_llama_dir, drafters["mla"])
    for j in (2, 6, 11):
        stop = base[j]
        out = llm.generate(prompt, SamplingParams(max_tokens=24, stop_token_ids=[stop])).outputs[0].token_ids
        _settle(llm)
        assert out == base[:base.index(stop)]
        assert _bad_hashed_blocks(llm._bundle.kv, [prompt + out]) == []
    assert llm.get_stats()["speculative"]["acceptance_length"] > 2.0
