"""KVCacheManager: paged target and draft pools sharing one block addressing.

Design: one `BlockPool` hands out page ids; every pool (the target's, and the DSpark
drafter's when present) is a separate tensor indexed by the *same* page id. Token
parity therefore holds by construction, one prefix-cache hit covers both pools, and a
request's block table is valid for both. Per request the manager holds its page list::

    pages:  [p0][p1][p2][ BAD_PAGE_INDEX ... ]    (table width = ceil(max_seq_len / P))
    tokens: 0..P-1 | P..2P-1 | 2P..              (absolute positions)

Scheduling reserves pages up front (never admit what cannot finish), so allocation
during a step never fails; pages are materialised lazily as tokens arrive.

Each live request also owns one row of a persistent host page table (numpy int32, the
same pages followed by BAD_PAGE_INDEX), kept in step with its page list, so a step's
block tables and slots are a few vectorised gathers instead of per-token Python.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ...attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata, host_ints
from .block_pool import BlockPool, chain_hash
from .kv_cache_spec import KVCacheSpec

logger = logging.getLogger("tensorrt_llm")


@dataclass
class SequenceBlocks:
    pages: list[int] = field(default_factory=list)   # owned by KVCacheManager (mirrored in its table)
    row: int = -1                                     # this request's row of the host page table
    reserved_pages: int = 0
    num_hashed_blocks: int = 0
    last_hash: Optional[int] = None
    num_draft_valid_tokens: int = 0
    committed_tokens: Sequence[int] = ()              # verified tokens (prompt + output) at the last commit
    num_committed: int = 0


class KVCacheManager:
    """Owns the KV pools and per-request page lists (prepare / commit / free lifecycle)."""

    def __init__(self, specs: Sequence[KVCacheSpec], num_pages: int, tokens_per_block: int,
                 max_seq_len: int, device: torch.device, enable_block_reuse: bool = False,
                 cache_salt: str = "", seq_slack_tokens: int = 0):
        """seq_slack_tokens: KV slots a request may use past max_seq_len (speculative lookahead:
        a verify segment and a draft block beyond its last committed token)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or "target" not in names:
            raise ValueError(f"KV specs need unique names including 'target', got {names}")
        self.specs = {s.name: s for s in specs}
        self.tokens_per_block = tokens_per_block
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.max_tokens_per_seq = max_seq_len + seq_slack_tokens
        self.max_blocks_per_seq = -(-self.max_tokens_per_seq // tokens_per_block)
        self.device = device
        self.pool = BlockPool(num_pages, enable_block_reuse)
        self.cache_salt = cache_salt
        self.pools: dict[str, torch.Tensor] = {
            s.name: torch.zeros((s.num_layers,) + s.layer_shape(num_pages, tokens_per_block),
                                dtype=s.dtype, device=device) for s in specs}
        self.seqs: dict[int, SequenceBlocks] = {}
        self._reserved_unallocated = 0
        # [rows, max_blocks_per_seq] int32: row r = pages of the request holding r, then
        # BAD_PAGE_INDEX; grows by doubling. _num_pages[r] = pages owned by that request.
        self._table = np.full((8, self.max_blocks_per_seq), BAD_PAGE_INDEX, dtype=np.int32)
        self._num_pages = np.zeros(8, dtype=np.int64)
        self._free_rows = list(range(7, -1, -1))
        self._scratch_pages: list[int] = []

    # ---- pools -------------------------------------------------------------------------
    def layer_caches(self, name: str) -> list[torch.Tensor]:
        """Per-layer views [num_pages, planes, heads, P, D] of pool `name`."""
        return list(self.pools[name].unbind(0))

    @property
    def has_draft_pool(self) -> bool:
        return "draft" in self.specs

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.tokens_per_block

    # ---- admission ---------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def available_pages(self) -> int:
        return self.pool.num_free - self._reserved_unallocated

    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> list[int]:
        """Cached pages covering a prefix of `token_ids` (full blocks, never the whole prompt).

        With a draft pool, matching stops at the first block whose draft context is missing
        (counted as a draft recompute): the target recomputes it so the drafter never drafts
        over a gap. `count=False` leaves the statistics alone (admission checks).
        """
        if not self.pool.enable_reuse:
            return []
        p, out, parent = self.tokens_per_block, [], None
        n_full = (len(token_ids) - 1) // p      # keep >= 1 token to compute
        for i in range(n_full):
            blk_tokens = token_ids[i * p:(i + 1) * p]
            h = chain_hash(parent, blk_tokens, self.cache_salt)
            self.pool.stats.lookups_blocks += count
            bid = self.pool.lookup(h, blk_tokens)
            if bid is None:
                break
            if self.has_draft_pool and not self.pool.blocks[bid].draft_valid:
                self.pool.stats.draft_recompute_blocks += count
                break
            out.append(bid)
            parent = h
        return out

    def can_admit(self, token_ids: Sequence[int], reserve_tokens: int) -> bool:
        hits = self.match_prefix_peek(token_ids)
        idle_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
        need = self.pages_for(reserve_tokens) - len(hits) + idle_hits
        return need <= self.available_pages()

    def match_prefix_peek(self, token_ids: Sequence[int]) -> list[int]:
        return self.match_prefix(token_ids, count=False)

    def add_sequence(self, req_id: int, token_ids: Sequence[int], reserve_tokens: int) -> int:
        """Register a request, reusing cached prefix pages. Returns the number of cached tokens."""
        if req_id in self.seqs:
            raise ValueError(f"request {req_id} already has KV pages")
        if reserve_tokens > self.max_tokens_per_seq:
            raise ValueError(f"request {req_id} reserves {reserve_tokens} tokens > {self.max_tokens_per_seq} "
                             f"(max_seq_len {self.max_seq_len} + {self.max_tokens_per_seq - self.max_seq_len} "
                             "lookahead slots)")
        hits = self.match_prefix(token_ids)
        for bid in hits:
            self.pool.touch(bid)
        st, cached = self.pool.stats, len(hits) * self.tokens_per_block
        st.hit_blocks += len(hits)
        st.lookup_tokens += len(token_ids)
        st.reused_tokens += cached
        if self.has_draft_pool:   # match_prefix only returns blocks whose draft context exists
            st.draft_hit_blocks += len(hits)
            st.draft_reused_tokens += cached
        seq = SequenceBlocks(pages=list(hits), reserved_pages=max(self.pages_for(reserve_tokens), len(hits)),
                             row=self._take_row())
        self._table[seq.row, :len(hits)] = hits
        self._num_pages[seq.row] = len(hits)
        seq.num_hashed_blocks = len(hits)
        if hits:
            seq.last_hash = self.pool.blocks[hits[-1]].block_hash
        seq.num_draft_valid_tokens = len(hits) * self.tokens_per_block
        self._reserved_unallocated += seq.reserved_pages - len(seq.pages)
        self.seqs[req_id] = seq
        return cached

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self._table.shape[0]
            self._table = np.concatenate([self._table, np.full_like(self._table, BAD_PAGE_INDEX)])
            self._num_pages = np.concatenate([self._num_pages, np.zeros_like(self._num_pages)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    # ---- per-step ----------------------------------------------------------------------
    def ensure_capacity(self, req_id: int, num_tokens: int) -> int:
        """Own pages for positions < num_tokens, within the reservation. Returns tokens owned."""
        seq = self.seqs[req_id]
        have = len(seq.pages)
        if num_tokens <= have * self.tokens_per_block:   # hot path: nothing to allocate
            return have * self.tokens_per_block
        want = min(self.pages_for(num_tokens), seq.reserved_pages, self.max_blocks_per_seq)
        while len(seq.pages) < want:
            bid = self.pool.allocate()
            self._table[seq.row, len(seq.pages)] = bid
            seq.pages.append(bid)
            self._reserved_unallocated -= 1
        self._num_pages[seq.row] = len(seq.pages)
        return len(seq.pages) * self.tokens_per_block

    def owned_tokens(self, req_id: int) -> int:
        return len(self.seqs[req_id].pages) * self.tokens_per_block

    def draft_written_tokens(self, req_id: int) -> int:
        """Positions < this hold the request's draft context KV (`mark_draft_written`, prefix hits)."""
        return self.seqs[req_id].num_draft_valid_tokens

    def request_pages(self, req_id: int) -> list[int]:
        """The page ids a request owns, in token order (a copy; the same ids index every pool)."""
        return list(self.seqs[req_id].pages)

    def export_pages(self, req_id: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """Copy the pages holding a request's first `num_tokens` tokens out of every pool.

        Returns {pool: [L, n_pages, planes, heads, P, D]} (for context -> generation transfer).
        """
        pages = self.seqs[req_id].pages[:self.pages_for(num_tokens)]
        if len(pages) < self.pages_for(num_tokens):
            raise ValueError(f"request {req_id} owns {len(pages)} pages, fewer than {num_tokens} tokens need")
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        return {name: pool[:, idx].clone() for name, pool in self.pools.items()}

    def import_pages(self, req_id: int, data: dict[str, torch.Tensor]) -> None:
        """Write exported pages into this request's own first pages (same pools and shapes)."""
        if set(data) != set(self.pools):
            raise ValueError(f"imported pools {sorted(data)} do not match this manager's {sorted(self.pools)}")
        n = next(iter(data.values())).shape[1]
        pages = self.seqs[req_id].pages
        if len(pages) < n:
            raise ValueError(f"request {req_id} owns {len(pages)} pages; {n} are being imported")
        idx = torch.tensor(pages[:n], dtype=torch.long, device=self.device)
        for name, t in data.items():
            want = self.pools[name][:, idx].shape
            if t.shape != want:
                raise ValueError(f"pool {name!r}: imported shape {tuple(t.shape)} != {tuple(want)}")
            self.pools[name][:, idx] = t.to(self.pools[name].dtype)

    def slots(self, req_id: int, start: int, count: int) -> list[int]:
        """Flat slots for positions start..start+count-1; -1 beyond the pages the request owns.

        The per-token reference of `slots_batch` (kept for callers with one request).
        """
        pages, p = self.seqs[req_id].pages, self.tokens_per_block
        out = []
        for pos in range(start, start + count):
            bi = pos // p
            out.append(pages[bi] * p + pos % p if 0 <= bi < len(pages) else -1)
        return out

    # ---- vectorised views of the host page table ----------------------------------------
    @property
    def page_table(self) -> np.ndarray:
        """[rows, max_blocks_per_seq] int32 host table; index it with `rows(...)`. Read-only by contract."""
        return self._table

    def rows(self, req_ids: Sequence[int]) -> np.ndarray:
        """[B] int64 rows of `page_table` holding these requests' pages."""
        seqs = self.seqs
        return np.fromiter((seqs[r].row for r in req_ids), dtype=np.int64, count=len(req_ids))

    def slots_batch(self, req_ids: Sequence[int], starts: Sequence[int] | np.ndarray, count: int,
                    rows: Optional[np.ndarray] = None) -> np.ndarray:
        """[B, count] int64 flat slots of positions starts[b]..starts[b]+count-1 of each request;
        -1 beyond the pages it owns (same values as `slots`, one request per row)."""
        if rows is None:
            rows = self.rows(req_ids)
        pos = np.asarray(starts, dtype=np.int64).reshape(-1, 1)
        if count != 1:
            pos = pos + np.arange(count, dtype=np.int64)
        return self._slots_at(rows.reshape(-1, 1), pos)

    def owned_slots(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        """[B, count] int64 flat slots of positions starts[b]..starts[b]+count-1 that `owns_span` found
        owned: `slots_batch`'s values without its handling of unowned positions (wrong for those)."""
        p = self.tokens_per_block
        bi, off = np.divmod(starts.reshape(-1, 1) + np.arange(count, dtype=np.int64), p)
        return self._table[rows.reshape(-1, 1), bi] * p + off

    def owns_span(self, rows: np.ndarray, starts: np.ndarray, count: int | np.ndarray) -> np.ndarray:
        """[B] bool: every position starts[b]..starts[b]+count[b]-1 (count >= 1) lies in the pages the
        request of page-table row rows[b] owns, i.e. `(slots_batch(...) >= 0).all(1)` without building
        the slots: a request's pages fill a prefix of its row (`ensure_capacity` appends)."""
        return (starts >= 0) & (starts + count <= self._num_pages[rows] * self.tokens_per_block)

    def packed_slots(self, rows: np.ndarray, starts: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Packed segments (segment i: page-table row rows[i], positions starts[i]..starts[i]+lengths[i]-1)
        -> (positions [T], flat slots [T]) int64, T = sum(lengths); -1 slots beyond the owned pages."""
        lens = np.asarray(lengths, dtype=np.int64)
        seg = np.repeat(np.arange(len(lens)), lens)                        # [T] segment of each token
        first = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(lens[:-1], out=first[1:])
        pos = np.asarray(starts, dtype=np.int64)[seg] + np.arange(int(lens.sum()), dtype=np.int64) - first[seg]
        return pos, self._slots_at(rows[seg], pos)

    def _slots_at(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Flat slots of positions `pos` in the page-table rows `rows` (broadcast together, int64);
        -1 where the page is not allocated or lies past the table."""
        p, width = self.tokens_per_block, self._table.shape[1]
        bi, off = np.divmod(pos, p)
        col = np.minimum(np.maximum(bi, 0), width - 1)      # == bi iff the block is inside the table
        pages = self._table[rows, col]
        slots = pages * p + off
        slots[(pages < 0) | (bi != col)] = -1
        return slots

    def block_tables(self, req_ids: Sequence[int], device: Optional[torch.device] = None) -> torch.Tensor:
        """[B, max_blocks] int32 (max_blocks = most pages any of them owns, >= 1);
        unallocated entries hold BAD_PAGE_INDEX."""
        rows = self.rows(req_ids)
        width = max(int(self._num_pages[rows].max()), 1) if len(rows) else 1
        return torch.from_numpy(self._table[rows, :width]).to(device or self.device)

    def reset_peak(self) -> None:
        """Restart report()["peak_used_pages"] (exact: tracked at every page allocation)."""
        self.pool.reset_min_free()

    @property
    def prefix_caching(self) -> bool:
        """Whether committed blocks are published for reuse (without it `commit` has nothing to do)."""
        return self.pool.enable_reuse

    def wants_commit(self, req_id: int, num_committed: int) -> bool:
        """Cheap check: could `commit` publish a new block now? (lets callers skip building tokens)"""
        seq = self.seqs[req_id]
        return self.pool.enable_reuse and (seq.num_hashed_blocks + 1) * self.tokens_per_block <= num_committed

    def commit(self, req_id: int, token_ids: Sequence[int], num_committed: int) -> None:
        """Record committed tokens (verified and in the target KV) and publish the full blocks they
        complete. With a draft pool a block is held back until its draft context is written too
        (`mark_draft_written` publishes it then), so a shared block always carries both pools' KV."""
        seq = self.seqs[req_id]
        # A stop inside an accepted draft run leaves num_committed past the returned tokens:
        # never publish a block whose tokens are not all in `token_ids`.
        seq.committed_tokens, seq.num_committed = token_ids, min(num_committed, len(token_ids))
        self._publish(seq)

    def mark_draft_written(self, req_id: int, num_tokens: int) -> None:
        """Draft context KV is now stored for positions < num_tokens; publishes the committed blocks
        that were waiting for it."""
        seq = self.seqs[req_id]
        seq.num_draft_valid_tokens = max(seq.num_draft_valid_tokens, min(num_tokens, len(seq.pages) * self.tokens_per_block))
        if seq.num_committed and self.pool.enable_reuse:
            self._publish(seq)

    def _publish(self, seq: SequenceBlocks) -> None:
        if not self.pool.enable_reuse:
            return
        p = self.tokens_per_block
        limit = seq.num_committed
        if self.has_draft_pool:
            limit = min(limit, seq.num_draft_valid_tokens)
        while (seq.num_hashed_blocks + 1) * p <= limit and seq.num_hashed_blocks < len(seq.pages):
            i = seq.num_hashed_blocks
            blk_tokens = seq.committed_tokens[i * p:(i + 1) * p]
            h = chain_hash(seq.last_hash, blk_tokens, self.cache_salt)
            bid = seq.pages[i]
            if self.has_draft_pool:
                self.pool.blocks[bid].draft_valid = True
            self.pool.register(bid, h, blk_tokens)
            seq.last_hash, seq.num_hashed_blocks = h, i + 1

    def scratch_page(self, which: int = 0) -> int:
        """The page CUDA-graph padding requests write into (every pool; allocated on first use and
        held for the manager's lifetime: never hashed, shared or freed, counted as used). which: 0, the
        page every runner shares; 1, a second one for padding requests that must not read what the
        rows of no request write into the first (`MixedSpecGraph`)."""
        while len(self._scratch_pages) <= which:
            self._scratch_pages.append(self.pool.allocate())
        return self._scratch_pages[which]

    def attention_metadata(self, request_ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
                           causal: bool) -> AttentionMetadata:
        """Metadata for packed segments (request i: positions starts[i]..starts[i]+lengths[i]-1);
        slots beyond a request's owned pages are -1 (the write is skipped). A few numpy ops whatever
        the batch; the tables travel from pinned memory without waiting for the GPU."""
        rows = self.rows(request_ids)
        _, slots = self.packed_slots(rows, starts, lengths)
        n_pages = max(int(self._num_pages[rows].max()), 1) if len(rows) else 1
        return AttentionMetadata(seq_lens=list(lengths), num_cached=list(starts),
                                 block_tables=host_ints(self._table[rows, :n_pages], self.device, torch.int32),
                                 slot_mapping=host_ints(slots, self.device), tokens_per_block=self.tokens_per_block,
                                 causal=causal, slots_all_valid=bool((slots >= 0).all()))

    def free(self, req_id: int) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return
        self._reserved_unallocated -= seq.reserved_pages - len(seq.pages)
        for bid in reversed(seq.pages):   # tail first, so eviction takes tails before heads
            self.pool.release(bid)
        self._table[seq.row] = BAD_PAGE_INDEX
        self._num_pages[seq.row] = 0
        self._free_rows.append(seq.row)

    # ---- reporting ---------------------------------------------------------------------
    def report(self) -> dict:
        """Pools, capacity and prefix-cache stats.

        reuse.hit_rate = prompt tokens served from cache / prompt tokens of admitted requests;
        reuse.draft_hit_rate counts the hits whose drafter context KV was reused too (None
        without a draft pool).
        """
        p = self.tokens_per_block
        pools = {}
        for name, s in self.specs.items():
            pools[name] = {
                "kind": s.kind, "dtype": str(s.dtype).replace("torch.", ""),
                "bytes_per_token": s.bytes_per_token, "max_tokens": self.max_tokens,
                "num_layers": s.num_layers, "layer_shape": list(s.layer_shape(self.num_pages, p)),
                "shape_str": s.describe(self.num_pages, p),
                "bytes": s.bytes_per_token * self.max_tokens,
            }
        st = self.pool.stats
        rate = (lambda n: n / st.lookup_tokens) if st.lookup_tokens else (lambda n: 0.0)
        return {
            "tokens_per_block": p, "num_pages": self.num_pages, "max_tokens": self.max_tokens,
            "bytes_per_token_total": sum(s.bytes_per_token for s in self.specs.values()),
            "pools": pools, "free_pages": self.pool.num_free, "active_sequences": len(self.seqs),
            "peak_used_pages": self.num_pages - self.pool.min_free,   # since the last reset_peak()
            "reuse": {"enabled": self.pool.enable_reuse, "lookups_blocks": st.lookups_blocks,
                      "hit_blocks": st.hit_blocks, "draft_hit_blocks": st.draft_hit_blocks,
                      "draft_recompute_blocks": st.draft_recompute_blocks,
                      "evictions": st.evictions, "lookup_tokens": st.lookup_tokens,
                      "reused_tokens": st.reused_tokens, "draft_reused_tokens": st.draft_reused_tokens,
                      "hit_rate": rate(st.reused_tokens),
                      "draft_hit_rate": rate(st.draft_reused_tokens) if self.has_draft_pool else None},
        }
