"""The capped, evict-first shadow KV class (paper §3.3, C3) over vLLM's own block pool.

vLLM keeps free blocks in one doubly linked queue (`BlockPool.free_block_queue`), allocating from its head:
blocks without a prefix-cache hash are prepended (reused first), cached blocks are appended at the tail as
they are freed (LRU). Without connectors the queue is therefore two runs, U (uncached) then H (cached, LRU
order). This class keeps a third run S between them for blocks computed only by shadow work:

    head -> U (uncached, free) -> S (shadow cache entries, oldest first) -> H (normal cache, LRU) -> tail

so any allocation uses truly free memory first, then shadow entries, and only then evicts normal entries.
A shadow block leaves the class when a non-shadow request holds it (a prefix hit, "promotion", or a reuse
after eviction); the scheduler reports those. Shadow KV (held by shadow requests or cached in S) is capped at
`cap` blocks; at the cap a shadow chunk recycles the oldest cold shadow entries, and a shadow chunk may only
take blocks that are free, cold shadow entries, or cached entries idle for at least `cold_age_s` (§3.3).

Relies on vLLM internals (0.32): `BlockPool.free_block_queue` (`fake_free_list_head/_tail`, `num_free_blocks`,
`remove`, `prepend_n`), `KVCacheBlock.{block_id, block_hash, ref_cnt, prev_free_block, next_free_block,
is_null}`, `BlockPool.evict_blocks`. Engine-free and import-free: it works on any object with that shape.
"""
from __future__ import annotations

from collections import OrderedDict


class ShadowKV:
    """Shadow-class bookkeeping for one vLLM block pool (single KV-cache group)."""

    def __init__(self, pool, cap_blocks: int, cold_age_s: float) -> None:
        self.pool = pool
        self.queue = pool.free_block_queue
        self.cap = int(cap_blocks)
        self.cold_age_s = float(cold_age_s)
        self._blocks: dict[int, object] = {}                 # shadow class: block id -> block
        self._free: OrderedDict[int, float] = OrderedDict()  # shadow blocks placed in S -> time placed
        self._freed_at = [float("-inf")] * len(pool.blocks)  # when each block last reached ref 0
        self.evicted = 0                                     # shadow blocks reused by others or recycled
        self.promoted = 0                                    # shadow blocks hit by non-shadow requests
        self.placed = 0                                      # shadow blocks placed at the evict-first run

    # ------------------------------------------------------------------------------------ accounting
    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def count(self) -> int:
        """Shadow blocks held by shadow requests or cached in S."""
        return len(self._blocks)

    def prune(self) -> int:
        """Drop entries whose block is free and no longer cached (a path the scheduler did not report; none
        is known). O(class size): the scheduler runs it now and then. Returns count()."""
        dead = [i for i, b in self._blocks.items() if b.ref_cnt == 0 and b.block_hash is None]
        for i in dead:
            del self._blocks[i]
            self._free.pop(i, None)
        return len(self._blocks)

    def add(self, blocks) -> None:
        """Blocks a shadow chunk just allocated (not its prefix hits) join the class; a shadow entry the
        allocation took back from S counts as evicted."""
        for b in blocks:
            if not b.is_null:
                if self._free.pop(b.block_id, None) is not None:
                    self.evicted += 1
                self._blocks[b.block_id] = b

    def leave(self, block_ids, *, hit: bool) -> int:
        """Blocks now held by a non-shadow request leave the class: a prefix hit (promotion) or a reuse of an
        evicted shadow block. Returns how many were shadow blocks."""
        n = 0
        for i in block_ids:
            if self._blocks.pop(i, None) is not None:
                self._free.pop(i, None)
                n += 1
        if hit:
            self.promoted += n
        else:
            self.evicted += n
        return n

    def note_freed(self, blocks, now: float) -> None:
        """Record when blocks reached ref 0 (the cold-age rule reads it); call after vLLM freed them."""
        at = self._freed_at
        for b in blocks:
            if b.ref_cnt == 0:
                at[b.block_id] = now

    # -------------------------------------------------------------------------- evict-first placement
    def place_freed(self, blocks, now: float) -> None:
        """After vLLM freed a shadow request's blocks: move its cached shadow blocks from the tail (where vLLM
        appended them as most recently used) to the end of S; uncached ones (vLLM prepended them) leave.
        `blocks` in allocation order; the chain's tail goes first, so a prefix's end is evicted first."""
        moved = []
        for b in reversed(blocks):
            if b.block_id not in self._blocks or b.ref_cnt != 0:
                continue
            if b.block_hash is None:
                del self._blocks[b.block_id]
                self._free.pop(b.block_id, None)
                continue
            self.queue.remove(b)
            moved.append(b)
        if not moved:
            return
        after = self._s_end()
        self._insert_after(after, moved)
        for b in moved:
            self._free[b.block_id] = now
            self._free.move_to_end(b.block_id)
        self.placed += len(moved)

    def _in_queue(self, b) -> bool:
        return b.prev_free_block is not None and b.next_free_block is not None

    def _s_end(self):
        """The queue node after which new shadow entries go: the last block of S, else the end of U."""
        while self._free:
            i = next(reversed(self._free))
            b = self._blocks.get(i)
            if b is not None and self._in_queue(b) and b.block_hash is not None:
                return b
            self._free.pop(i)
        # S is empty: find the U/H boundary from both ends at once (cost: the shorter run)
        head, tail = self.queue.fake_free_list_head, self.queue.fake_free_list_tail
        fwd, bwd = head, tail.prev_free_block
        while True:
            nxt = fwd.next_free_block
            if nxt is tail or nxt.block_hash is not None:      # fwd is the last uncached block (or head)
                return fwd
            fwd = nxt
            if bwd is head or bwd.block_hash is None:          # bwd is the last uncached block (or head)
                return bwd
            bwd = bwd.prev_free_block

    def _insert_after(self, node, blocks) -> None:
        """Link `blocks` (in order) into the free queue right after `node` (the head sentinel or a block)."""
        nxt = node.next_free_block
        prev = node
        for b in blocks:
            b.prev_free_block = prev
            prev.next_free_block = b
            prev = b
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.queue.num_free_blocks += len(blocks)

    # ------------------------------------------------------------------------ Alg. 1 line 11 (room)
    def _cold_shadow(self, now: float, exclude, limit: int) -> list:
        """Up to `limit` cold shadow entries in S, oldest first (placement times never decrease)."""
        out, stale = [], []
        for i, t in self._free.items():
            if now - t < self.cold_age_s or len(out) >= limit:
                break
            b = self._blocks.get(i)
            if b is None or not self._in_queue(b) or b.block_hash is None:
                stale.append(i)
                continue
            if i not in exclude:
                out.append(b)
        for i in stale:
            self._free.pop(i, None)
        return out

    def _allowed_prefix(self, limit: int, now: float, exclude) -> int:
        """How many blocks at the head of the free queue (skipping `exclude`) a shadow chunk may take: the
        run of uncached blocks and cached blocks idle >= cold_age_s, up to `limit`."""
        node, tail, n, at = self.queue.fake_free_list_head.next_free_block, self.queue.fake_free_list_tail, 0, \
            self._freed_at
        while n < limit and node is not tail:
            if node.block_id not in exclude:
                if node.block_hash is not None and now - at[node.block_id] < self.cold_age_s:
                    break
                n += 1
            node = node.next_free_block
        return n

    def available(self, limit: int, now: float, exclude=frozenset()) -> int:
        """Line 11's free shadow KV in blocks (at most `limit`): blocks one shadow allocation could take now
        within the cap. Conservative: recycled shadow entries are assumed to come from the allowed run."""
        limit = max(0, int(limit))
        if limit == 0:
            return 0
        headroom = self.cap - self.count()
        cold = self._cold_shadow(now, exclude, limit - headroom) if headroom < limit else []
        return max(0, min(limit, self._allowed_prefix(limit, now, exclude), headroom + len(cold)))

    def prepare(self, n: int, now: float, exclude=frozenset()) -> bool:
        """Make an allocation of `n` new shadow blocks possible, or say it is not: at the cap, recycle the
        oldest cold shadow entries (evicted from the prefix cache, moved to the head so the allocation takes
        them); then the head of the queue must hold `n` blocks the shadow may take."""
        if n <= 0:
            return True
        over = self.count() + n - self.cap
        if over > 0:
            cold = self._cold_shadow(now, exclude, over)
            if len(cold) < over:
                return False
            victims = cold[:over]
            self.pool.evict_blocks({b.block_id for b in victims})
            for b in victims:
                self.queue.remove(b)
                del self._blocks[b.block_id]
                self._free.pop(b.block_id, None)
            self.queue.prepend_n(victims)
            self.evicted += len(victims)
        return self._allowed_prefix(n, now, exclude) >= n

    def clear(self) -> None:
        """Forget the class (after vLLM reset its prefix cache)."""
        self._blocks.clear()
        self._free.clear()
