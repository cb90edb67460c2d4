"""Page allocator with prefix caching, kept apart from KV storage.

A block is (id, ref_count, hash, token_ids). Full blocks of *committed, verified*
tokens are hashed by chaining the parent block's hash with the block's token ids and
a salt (model + drafter identity). Freed blocks keep their hash in an LRU free queue
until the allocator needs them again, so a later request can hit them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence


def chain_hash(parent: Optional[int], token_ids: Sequence[int], salt: str) -> int:
    """Hash of a full block given its parent's hash (None for the first block)."""
    return hash((parent, tuple(token_ids), salt))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None
    token_ids: tuple[int, ...] = ()
    draft_valid: bool = False   # draft-pool context KV for all its tokens was written


@dataclass
class PoolStats:
    lookups_blocks: int = 0
    hit_blocks: int = 0
    draft_hit_blocks: int = 0
    draft_recompute_blocks: int = 0   # target hit, draft context missing: recomputed
    evictions: int = 0
    lookup_tokens: int = 0            # prompt tokens of admitted requests
    reused_tokens: int = 0            # of those, served from cache (target KV)
    draft_reused_tokens: int = 0      # of those, with the drafter's context KV reused too


class BlockPool:
    """Free list, ref counts and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_reuse: bool):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_reuse = enable_reuse
        self.stats = PoolStats()
        self.min_free = num_blocks      # low-water mark of the free queue since `reset_min_free`

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def reset_min_free(self) -> None:
        """Restart the low-water mark `min_free` from the current free count."""
        self.min_free = len(self.free_queue)

    def allocate(self) -> int:
        """Take the least recently freed block; its old hash (if any) is evicted."""
        if not self.free_queue:
            raise RuntimeError("KV block pool exhausted (scheduler reservation bug)")
        bid, _ = self.free_queue.popitem(last=False)
        self.min_free = min(self.min_free, len(self.free_queue))
        blk = self.blocks[bid]
        if blk.block_hash is not None:
            if self.hash_to_block.get(blk.block_hash) == bid:
                del self.hash_to_block[blk.block_hash]
            blk.block_hash, blk.token_ids, self.stats.evictions = None, (), self.stats.evictions + 1
        blk.draft_valid = False
        blk.ref_count = 1
        return bid

    def touch(self, bid: int) -> None:
        """Take a reference on a cached block (removing it from the free queue if idle)."""
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            self.free_queue.pop(bid)
            self.min_free = min(self.min_free, len(self.free_queue))
        blk.ref_count += 1

    def release(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count <= 0:
            raise RuntimeError(f"block {bid} released with ref_count {blk.ref_count}")
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.block_hash is None:
                blk.draft_valid = False
            self.free_queue[bid] = None

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Optional[int]:
        bid = self.hash_to_block.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids):
            return None
        return bid

    def register(self, bid: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Publish a full block of verified tokens under its chain hash."""
        if not self.enable_reuse:
            return
        blk = self.blocks[bid]
        if blk.block_hash is not None:
            return
        blk.block_hash, blk.token_ids = block_hash, tuple(token_ids)
        self.hash_to_block.setdefault(block_hash, bid)

    def count_ref_free_idle(self) -> bool:
        """True when no block holds a reference (every request released)."""
        return all(b.ref_count == 0 for b in self.blocks)
