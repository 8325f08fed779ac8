"""Which device pages an allocation may take: the capped, evict-first shadow class (paper §3.3, C3).

Pure functions over the pool's state: the free count, the two LRUs of evictable cache entries (ref 0,
`OrderedDict[block -> last use]`, least recently used first, one per class) and the shadow page count.
Rules, in the paper's words: "Shadow entries form their own cache class, limited to 25% of the KV pool. A
shadow chunk may use free blocks or blocks of cache entries idle for more than 5 s. Eviction removes shadow
entries before normal ones and is LRU within each class." A normal allocation may evict any entry.
"""
from __future__ import annotations

from collections import OrderedDict


def cold_blocks(lru: OrderedDict, idle_before: float, limit: int) -> list[int]:
    """Up to `limit` blocks of `lru` whose last use is < idle_before, least recently used first.
    The LRU is ordered by last use (times never decrease), so the scan stops at the first warm entry."""
    out = []
    if limit <= 0:
        return out
    for block, last_use in lru.items():
        if last_use >= idle_before:
            break
        out.append(block)
        if len(out) == limit:
            break
    return out


def take_normal_victims(need: int, shadow_lru: OrderedDict, normal_lru: OrderedDict) -> list[int] | None:
    """Remove and return the `need` pages a normal allocation evicts: shadow entries first, then normal ones,
    LRU within each class. None (nothing removed) if fewer than `need` entries exist."""
    if need <= 0:
        return []
    if need > len(shadow_lru) + len(normal_lru):
        return None
    from_shadow = min(need, len(shadow_lru))  # the evict-first class
    victims = [shadow_lru.popitem(last=False)[0] for _ in range(from_shadow)]
    victims += [normal_lru.popitem(last=False)[0] for _ in range(need - from_shadow)]
    return victims


def plan_shadow(n: int, num_free: int, headroom: int, shadow_lru: OrderedDict, normal_lru: OrderedDict,
                idle_before: float) -> list[int] | None:
    """Victims for a shadow allocation of n pages, or None if it cannot be satisfied.

    headroom = cap - shadow pages now. Only entries idle longer than cold_age (last use < idle_before) may be
    taken. A page taken from the free list or from a normal entry adds a shadow page, a page taken from a shadow
    entry does not: when the cap binds, cold shadow entries are recycled first; otherwise free pages first,
    then cold shadow, then cold normal entries."""
    cold_shadow = cold_blocks(shadow_lru, idle_before, n)
    must_recycle = max(0, n - headroom)  # pages the cap forces to come from shadow entries
    if must_recycle > len(cold_shadow):
        return None
    victims = cold_shadow[:must_recycle]
    rest = n - must_recycle - min(n - must_recycle, num_free)  # after free pages (rest <= headroom)
    if rest:
        more = cold_shadow[must_recycle:must_recycle + rest]
        victims += more
        rest -= len(more)
    if rest:
        cold_normal = cold_blocks(normal_lru, idle_before, rest)
        if len(cold_normal) < rest:
            return None
        victims += cold_normal
    return victims


def shadow_available(limit: int, num_free: int, headroom: int, shadow_lru: OrderedDict, normal_lru: OrderedDict,
                     idle_before: float) -> int:
    """How many pages (at most limit) a shadow allocation could get (plan_shadow succeeds for any n <= this)."""
    cold_s = len(cold_blocks(shadow_lru, idle_before, limit))
    cold_n = len(cold_blocks(normal_lru, idle_before, limit))
    return max(0, min(limit, min(max(headroom, 0), num_free + cold_n) + cold_s))
