"""BlockPool: the paged KV pool of one engine instance (paper §3.3, DESIGN.md §5).

Every device page is in exactly one state:
  free      on the free list (ref 0, no hash);
  in use    ref > 0 (the owners: sequences that hold it); a page with ref > 1 is always a registered,
            read-only prefix-cache page (only acquire_prefix shares pages; allocate hands out ref-1 pages);
  cached    ref 0, registered in the prefix cache under its chained hash, in its class's LRU, evictable;
  spilling  evicted, its device->host copy still in flight (CUDA only); reusable once the copy's event
            completed (poll), served again from the device copy if hit meanwhile (the eviction is cancelled).
Each non-free page has a class, normal or shadow (speculative work of a shadow job). Shadow pages (in use,
cached and spilling) are capped at shadow_fraction of the pool; eviction rules are in eviction.py; evicted
cached pages are spilled to the HostTier and reloaded from it on a prefix hit. With kv_cache=None (and a
bookkeeping-only HostTier) the pool takes the same decisions and keeps the same accounting without tensors.
Every time-dependent method takes `now` (seconds, never decreasing): wall clock or the simulator's clock.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .eviction import plan_shadow, shadow_available, take_normal_victims
from .host_spill import HostSpill
from .host_tier import HostTier
from .prefix_hash import PageHashes, as_token_sequence, root_hash
from .prefix_lookup import PrefixLookup, PrefixMatch
from .stats import PoolStats

__all__ = ["BlockPool", "PrefixMatch"]


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    return value


class BlockPool(PrefixLookup, HostSpill):
    """Free list, ref counts, normal/shadow classes, hash-chained prefix cache, eviction, host spill."""

    def __init__(self, num_blocks: int, block_size: int, *, kv_cache: torch.Tensor | None = None,
                 host_tier: HostTier | None = None, page_bytes: int = 0, shadow_fraction: float = 0.25,
                 cold_age_s: float = 5.0, model_id: str = ""):
        self.num_blocks = _check_int(num_blocks, "num_blocks", 1)
        self.block_size = _check_int(block_size, "block_size", 1)
        if not 0.0 <= shadow_fraction <= 1.0:
            raise ValueError(f"shadow_fraction: must be in [0, 1], got {shadow_fraction}")
        if not cold_age_s >= 0.0:
            raise ValueError(f"cold_age_s: must be >= 0, got {cold_age_s}")
        if not isinstance(model_id, str):
            raise TypeError(f"model_id: expected a str, got {type(model_id).__name__}")
        if kv_cache is not None:
            if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 6:
                raise ValueError("kv_cache: expected a 6-D block-major cache [num_blocks, num_layers, 2, "
                                 "num_kv_heads, block_size, head_dim]")
            if kv_cache.shape[0] != num_blocks or kv_cache.shape[4] != block_size:
                raise ValueError(f"kv_cache: shape {tuple(kv_cache.shape)} does not hold {num_blocks} pages of "
                                 f"{block_size} tokens")
            page_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.page_bytes = _check_int(page_bytes, "page_bytes", 0)
        if host_tier is not None:
            if not isinstance(host_tier, HostTier):
                raise TypeError(f"host_tier: expected a HostTier, got {type(host_tier).__name__}")
            host_tier.check_compatible(kv_cache, self.page_bytes)
        self.kv_cache, self.host_tier, self.model_id = kv_cache, host_tier, model_id
        self.shadow_fraction, self.cold_age_s = shadow_fraction, cold_age_s
        self.shadow_cap = int(shadow_fraction * num_blocks)  # §3.3: "limited to 25% of the KV pool"

        n = num_blocks
        self._ref = [0] * n
        self._shadow = [False] * n
        self._hash: list[int | None] = [None] * n
        self._key: list[tuple | None] = [None] * n
        self._free = list(range(n - 1, 0 - 1, -1))          # stack; pops 0, 1, 2, ... first
        self._cache: dict[int, int] = {}                     # hash -> canonical device page
        self._lru = (OrderedDict(), OrderedDict())           # [normal, shadow]: cached page -> last use
        self._num_shadow = 0
        self._spilling: OrderedDict[int, object] = OrderedDict()  # page -> event (side stream, FIFO)
        self._spill_index: dict[int, int] = {}               # hash -> spilling page (cancellable)
        self._side_copy: OrderedDict[int, object] = OrderedDict()  # page -> event of a copy maybe in flight
        self._last_side_event = None                         # newest event recorded on the side stream
        self._roots: dict[str, int] = {}
        self._now = float("-inf")
        self._stats = PoolStats(block_size=block_size, num_blocks=n, shadow_cap_blocks=self.shadow_cap)

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Pages on the free list (not counting evictable cached pages)."""
        return len(self._free)

    @property
    def num_shadow_blocks(self) -> int:
        return self._num_shadow

    @property
    def num_cached_blocks(self) -> int:
        """Evictable pages: ref 0 and in the prefix cache."""
        return len(self._lru[0]) + len(self._lru[1])

    @property
    def num_spilling_blocks(self) -> int:
        return len(self._spilling)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_shadow(self, block_id: int) -> bool:
        return self._shadow[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The chained hash of a registered page (None if not registered)."""
        return self._hash[block_id]

    def is_cached(self, page_hash: int) -> bool:
        """Whether a device page is registered under page_hash."""
        return page_hash in self._cache

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the accounting (counters since construction, gauges now)."""
        s = self._stats
        in_use_shadow = self._num_shadow - len(self._lru[1]) - sum(self._shadow[b] for b in self._spilling)
        s.free_blocks = len(self._free)
        s.normal_cached_blocks, s.shadow_cached_blocks = len(self._lru[0]), len(self._lru[1])
        s.spilling_blocks = len(self._spilling)
        s.shadow_in_use_blocks = in_use_shadow
        s.normal_in_use_blocks = (self.num_blocks - s.free_blocks - s.spilling_blocks - self.num_cached_blocks
                                  - in_use_shadow)
        host = self.host_tier
        if host is not None:
            s.host_capacity_pages = host.num_pages
            s.host_shadow_pages = host.num_shadow
            s.host_normal_pages = host.num_used - host.num_shadow
        return PoolStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})

    def _clock(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"now: {now} is earlier than a previous call's {self._now} (time must not decrease)")
        self._now = now

    def _root(self, tenant: str) -> int:
        root = self._roots.get(tenant)
        if root is None:
            if not isinstance(tenant, str):
                raise TypeError(f"tenant: expected a str, got {type(tenant).__name__}")
            root = self._roots[tenant] = root_hash(self.model_id, tenant)
        return root

    # ---- allocation ------------------------------------------------------------------------------------
    def can_allocate(self, n: int, *, now: float, shadow: bool = False) -> bool:
        """Whether allocate(n, now=now, shadow=shadow) would succeed now."""
        return self.available_blocks(now=now, shadow=shadow, limit=n) >= n

    def available_blocks(self, *, now: float, shadow: bool = False, limit: int | None = None) -> int:
        """How many pages (at most limit) one allocation of this class could get: free pages plus the cached
        pages it may evict (Alg. 1 line 11's "free shadow KV" for shadow=True; it scans up to `limit` cold
        entries, so pass a limit). With async CUDA spills an allocation that must evict first returns None
        until poll() saw the copies complete, although this count includes the pages it evicts."""
        self._clock(now)
        if self._spilling:
            self._retire_spills()
        free, lru = len(self._free), self._lru
        limit = self.num_blocks if limit is None else limit
        if not shadow:
            return min(limit, free + len(self._spilling) + len(lru[0]) + len(lru[1]))
        return shadow_available(limit, free, self.shadow_cap - self._num_shadow, lru[1], lru[0],
                                now - self.cold_age_s)

    def allocate(self, n: int, *, now: float, shadow: bool = False) -> list[int] | None:
        """n fresh writable pages (ref 1) of the given class, or None (nothing taken) if that cannot be done
        now. May evict cached pages (spilling them to the host tier). With async CUDA spills an evicted page
        is handed out only after poll() saw its copy complete: allocate starts the spills it needs and
        returns None; the same call succeeds on a later iteration."""
        self._clock(now)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        if n == 0:
            return []
        if self._spilling:
            self._retire_spills()
        free = self._free
        if n > len(free) or (shadow and self._num_shadow + n > self.shadow_cap):
            if not self._make_room(n, shadow, now):
                self._stats.allocation_failures += 1
                return None
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        ref = self._ref
        for b in ids:
            ref[b] = 1
        if shadow:
            flags = self._shadow
            for b in ids:
                flags[b] = True
            self._num_shadow += n
            self._stats.shadow_blocks_allocated += n
        self._stats.allocated_blocks += n
        return ids

    def _make_room(self, n: int, shadow: bool, now: float) -> bool:
        """Evict what an allocation of n pages needs (eviction.py rules); whether it can proceed now."""
        lru, free = self._lru, self._free
        if self._spilling and n <= len(free) + len(self._spilling):
            return False  # async: wait for the spills in flight (poll) instead of evicting more
        if shadow:
            victims = plan_shadow(n, len(free), self.shadow_cap - self._num_shadow, lru[1], lru[0],
                                  now - self.cold_age_s)
            if victims is None:
                return False
            flags = self._shadow
            for b in victims:
                del lru[flags[b]][b]
        else:  # a normal allocation may evict any entry; pages still being copied out count as coming
            victims = take_normal_victims(n - len(free) - len(self._spilling), lru[1], lru[0])
            if victims is None:
                return False
        self._evict(victims)
        # async spills: the victims are reusable only after their copies completed (poll)
        return n <= len(free) and not (shadow and self._num_shadow + n > self.shadow_cap)

    def release(self, block_ids, *, now: float) -> None:
        """Drop one reference on each page. A page reaching ref 0 stays cached (evictable, LRU by now) if it
        is a registered prefix page, else returns to the free list. Raises ValueError (nothing changed) if a
        page is not owned (ref 0) or out of range. Tail pages are made older than head pages, so a prefix's
        end is evicted before its beginning."""
        self._clock(now)
        ref, n = self._ref, self.num_blocks
        for i, b in enumerate(block_ids):
            if not 0 <= b < n or ref[b] <= 0:
                for done in block_ids[:i]:
                    ref[done] += 1
                what = "out of range" if not 0 <= b < n else "not owned (ref count 0: double free?)"
                raise ValueError(f"block_ids: page {b} is {what}")
            ref[b] -= 1
        cache, hashes, lru, flags = self._cache, self._hash, self._lru, self._shadow
        unregistered = []
        for b in reversed(block_ids):
            if ref[b] == 0:
                h = hashes[b]
                if h is not None and cache.get(h) == b:
                    lru[flags[b]][b] = now
                else:
                    unregistered.append(b)
        if unregistered:
            self._free_blocks(unregistered, lost=True)

    def _unallocate(self, block_ids: list[int]) -> None:
        """Undo allocate() of pages that were never used (not counted as allocated or wasted)."""
        for b in block_ids:
            self._ref[b] = 0
            self._stats.shadow_blocks_allocated -= self._shadow[b]
        self._stats.allocated_blocks -= len(block_ids)
        self._free_blocks(block_ids, lost=False)

    def _free_blocks(self, block_ids, *, lost: bool) -> None:
        """Pages back to the free list (ref 0 already). lost: their content is gone from every tier."""
        hashes, keys = self._hash, self._key
        for b in block_ids:
            hashes[b] = keys[b] = None
        if self._num_shadow:
            flags, n_shadow = self._shadow, 0
            for b in block_ids:
                if flags[b]:
                    flags[b] = False
                    n_shadow += 1
            self._num_shadow -= n_shadow
            if lost:  # shadow content gone without a routed hit
                self._stats.shadow_blocks_wasted += n_shadow
        self._free.extend(block_ids)

    # ---- prefix cache --------------------------------------------------------------------------------
    def page_hash_chain(self, token_ids, *, tenant: str = "") -> PageHashes:
        """A PageHashes for an append-only token list of this pool's model and `tenant`, to pass as `hashes=`
        to acquire_prefix / peek_prefix / commit on every call about that list."""
        return PageHashes(token_ids, self.block_size, self._root(tenant))

    def _chain(self, tokens, tenant: str, hashes: PageHashes | None) -> PageHashes:
        """The caller's chain (checked to belong to tokens, tenant and this pool) or a fresh one."""
        if hashes is None:
            return PageHashes(tokens, self.block_size, self._root(tenant))
        if not isinstance(hashes, PageHashes):
            raise TypeError(f"hashes: expected a PageHashes, got {type(hashes).__name__}")
        if hashes.tokens is not tokens or hashes.block_size != self.block_size or hashes.root != self._root(tenant):
            raise ValueError("hashes: built for another token list, tenant, model or block size "
                             "(use BlockPool.page_hash_chain(token_ids, tenant=...))")
        hashes.extend_to(0)   # O(1) check: drops known pages the token list no longer holds (append-only)
        return hashes

    def commit(self, block_ids, token_ids, *, now: float, tenant: str = "", num_tokens: int | None = None,
               hashes: PageHashes | None = None) -> int:
        """Register the full pages of a sequence (page i holds token_ids[i*bs:(i+1)*bs]) in the prefix cache
        under the chained hash of (parent, tokens, model id, tenant). The partial last page is not registered.
        num_tokens: how many leading tokens have their KV written (default: all of token_ids), so an engine
        can pass a sequence's whole token list without copying it. hashes: the list's PageHashes
        (page_hash_chain): pages an earlier lookup or commit hashed into it are not hashed again, the pages
        hashed here are added to it. Idempotent; only pages after the last registered one are hashed.
        Returns the number of pages that became cache entries (a page whose content is already cached
        elsewhere gets the hash, for the chain, but stays private and is freed on release)."""
        self._clock(now)
        tokens = as_token_sequence(token_ids)
        bs = self.block_size
        n_tokens = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        n_full = min(len(block_ids), n_tokens // bs)
        page_hash = self._hash
        first = n_full
        while first > 0 and page_hash[block_ids[first - 1]] is None:
            first -= 1
        if first == n_full:
            return 0
        ref, n = self._ref, self.num_blocks
        for i in range(first, n_full):  # validate before changing anything
            b = block_ids[i]
            if not 0 <= b < n or ref[b] <= 0:
                raise ValueError(f"block_ids: page {b} is not owned (ref count 0) or out of range")
        parent = page_hash[block_ids[first - 1]] if first else self._root(tenant)
        chain = self._chain(tokens, tenant, hashes) if hashes is not None else None
        if chain is not None and (len(chain) < first
                                  or (chain.hashes[first - 1] if first else chain.root) != parent):
            chain = None   # the chain does not reach (or disagrees with) the registered pages: not used
        known = min(len(chain), n_full) if chain is not None else first
        cache, page_key, spill_index, registered = self._cache, self._key, self._spill_index, 0
        if known > first:  # pages hashed by an earlier lookup or commit
            page_hashes, keys = chain.hashes, chain.keys
            for i in range(first, known):
                b = block_ids[i]
                parent = page_hashes[i]
                page_hash[b] = parent
                page_key[b] = keys[i]
                if parent not in cache:
                    cache[parent] = b
                    if spill_index:
                        spill_index.pop(parent, None)  # an older copy being spilled is no longer canonical
                    registered += 1
            first = known
        remember = chain is not None  # pages hashed here are remembered for later lookups of this sequence
        pages = zip(*[iter(tokens[first * bs:n_full * bs])] * bs)   # each page's tokens as a tuple (C-level)
        for b, page in zip(block_ids[first:n_full], pages):
            key = (parent, page)
            parent = hash(key)
            if remember:
                chain.hashes.append(parent)
                chain.keys.append(key)
            page_hash[b] = parent
            page_key[b] = key
            if parent not in cache:
                cache[parent] = b
                if spill_index:
                    spill_index.pop(parent, None)
                registered += 1
        return registered

    def touch(self, block_ids, *, now: float) -> None:
        """Mark pages used now: evictable cached pages become the most recently used of their class."""
        self._clock(now)
        lru, flags, n = self._lru, self._shadow, self.num_blocks
        for b in block_ids:
            if not 0 <= b < n:
                raise ValueError(f"block_ids: page {b} is out of range")
            entries = lru[flags[b]]
            if b in entries:
                entries[b] = now
                entries.move_to_end(b)
