"""KVCacheManager invariants: sentinel-padded block tables, writes only into owned pages,
reservations, pages back to the pool, prefix reuse of committed blocks, capacity report."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec, kv_dtype_from_name, split_budget
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager

CPU = torch.device("cpu")
P = 16


def manager(num_pages=8, reuse=False, max_seq_len=128) -> KVCacheManager:
    spec = KVCacheSpec("target", "gqa", 2, 2, 2, 8, torch.float32)
    return KVCacheManager([spec], num_pages, P, max_seq_len, CPU, enable_block_reuse=reuse, cache_salt="t")


def assert_all_returned(kv: KVCacheManager) -> None:
    assert kv.seqs == {}
    assert kv.pool.num_free == kv.num_pages
    assert kv.pool.count_ref_free_idle() and all(b.ref_count == 0 for b in kv.pool.blocks)
    assert kv.available_pages() == kv.num_pages


# ---- unit ---------------------------------------------------------------------------------
def test_reserve_then_allocate_lazily_and_free():
    kv = manager()
    assert kv.can_admit(list(range(20)), 41)
    kv.add_sequence(1, list(range(20)), 41)             # 41 tokens -> 3 pages reserved, 0 owned
    assert kv.available_pages() == 5 and kv.pool.num_free == 8 and kv.owned_tokens(1) == 0
    assert kv.ensure_capacity(1, 17) == 32              # 2 pages now
    assert kv.ensure_capacity(1, 1000) == 48            # never beyond the reservation
    assert kv.available_pages() == 5 and kv.pool.num_free == 5
    with pytest.raises(ValueError, match="already"):
        kv.add_sequence(1, [1], 2)
    kv.free(1)
    assert_all_returned(kv)


def test_scratch_pages_are_distinct_held_and_never_handed_out():
    """scratch_page(0) is the page every graph runner shares, scratch_page(1) a second one (the mixed
    one-graph step's padding verify requests): each allocated once on first use, distinct, counted as
    used for the manager's lifetime, never handed to a request. Control: the pool had them free before."""
    kv = manager(num_pages=4)
    assert kv.pool.num_free == 4
    a, b = kv.scratch_page(), kv.scratch_page(1)
    assert a != b and kv.scratch_page(0) == a and kv.scratch_page(1) == b      # the same pages again
    assert kv.pool.num_free == 2
    kv.add_sequence(1, list(range(20)), 32)
    kv.ensure_capacity(1, 32)
    assert not {a, b} & set(kv.request_pages(1))
    kv.free(1)
    assert kv.pool.num_free == 2


def test_admission_respects_reservations():
    kv = manager(num_pages=6)
    kv.add_sequence(1, [1] * 20, 41)
    kv.add_sequence(2, [2] * 20, 41)
    assert not kv.can_admit([3] * 20, 41)               # 3 more pages needed, 0 unreserved
    assert not kv.can_admit([3], 2)
    kv.free(1)
    assert kv.can_admit([3] * 20, 41)


def test_block_tables_and_slots_use_sentinels():
    kv = manager()
    kv.pool.free_queue.move_to_end(0)                   # page 0 is not the first handed out
    kv.add_sequence(1, [1] * 40, 48)
    kv.add_sequence(2, [2] * 5, 8)
    kv.ensure_capacity(1, 40)
    kv.ensure_capacity(2, 5)
    bt = kv.block_tables([1, 2])
    p1, p2 = kv.seqs[1].pages, kv.seqs[2].pages
    assert bt.dtype == torch.int32 and bt.shape == (2, 3)
    assert bt[0].tolist() == p1 and bt[1].tolist() == p2 + [BAD_PAGE_INDEX] * 2
    assert 0 not in p1 + p2 and 0 not in bt.tolist()[1]
    # positions beyond owned pages get -1 (skipped writes), never a page-0 slot
    assert kv.slots(2, 14, 4) == [p2[0] * P + 14, p2[0] * P + 15, -1, -1]
    assert kv.slots(1, 31, 2) == [p1[1] * P + 15, p1[2] * P]


def test_prefix_reuse_hashes_only_committed_full_blocks():
    kv = manager(reuse=True)
    toks = list(range(100, 150))                        # 50 tokens: 3 full blocks + 2
    kv.add_sequence(1, toks, 60)
    kv.ensure_capacity(1, 50)
    kv.commit(1, toks, 20)                              # only the first block is verified
    assert kv.seqs[1].num_hashed_blocks == 1
    kv.free(1)
    assert kv.add_sequence(2, toks, 60) == P            # one cached block, not three
    kv.free(2)
    kv.add_sequence(3, toks, 60)
    kv.ensure_capacity(3, 50)
    kv.commit(3, toks, 50)
    kv.free(3)
    assert kv.add_sequence(4, toks, 60) == 3 * P
    kv.free(4)
    # the whole prompt is never served from cache: at least one token is always computed
    assert kv.add_sequence(5, toks[:48], 60) == 2 * P
    kv.free(5)
    assert kv.add_sequence(6, [7] + toks[1:], 60) == 0  # different first block: chain breaks
    kv.free(6)
    assert_all_returned(kv)


def test_split_budget_token_parity_and_dtype():
    target = KVCacheSpec("target", "gqa", 3, 2, 2, 16, torch.bfloat16)
    draft = KVCacheSpec("draft", "mla", 1, 1, 1, 40, torch.float32)
    assert target.bytes_per_token == 3 * 2 * 2 * 16 * 2 and draft.bytes_per_token == 160
    per_page = (target.bytes_per_token + draft.bytes_per_token) * P
    assert split_budget(10 * per_page + 5, [target, draft], P) == 10
    assert split_budget(10 * per_page, [target, draft], P, fixed_bytes=per_page) == 9
    with pytest.raises(ValueError, match="smaller than one page"):
        split_budget(per_page - 1, [target, draft], P)
    assert kv_dtype_from_name("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_dtype_from_name("auto", torch.bfloat16) == torch.bfloat16


# ---- through the engine -------------------------------------------------------------------
def test_real_steps_metadata_invariants(tiny_llama_dir, make_llm, monkeypatch):
    """Every real step: table rows = owned pages then BAD_PAGE_INDEX, slots inside owned pages."""
    records = []
    orig = KVCacheManager.attention_metadata

    def spy(kv, request_ids, starts, lengths, causal):
        md = orig(kv, request_ids, starts, lengths, causal)
        records.append((list(request_ids), list(starts), list(lengths),
                        [list(kv.seqs[r].pages) for r in request_ids], md, kv.num_pages))
        return md

    monkeypatch.setattr(KVCacheManager, "attention_metadata", spy)
    llm = make_llm(tiny_llama_dir, max_num_tokens=24)
    kv = llm._bundle.kv
    kv.pool.free_queue.move_to_end(0)
    llm._executor.shutdown()                             # drive the loop by hand: deterministic batches
    lens = [5, 40, 17, 2, 33]
    handles = [llm.generate_async(list(range(10, 10 + n)), SamplingParams(max_tokens=6, ignore_eos=True))
               for n in lens]
    llm._executor.run_until_idle()
    assert all(h.result(timeout=0).finished for h in handles)
    saw_padding = False
    for rids, starts, lengths, pages, md, num_pages in records:
        md.validate(num_pages)
        bt = md.block_tables
        assert bt.dtype == torch.int32 and bt.shape[0] == len(rids)
        slots = md.slot_mapping.tolist()
        t = 0
        for i, pg in enumerate(pages):
            assert bt[i, :len(pg)].tolist() == pg
            tail = bt[i, len(pg):].tolist()
            assert all(x == BAD_PAGE_INDEX for x in tail), f"unallocated entries {tail}"
            saw_padding |= bool(tail)
            for j in range(lengths[i]):
                pos = starts[i] + j
                assert slots[t + j] == pg[pos // P] * P + pos % P   # owned page, right offset
            t += lengths[i]
        assert t == len(slots)
    assert saw_padding, "no step mixed requests with different page counts"
    assert_all_returned(kv)


@pytest.mark.parametrize("reuse", [False, True])
def test_pages_return_to_pool_after_all_requests(tiny_llama_dir, make_llm, reuse):
    llm = make_llm(tiny_llama_dir, max_num_tokens=32,
                   kv_cache_config={"max_tokens": 512, "tokens_per_block": P, "enable_block_reuse": reuse})
    prompt = list(range(20, 70))
    first = llm.generate([prompt, prompt[:30], prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert_all_returned(llm._bundle.kv)
    second = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    assert second.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert (second.metrics["num_cached_prompt_tokens"] > 0) == reuse
    report = llm.get_stats()["kv_cache"]
    assert report["free_pages"] == report["num_pages"] and report["active_sequences"] == 0
    assert_all_returned(llm._bundle.kv)


@pytest.mark.parametrize("kv_dtype,itemsize", [("auto", 4), ("bfloat16", 2)])
def test_capacity_report(tiny_llama_dir, make_llm, kv_dtype, itemsize):
    llm = make_llm(tiny_llama_dir, kv_cache_config={"max_tokens": 200, "tokens_per_block": P, "dtype": kv_dtype})
    rep = llm.capacity_report
    layers, kv_heads, head_dim = 3, 2, 16
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    pages = -(-200 // P)                                  # rounded up to whole pages
    assert rep["num_pages"] == pages and rep["max_tokens"] == pages * P
    pool = rep["pools"]["target"]
    assert pool["bytes_per_token"] == per_token == rep["bytes_per_token_total"]
    assert pool["layer_shape"] == [pages, 2, kv_heads, P, head_dim] and pool["num_layers"] == layers
    assert pool["bytes"] == per_token * pages * P
    assert pool["dtype"] == {"auto": "float32", "bfloat16": "bfloat16"}[kv_dtype]
    real = llm._bundle.kv.pools["target"]
    assert tuple(real.shape) == (layers, pages, 2, kv_heads, P, head_dim)
    assert real.element_size() == itemsize
    assert real.numel() * real.element_size() == pool["bytes"]


def test_capacity_from_cpu_budget(tiny_llama_dir, make_llm):
    per_page = 2 * 3 * 2 * 16 * 4 * P
    llm = make_llm(tiny_llama_dir, kv_cache_config={"tokens_per_block": P, "cpu_kv_budget_bytes": 10 * per_page + 7})
    assert llm.capacity_report["num_pages"] == 10


def test_export_import_pages_round_trip_per_request():
    """Pages are addressable per request: export from one manager, import into another's own pages."""
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    specs = [KVCacheSpec("target", "gqa", 2, 2, 2, 8, torch.float32),
             KVCacheSpec("draft", "mla", 1, 1, 1, 12, torch.float32)]
    src = KVCacheManager(specs, 8, 4, 64, torch.device("cpu"))
    dst = KVCacheManager(specs, 8, 4, 64, torch.device("cpu"))
    for pool in src.pools.values():
        pool.copy_(torch.randn_like(pool))
    src.add_sequence(1, [0] * 10, 10)
    src.ensure_capacity(1, 10)
    dst.add_sequence(9, [0] * 3, 3)          # occupy a page so ids differ between managers
    dst.ensure_capacity(9, 3)
    dst.add_sequence(1, [0] * 10, 10)
    dst.ensure_capacity(1, 10)
    assert src.seqs[1].pages != dst.seqs[1].pages
    data = src.export_pages(1, 10)
    assert data["target"].shape[1] == 3 and set(data) == {"target", "draft"}
    before = {k: v.clone() for k, v in dst.pools.items()}
    dst.import_pages(1, data)
    for name in data:
        got = dst.pools[name][:, torch.tensor(dst.seqs[1].pages)]
        assert torch.equal(got, src.pools[name][:, torch.tensor(src.seqs[1].pages)])
        other = [p for p in range(8) if p not in dst.seqs[1].pages]
        assert torch.equal(dst.pools[name][:, other], before[name][:, other])   # neighbours untouched
    with pytest.raises(ValueError, match="do not match"):
        dst.import_pages(1, {"target": data["target"]})


# ---- vectorised page-table views vs the per-request reference -----------------------------
def _ref_block_tables(kv: KVCacheManager, req_ids) -> list[list[int]]:
    """The straightforward per-request construction (pages padded with BAD_PAGE_INDEX)."""
    width = max([len(kv.seqs[r].pages) for r in req_ids] + [1])
    return [kv.seqs[r].pages + [BAD_PAGE_INDEX] * (width - len(kv.seqs[r].pages)) for r in req_ids]


def _random_live_manager(rng, num_pages=200, max_seq_len=96) -> KVCacheManager:
    """Requests with random page counts (0 included); some freed and their rows recycled; more
    requests than the table's first 8 rows, so it grows."""
    kv = manager(num_pages=num_pages, max_seq_len=max_seq_len)
    rid = 0
    for _ in range(3):
        for _ in range(7):
            want = rng.choice([0, max_seq_len, rng.randrange(1, max_seq_len)])
            kv.add_sequence(rid, [rid] * 3, max(want, 1))
            kv.ensure_capacity(rid, want)
            rid += 1
        for r in rng.sample(sorted(kv.seqs), 3):
            kv.free(r)
    return kv


def test_slots_batch_and_block_tables_match_reference_on_random_state():
    import random

    import numpy as np
    rng = random.Random(0)
    kv = _random_live_manager(rng)
    live = sorted(kv.seqs)
    assert len(live) > 8 and any(not kv.seqs[r].pages for r in live)
    assert any(len(kv.seqs[r].pages) == kv.max_blocks_per_seq for r in live)
    saw_unowned = saw_owned = 0
    for trial in range(200):
        ids = rng.sample(live, rng.randrange(1, len(live) + 1))
        count = rng.randrange(1, 2 * P + 2)
        starts = [rng.randrange(-3, kv.max_blocks_per_seq * P + 2 * P) for _ in ids]
        got = kv.slots_batch(ids, starts, count)
        assert got.shape == (len(ids), count) and got.dtype == np.int64
        ref = [kv.slots(r, s, count) for r, s in zip(ids, starts)]
        assert got.tolist() == ref
        saw_unowned += int((got == -1).sum())
        saw_owned += int((got >= 0).sum())
        bt = kv.block_tables(ids)
        assert bt.dtype == torch.int32 and bt.tolist() == _ref_block_tables(kv, ids)
    assert saw_unowned > 100 and saw_owned > 100        # both branches exercised
    assert kv.block_tables([]).shape == (0, 1)
    # freed rows hold only the sentinel; a recycled row holds exactly its new owner's pages
    table = kv.page_table
    used = {kv.seqs[r].row for r in live}
    assert all((table[i] == BAD_PAGE_INDEX).all() for i in range(table.shape[0]) if i not in used)
    # negative control: a table that disagrees with the page lists is caught
    r = next(r for r in live if kv.seqs[r].pages)
    table[kv.seqs[r].row, 0] += 1
    assert kv.block_tables([r]).tolist() != _ref_block_tables(kv, [r])
    assert kv.slots_batch([r], [0], 1).tolist() != [kv.slots(r, 0, 1)]


def test_owns_span_equals_the_slots_rule_on_random_state():
    """owns_span (page counts only) == every slot of the span >= 0 (`slots_batch`, the per-slot rule),
    for scalar and per-request counts, starts before, inside and past the owned pages; owned_slots ==
    slots_batch on the owned spans."""
    import random

    import numpy as np
    rng = random.Random(2)
    kv = _random_live_manager(rng)
    live = sorted(kv.seqs)
    seen = {True: 0, False: 0, "slots": 0}
    for trial in range(300):
        ids = rng.sample(live, rng.randrange(1, len(live) + 1))
        rows = kv.rows(ids)
        starts = np.array([rng.randrange(-3, kv.max_blocks_per_seq * P + P) for _ in ids], dtype=np.int64)
        count = rng.randrange(1, 3 * P) if trial % 2 else np.array([rng.randrange(1, 3 * P) for _ in ids])
        got = kv.owns_span(rows, starts, count)
        width = int(np.max(count))
        slots = kv.slots_batch(ids, starts, width, rows=rows)
        ref = [bool((slots[b, :c] >= 0).all()) for b, c in enumerate(np.broadcast_to(count, (len(ids),)))]
        assert got.tolist() == ref
        for v in ref:
            seen[v] += 1
        if np.ndim(count) == 0 and got.any():    # owned_slots: the slots' values on the owned spans
            assert (kv.owned_slots(rows[got], starts[got], count) == slots[got]).all()
            seen["slots"] += int(got.sum())
    assert seen[True] > 100 and seen[False] > 100 and seen["slots"] > 100     # both answers exercised
    # negative control: one position past the last owned page is not owned
    r = next(r for r in live if kv.seqs[r].pages)
    end = len(kv.seqs[r].pages) * P
    assert kv.owns_span(kv.rows([r]), np.array([end - 4]), 4).tolist() == [True]
    assert kv.owns_span(kv.rows([r]), np.array([end - 4]), 5).tolist() == [False]
    assert kv.owned_slots(kv.rows([r]), np.array([end - 4]), 4).tolist() == kv.slots_batch([r], [end - 4], 4).tolist()
    assert kv.owned_slots(kv.rows([r]), np.array([end - 3]), 4).tolist() != kv.slots_batch([r], [end - 4], 4).tolist()


def test_attention_metadata_matches_per_request_slots():
    """The vectorised metadata equals the per-token reference (`slots`, per-request tables) for uneven
    lengths, starts inside and past a request's owned pages, and one-token segments; negative
    control: the reference of a shifted start differs."""
    kv = manager(num_pages=40, max_seq_len=8 * P)
    owned = {1: 3 * P, 2: P, 3: 2 * P, 4: 4 * P}
    for rid, n in owned.items():
        kv.add_sequence(rid, [1], 8 * P)
        kv.ensure_capacity(rid, n)
    rids, starts, lens = [3, 1, 4, 2], [5, 0, 3 * P + 2, P - 1], [P + 4, 2 * P, 1, 3]   # 2: past its page
    md = kv.attention_metadata(rids, starts, lens, causal=True)
    want = [s for r, st, n in zip(rids, starts, lens) for s in kv.slots(r, st, n)]
    assert md.slot_mapping.tolist() == want and md.slot_mapping.dtype == torch.long
    assert -1 in want and md.seq_lens == lens and md.num_cached == starts and md.slots_all_valid is False
    assert kv.attention_metadata(rids[:2], starts[:2], lens[:2], True).slots_all_valid is True
    assert torch.equal(md.block_tables, kv.block_tables(rids, CPU)) and md.block_tables.dtype == torch.int32
    shifted = [s for r, st, n in zip(rids, starts, lens) for s in kv.slots(r, st + 1, n)]
    assert md.slot_mapping.tolist() != shifted
