"""PagePool: the device pages of one KV cache and their classes (paper §3.3, DESIGN.md §5).

Each page is free (on the free list), in use (ref > 0), cached (ref 0, evictable, in its class's LRU) or
out (ref 0, in none of these: a page being spilled to the host, owned by the offload tier). Each non-free
page is normal or shadow (speculative work of a shadow job); shadow pages are capped at `shadow_cap`.
The pool knows nothing of hashes: the KV cache manager tells it which released pages stay cached.
Eviction rules (shadow first, LRU within a class, the cold-age rule for shadow allocations) are in
eviction.py. Reference implementation; `csrc/kv/` holds the native one (same decisions).
"""
from __future__ import annotations

from collections import OrderedDict

from .eviction import plan_shadow, shadow_available, take_normal_victims


class PagePool:
    """Ref counts, normal/shadow classes, per-class LRU with last-use times, the shadow cap, the free list."""

    def __init__(self, num_blocks: int, shadow_cap: int, cold_age_s: float):
        self.num_blocks, self.shadow_cap, self.cold_age_s = num_blocks, shadow_cap, cold_age_s
        self.ref = [0] * num_blocks
        self.shadow = [False] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))       # stack; pops 0, 1, 2, ... first
        self.lru = (OrderedDict(), OrderedDict())              # [normal, shadow]: cached page -> last use
        self.num_shadow = 0

    @property
    def num_cached(self) -> int:
        return len(self.lru[0]) + len(self.lru[1])

    # ---- taking pages ----------------------------------------------------------------------------------
    def take_free(self, n: int, shadow: bool) -> list[int]:
        """n pages off the free list (n <= len(free)), ref 1, of the class."""
        free = self.free
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        ref = self.ref
        for b in ids:
            ref[b] = 1
        if shadow:
            flags = self.shadow
            for b in ids:
                flags[b] = True
            self.num_shadow += n
        return ids

    def acquire(self, pages) -> None:
        """One more reference on each page (cached pages leave their LRU: no longer evictable)."""
        ref, lru, flags = self.ref, self.lru, self.shadow
        for b in pages:
            if not ref[b]:
                del lru[flags[b]][b]
            ref[b] += 1

    def revive(self, b: int) -> None:
        """An out page (spilling) back in use with one reference."""
        self.ref[b] = 1

    def release(self, pages) -> list[int]:
        """Drop one reference on each page; returns the pages that reached ref 0, last page first. Raises
        ValueError (nothing changed) if a page is out of range or not owned."""
        ref, n = self.ref, self.num_blocks
        for i, b in enumerate(pages):
            if not 0 <= b < n or ref[b] <= 0:
                for done in pages[:i]:
                    ref[done] += 1
                what = "out of range" if not 0 <= b < n else "not owned (ref count 0: double free?)"
                raise ValueError(f"block_ids: page {b} is {what}")
            ref[b] -= 1
        return [b for b in reversed(pages) if ref[b] == 0]

    def check_owned(self, pages) -> None:
        ref, n = self.ref, self.num_blocks
        for b in pages:
            if not 0 <= b < n or ref[b] <= 0:
                raise ValueError(f"block_ids: page {b} is not owned (ref count 0) or out of range")

    # ---- cached pages ----------------------------------------------------------------------------------
    def park(self, pages, now: float) -> None:
        """Ref-0 pages become cached: the most recently used of their class, in the given order."""
        lru, flags = self.lru, self.shadow
        for b in pages:
            lru[flags[b]][b] = now

    def touch(self, pages, now: float) -> None:
        """Cached pages among `pages` become the most recently used of their class."""
        lru, flags, n = self.lru, self.shadow, self.num_blocks
        for b in pages:
            if not 0 <= b < n:
                raise ValueError(f"block_ids: page {b} is out of range")
            entries = lru[flags[b]]
            if b in entries:
                entries[b] = now
                entries.move_to_end(b)

    def promote(self, b: int) -> bool:
        """A shadow page becomes normal (§3.3: a routed hit); whether it was shadow."""
        if not self.shadow[b]:
            return False
        self.shadow[b] = False
        self.num_shadow -= 1
        return True

    def give_back(self, pages) -> int:
        """Ref-0 pages back to the free list (class cleared); returns how many were shadow pages."""
        n_shadow = 0
        if self.num_shadow:
            flags = self.shadow
            for b in pages:
                if flags[b]:
                    flags[b] = False
                    n_shadow += 1
            self.num_shadow -= n_shadow
        self.free.extend(pages)
        return n_shadow

    # ---- eviction --------------------------------------------------------------------------------------
    def available(self, shadow: bool, now: float, limit: int, num_out: int) -> int:
        """Pages (at most limit) one allocation of the class could get now: free pages, `num_out` pages
        becoming free (spills in flight) and the cached pages it may evict (shadow: cold ones, within the cap)."""
        free, lru = len(self.free), self.lru
        if not shadow:
            return min(limit, free + num_out + len(lru[0]) + len(lru[1]))
        return shadow_available(limit, free, self.shadow_cap - self.num_shadow, lru[1], lru[0],
                                now - self.cold_age_s)

    def evict_for(self, n: int, shadow: bool, now: float, num_out: int) -> list[int] | None:
        """Remove from the LRUs the cached pages an allocation of n pages must evict (eviction.py rules),
        in eviction order; None (nothing removed) if it cannot be satisfied. Pages still being copied
        out (`num_out`) count as coming for a normal allocation."""
        lru = self.lru
        if not shadow:
            return take_normal_victims(n - len(self.free) - num_out, lru[1], lru[0])
        victims = plan_shadow(n, len(self.free), self.shadow_cap - self.num_shadow, lru[1], lru[0],
                              now - self.cold_age_s)
        if victims is not None:
            flags = self.shadow
            for b in victims:
                del lru[flags[b]][b]
        return victims

    def fits(self, n: int, shadow: bool) -> bool:
        """Whether n pages can be taken off the free list now (within the cap for shadow)."""
        return n <= len(self.free) and not (shadow and self.num_shadow + n > self.shadow_cap)
