"""BlockPool: LRU free list, ref counts, chained block hashes, eviction on reuse."""
from __future__ import annotations

import pytest

from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool, chain_hash


def test_allocate_release_and_ref_counts():
    pool = BlockPool(4, enable_reuse=False)
    ids = [pool.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3] and pool.num_free == 0
    assert all(pool.blocks[i].ref_count == 1 for i in ids)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()
    pool.release(ids[2])
    assert pool.num_free == 1 and pool.blocks[ids[2]].ref_count == 0
    with pytest.raises(RuntimeError, match="ref_count"):
        pool.release(ids[2])                        # double free is a bug, never silent
    for i in ids[:2] + ids[3:]:
        pool.release(i)
    assert pool.num_free == 4 and pool.count_ref_free_idle()


def test_free_order_is_lru():
    pool = BlockPool(3, enable_reuse=False)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == b and pool.allocate() == a


def test_chain_hash_depends_on_parent_tokens_and_salt():
    h = chain_hash(None, [1, 2, 3], "s")
    assert h == chain_hash(None, [1, 2, 3], "s")
    assert h != chain_hash(None, [1, 2, 4], "s")
    assert h != chain_hash(None, [1, 2, 3], "other-model")
    assert chain_hash(h, [5], "s") != chain_hash(chain_hash(None, [9], "s"), [5], "s")


def test_register_lookup_touch_and_evict():
    pool = BlockPool(2, enable_reuse=True)
    bid = pool.allocate()
    h = chain_hash(None, [1, 2], "s")
    pool.register(bid, h, [1, 2])
    assert pool.lookup(h, [1, 2]) == bid
    assert pool.lookup(h, [1, 3]) is None           # a hash hit must also match tokens
    pool.release(bid)
    assert pool.lookup(h, [1, 2]) == bid            # freed blocks keep their hash...
    pool.touch(bid)                                  # ...and can be revived from the free queue
    assert pool.blocks[bid].ref_count == 1 and pool.num_free == 1
    pool.touch(bid)
    assert pool.blocks[bid].ref_count == 2
    pool.release(bid)
    pool.release(bid)
    other = pool.allocate()                          # LRU: the never-used block goes first
    assert other != bid and pool.lookup(h, [1, 2]) == bid
    again = pool.allocate()                          # now the cached block is evicted
    assert again == bid and pool.lookup(h, [1, 2]) is None
    assert pool.stats.evictions == 1 and pool.blocks[bid].block_hash is None


def test_register_is_noop_without_reuse():
    pool = BlockPool(1, enable_reuse=False)
    bid = pool.allocate()
    pool.register(bid, chain_hash(None, [1], "s"), [1])
    assert pool.hash_to_block == {} and pool.blocks[bid].block_hash is None


def test_zero_blocks_rejected():
    with pytest.raises(ValueError):
        BlockPool(0, enable_reuse=False)


def test_min_free_is_the_exact_low_water_mark():
    """min_free follows every allocation (and a touch of an idle cached block), never a release;
    reset_min_free restarts it from the current free count."""
    pool = BlockPool(8, enable_reuse=True)
    a = [pool.allocate() for _ in range(5)]
    for b in a[:4]:
        pool.release(b)
    assert pool.num_free == 7 and pool.min_free == 3          # peak of 5 in use, gone by now
    pool.reset_min_free()
    assert pool.min_free == 7                                 # negative control: not the old peak
    pool.register(a[4], 123, (1, 2))
    pool.release(a[4])
    pool.reset_min_free()
    assert pool.min_free == 8
    pool.touch(a[4])                                          # an idle cached block leaves the queue
    assert pool.min_free == 7
    pool.release(a[4])
    c = [pool.allocate() for _ in range(3)]
    for b in c:
        pool.release(b)
    assert pool.num_free == 8 and pool.min_free == 5
