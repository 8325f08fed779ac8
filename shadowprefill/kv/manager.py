"""KVCacheManager: the request-level KV calls an engine makes (DESIGN.md §5, paper §3.3).

One instance's paged KV: a page pool (ref counts, normal / capped evict-first shadow class, LRU, cold
age), a prefix index (hash-chained full pages, salted with model id and tenant) and an optional host
offload tier (spill on eviction, reload on a prefix hit). Engines, the shadow job queue, P/D transfers
and Oracle call only these methods:

    match = kv.match_prefix(tokens, now=t, tenant=..., promote=routed)   # refs on the cached prefix
    pages = kv.allocate(n, now=t, shadow=False)                          # fresh pages, or None
    kv.commit(pages, tokens, now=t, num_tokens=computed)                 # register full pages
    kv.free(pages, now=t)                                                # drop refs (cached pages stay)
    kv.import_prefix(tokens, now=t)                                      # KV that arrived from elsewhere

Every time-dependent call takes `now` (seconds, never decreasing). Long append-only sequences pass a
`hashes=` chain (`hash_chain(tokens, tenant)`) so their pages are hashed once.
"""
from __future__ import annotations

import torch

from .block_pool import BlockPool, PrefixMatch
from .host_tier import HostTier
from .prefix_hash import PageHashes
from .stats import PoolStats

__all__ = ["KVCacheManager", "PrefixMatch"]


class KVCacheManager:
    """Request-level KV cache calls of one instance (`kv_cache=None`: bookkeeping only, for simulation)."""

    def __init__(self, num_blocks: int, block_size: int, *, kv_cache: torch.Tensor | None = None,
                 host_tier: HostTier | None = None, page_bytes: int = 0, shadow_fraction: float = 0.25,
                 cold_age_s: float = 5.0, model_id: str = "") -> None:
        self._pool = BlockPool(num_blocks, block_size, kv_cache=kv_cache, host_tier=host_tier,
                               page_bytes=page_bytes, shadow_fraction=shadow_fraction, cold_age_s=cold_age_s,
                               model_id=model_id)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache, self.host_tier, self.model_id = kv_cache, host_tier, model_id
        self.shadow_cap = self._pool.shadow_cap

    # ---- queries (no state change) ---------------------------------------------------------------------
    @property
    def has_host_tier(self) -> bool:
        return self.host_tier is not None

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the accounting (counters since construction, gauges now)."""
        return self._pool.stats

    @property
    def num_free_blocks(self) -> int:
        """Pages on the free list (not counting evictable cached pages)."""
        return self._pool.num_free_blocks

    @property
    def num_shadow_blocks(self) -> int:
        """Pages of the shadow class (in use, cached or spilling)."""
        return self._pool.num_shadow_blocks

    def hash_chain(self, token_ids, tenant: str = "") -> PageHashes:
        """The page-hash chain of an append-only token list of this model and `tenant`, to pass as `hashes=`
        to every call about that list (pages are hashed once)."""
        return self._pool.page_hash_chain(token_ids, tenant=tenant)

    def peek_prefix(self, token_ids, *, tenant: str = "", max_tokens: int | None = None,
                    hashes: PageHashes | None = None) -> tuple[int, int]:
        """(device_tokens, host_tokens) of the longest cached prefix, touching nothing."""
        return self._pool.peek_prefix(token_ids, tenant=tenant, max_tokens=max_tokens, hashes=hashes)

    def free_blocks(self, *, now: float, shadow: bool = False, limit: int | None = None) -> int:
        """Pages one allocation of this class could get now (at most `limit`): free pages plus the cached
        pages it may evict (for shadow: within the cap, only cold ones)."""
        return self._pool.available_blocks(now=now, shadow=shadow, limit=limit)

    # ---- request-level calls -----------------------------------------------------------------------------
    def match_prefix(self, token_ids, *, now: float, tenant: str = "", shadow: bool = False, promote: bool = False,
                     max_tokens: int | None = None, hashes: PageHashes | None = None) -> PrefixMatch:
        """Take the longest cached prefix (device pages, host pages reloaded into fresh pages of the caller's
        class); one reference on every returned page. `promote` (a routed request): hit shadow pages become
        normal (§3.3)."""
        return self._pool.acquire_prefix(token_ids, now=now, tenant=tenant, shadow=shadow, promote=promote,
                                         max_tokens=max_tokens, hashes=hashes)

    def allocate(self, n: int, *, now: float, shadow: bool = False) -> list[int] | None:
        """n fresh writable pages (ref 1) of the class, or None (nothing taken)."""
        return self._pool.allocate(n, now=now, shadow=shadow)

    def commit(self, block_ids, token_ids, *, now: float, tenant: str = "", num_tokens: int | None = None,
               hashes: PageHashes | None = None) -> int:
        """Register the full pages among the first `num_tokens` tokens in the prefix index; returns how many
        pages became cache entries."""
        return self._pool.commit(block_ids, token_ids, now=now, tenant=tenant, num_tokens=num_tokens,
                                 hashes=hashes)

    def free(self, block_ids, *, now: float) -> None:
        """Drop one reference on each page (registered pages stay cached, evictable)."""
        self._pool.release(block_ids, now=now)

    def touch(self, block_ids, *, now: float) -> None:
        """Mark cached pages used now (most recently used of their class)."""
        self._pool.touch(block_ids, now=now)

    def poll(self, now: float) -> None:
        """Retire host spills whose copies completed (CUDA; a no-op otherwise)."""
        self._pool.poll(now)

    def import_prefix(self, token_ids, *, now: float, tenant: str = "", shadow: bool = False) -> tuple[int, int]:
        """Make `token_ids`' whole pages resident without computing them: KV that arrives from elsewhere (a
        P/D transfer, Oracle's free prefix). Cached pages (device or host) are reused; new ones come from what
        the class can get now (normal: free or evictable; shadow: free or cold within the cap). Returns
        (tokens resident, tokens added)."""
        bs = self.block_size
        pages = len(token_ids) // bs
        if pages == 0:
            return 0, 0
        match = self.match_prefix(token_ids, now=now, tenant=tenant, shadow=shadow, max_tokens=pages * bs)
        need = pages - len(match.block_ids)
        new: list[int] = []
        if need > 0:
            new = self.allocate(self.free_blocks(now=now, shadow=shadow, limit=need), now=now, shadow=shadow) or []
        blocks = list(match.block_ids) + new
        self.commit(blocks, token_ids[:len(blocks) * bs], now=now, tenant=tenant)
        self.free(blocks, now=now)
        return len(blocks) * bs, len(new) * bs
