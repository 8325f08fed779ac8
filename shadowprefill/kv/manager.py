"""KVCacheManager: the request-level KV calls an engine makes (DESIGN.md §5, paper §3.3).

One instance's paged KV: a page pool (ref counts, normal / capped evict-first shadow class, LRU per class,
cold age, free list), a prefix index (hash-chained full pages, salted with model id and tenant) and an
optional host offload tier (spill on eviction, reload on a prefix hit). Engines, the shadow job queue, P/D
transfers and Oracle call only these methods:

    match = kv.match_prefix(tokens, now=t, tenant=..., promote=routed)   # refs on the cached prefix
    pages = kv.allocate(n, now=t, shadow=False)                          # fresh pages, or None
    kv.commit(pages, tokens, now=t, num_tokens=computed)                 # register full pages
    kv.free(pages, now=t)                                                # drop refs (cached pages stay)
    kv.import_prefix(tokens, now=t)                                      # KV that arrived from elsewhere

Requests (anything with `request_id`, `tenant`, `num_computed_tokens` and `token_ids_upto(n)`, e.g.
`engine.Request`) are served by the request-shaped calls, vLLM's shape; the manager keeps each request's
pages (`block_table(req)`, a list the caller reads but never changes):

    match = kv.get_computed_blocks(req, now=t, max_tokens=n, promote=routed)  # its cached prefix
    pages = kv.allocate_slots(req, num_new_tokens, now=t)    # pages for its next tokens (None: no room)
    kv.cache(req, now=t)                                     # register its full computed pages
    kv.free(req, now=t)                                      # all its pages (cached ones stay cached)

An iteration's many small calls can go as one core call each (`allocate_slots_many(decodes_due, 1, now=t)`,
`cache_many(filled, now=t)`; list-shaped: `allocate_many`, `commit_many`): the same decisions in the same
order, the manager's per-call Python cost paid once per iteration instead of once per request.

Every device page is free, in use (ref > 0; a page with ref > 1 is always a registered, read-only prefix
page), cached (ref 0, registered, evictable) or spilling (evicted, its device->host copy in flight; CUDA
only). Pages are identified by their page hash (page_hash.py). Every time-dependent call takes `now`
(seconds, never decreasing). Long append-only sequences pass a `hashes=` chain (`hash_chain(tokens,
tenant)`) so their pages are hashed once. With kv_cache=None (and a bookkeeping-only HostTier) the manager
takes the same decisions and keeps the same accounting without tensors.

The manager validates arguments and moves bytes (HostTier copies); the decisions are taken by its core:
`backend="python"` is core.py (the page pool, prefix index and host offload parts, sequenced in one place:
the reference), `backend="native"` the C++ core of csrc/kv/ (the same decisions and accounting, one call
per manager call; native.py). The default is native when it was built (SHADOWPREFILL_KV_BACKEND overrides).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shadowprefill.shadow.policy import COLD_AGE_S, SHADOW_FRACTION

from .core import KVCore
from .host_tier import HostTier
from .native import native_module, resolve_backend
from .page_hash import PageHashes, as_token_sequence
from .stats import PoolStats

__all__ = ["KVCacheManager", "PrefixMatch"]


@dataclass
class PrefixMatch:
    """Result of KVCacheManager.match_prefix: the caller holds one reference on each page in block_ids."""
    block_ids: list[int]        # pages covering the matched prefix, in order
    num_tokens: int             # len(block_ids) * block_size
    device_tokens: int          # matched on the device (incl. cancelled spills)
    host_tokens: int            # reloaded from the host tier into fresh pages
    shadow_tokens: int          # matched pages that were shadow-class pages
    ready_event: object | None = None  # what the forward waits on before reading the pages: a layer-wise
                                       # ReloadBatch (wait(layer)) or a spill's CUDA event (wait())


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    return value


class KVCacheManager:
    """Request-level KV cache calls of one instance (`kv_cache=None`: bookkeeping only, for simulation).
    `backend`: "native" (the C++ core; the default when built) or "python" (the reference); None takes
    SHADOWPREFILL_KV_BACKEND or the default. A shared HostTier serves pools of one backend."""

    def __init__(self, num_blocks: int, block_size: int, *, kv_cache: torch.Tensor | None = None,
                 host_tier: HostTier | None = None, page_bytes: int = 0, shadow_fraction: float = SHADOW_FRACTION,
                 cold_age_s: float = COLD_AGE_S, model_id: str = "", backend: str | None = None) -> None:
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
        copy = self._copy if kv_cache is not None and host_tier is not None else None
        self.backend = resolve_backend(backend)
        if self.backend == "native" and num_blocks >= 2**31:
            raise ValueError(f"num_blocks: the native backend holds < 2**31 pages, got {num_blocks}")
        host_index = host_tier.attach(self.backend) if host_tier is not None else None
        core = native_module().KVCore if self.backend == "native" else KVCore
        self._core = core(num_blocks, block_size, self.shadow_cap, cold_age_s, model_id, host_index,
                          self.page_bytes, copy)
        # the per-iteration calls, bound once (native: vectorcall builtins that skip pybind11's dispatcher)
        core = self._core
        calls = core.fast_calls() if self.backend == "native" else (
            core.allocate, core.commit, core.free, core.match, core.poll, core.allocate_many, core.commit_many)
        (self._allocate, self._commit, self._free, self._match, self._poll, self._allocate_many,
         self._commit_many) = calls
        self._tables: dict[str, list[int]] = {}       # request id -> its pages, in token order

    # ---- request-shaped calls (the scheduler's) ------------------------------------------------------------
    def block_table(self, request) -> list[int]:
        """The request's pages in token order (empty if it holds none). Read-only for the caller."""
        return self._tables.get(request.request_id, [])

    def get_computed_blocks(self, request, *, now: float, max_tokens: int, promote: bool = False,
                            shadow: bool = False, hashes: PageHashes | None = None) -> PrefixMatch:
        """Take the longest cached prefix (at most `max_tokens` tokens) of a request that holds no pages:
        they become its first pages. promote=True: a routed request (hit shadow pages turn normal, §3.3);
        shadow=True: shadow work (host-tier reloads go to shadow-class pages); `hashes`: the token list's
        kept chain (see hash_chain)."""
        rid = request.request_id
        if self._tables.get(rid):
            raise ValueError(f"request {rid!r} already holds pages; free it first")
        match = self.match_prefix(request.token_ids_upto(max_tokens), now=now, tenant=request.tenant,
                                  shadow=shadow, promote=promote, max_tokens=max_tokens, hashes=hashes)
        self._tables[rid] = match.block_ids
        return match

    def allocate_slots(self, request, num_new_tokens: int, *, now: float, num_computed_tokens: int | None = None,
                       shadow: bool = False) -> list[int] | None:
        """Pages so that the request's pages hold its computed tokens (`num_computed_tokens`, default the
        request's) plus `num_new_tokens`; returns the new pages ([] if none were needed), or None (nothing
        taken) if the pool cannot give them now."""
        table = self._tables.get(request.request_id)
        if table is None:
            table = self._tables[request.request_id] = []
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        bs = self.block_size
        need = (computed + num_new_tokens + bs - 1) // bs - len(table)
        if need <= 0:
            return []
        blocks = self._allocate(need, now, shadow)
        if blocks is not None:
            table += blocks
        return blocks

    def allocate_slots_many(self, requests, num_new_tokens: int, *, now: float, shadow: bool = False) -> int:
        """allocate_slots(r, num_new_tokens) for each request in order (e.g. every decode due a page this
        iteration), in one core call; stops at the first request the pool cannot serve now. Returns how many
        requests (a prefix of `requests`) got their pages; the rest have nothing new."""
        if num_new_tokens.__class__ is not int or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: expected an int >= 0, got {num_new_tokens!r}")
        tables, bs = self._tables, self.block_size
        owned, needs = [], []
        for r in requests:
            table = tables.get(r.request_id)
            if table is None:
                table = tables[r.request_id] = []
            need = (r.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(table)
            owned.append(table)
            needs.append(need if need > 0 else 0)
        got = self._allocate_many(needs, now, shadow)
        for table, pages in zip(owned, got):
            table += pages
        return len(got)

    def cache_many(self, requests, *, now: float) -> int:
        """cache(r) for each request in order (e.g. every request whose computed tokens filled a page this
        iteration), in one core call; returns the pages that became cache entries."""
        tables = self._tables
        items = []
        for r in requests:
            n = r.num_computed_tokens
            tokens = r.token_ids_upto(n)
            if tokens.__class__ is not list:
                tokens = as_token_sequence(tokens)
            items.append((tables.get(r.request_id, ()), tokens, r.tenant, n, None))
        return self._commit_many(items, now)

    def cache(self, request, *, now: float, num_tokens: int | None = None, hashes: PageHashes | None = None) -> int:
        """Register the request's full pages among its first `num_tokens` (default: its computed) tokens in
        the prefix index (see commit; `hashes`: the token list's kept chain)."""
        n = request.num_computed_tokens if num_tokens is None else num_tokens
        tokens = request.token_ids_upto(n)
        if tokens.__class__ is not list:
            tokens = as_token_sequence(tokens)
        return self._commit(self._tables.get(request.request_id, ()), tokens, now, request.tenant, n, hashes)

    # ---- queries (no state change) ---------------------------------------------------------------------
    @property
    def has_host_tier(self) -> bool:
        return self.host_tier is not None

    @property
    def num_free_blocks(self) -> int:
        """Pages on the free list (not counting evictable cached pages)."""
        return self._core.counts()[0]

    @property
    def num_shadow_blocks(self) -> int:
        """Pages of the shadow class (in use, cached or spilling)."""
        return self._core.counts()[1]

    @property
    def num_cached_blocks(self) -> int:
        """Evictable pages: ref 0 and in the prefix index."""
        return self._core.counts()[2]

    @property
    def num_spilling_blocks(self) -> int:
        """Evicted pages whose device->host copy may still run (not reusable yet)."""
        return self._core.counts()[3]

    def ref_count(self, block_id: int) -> int:
        return self._core.page(block_id)[0]

    def is_shadow(self, block_id: int) -> bool:
        return self._core.page(block_id)[1]

    def block_hash(self, block_id: int) -> int | None:
        """The page hash a page carries (None if it was never committed)."""
        return self._core.page(block_id)[2]

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the accounting (counters since construction, gauges now)."""
        return PoolStats(**self._core.stats_dict())

    def snapshot(self) -> dict:
        """Every page's bookkeeping, for tests and invariant checks: per page `ref`, `shadow`, `hash`; the
        `free` list; each class's `lru` as (page, last use), oldest first; `spilling` pages; `index` (hash ->
        canonical page); `now`."""
        return self._core.snapshot()

    def hash_chain(self, token_ids, tenant: str = "") -> PageHashes:
        """The page-hash chain of an append-only token list of this model and `tenant`, to pass as `hashes=`
        to every call about that list (pages are hashed once; the pages found are remembered). A PageHashes
        (python backend) or the native PageChain: the same `tokens`, `hashes`, `extend_to`, `retarget`."""
        return self._core.hash_chain(as_token_sequence(token_ids), tenant)

    def peek_prefix(self, token_ids, *, tenant: str = "", max_tokens: int | None = None,
                    hashes: PageHashes | None = None) -> tuple[int, int]:
        """(device_tokens, host_tokens) of the longest cached prefix, without taking references, touching
        LRUs or moving bytes: how much of a sequence the instance already holds."""
        tokens = as_token_sequence(token_ids)
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        return self._core.peek(tokens, tenant, limit, hashes)

    def free_blocks(self, *, now: float, shadow: bool = False, limit: int | None = None) -> int:
        """Pages one allocation of this class could get now (at most `limit`): free pages plus the cached
        pages it may evict (for shadow: within the cap, only cold ones; Alg. 1 line 11's "free shadow KV").
        With async CUDA spills an allocation that must evict first returns None until poll() saw the copies
        complete, although this count includes the pages it evicts."""
        return self._core.available(now, shadow, self.num_blocks if limit is None else limit)

    def can_allocate(self, n: int, *, now: float, shadow: bool = False) -> bool:
        """Whether allocate(n, now=now, shadow=shadow) would succeed now (exact with synchronous copies)."""
        return self.free_blocks(now=now, shadow=shadow, limit=n) >= n

    # ---- request-level calls -----------------------------------------------------------------------------
    def match_prefix(self, token_ids, *, now: float, tenant: str = "", shadow: bool = False, promote: bool = False,
                     max_tokens: int | None = None, hashes: PageHashes | None = None) -> PrefixMatch:
        """Take the longest cached prefix of full pages of token_ids (at most max_tokens tokens).

        Each page is found on the device (a page whose spill is in flight is taken back, the eviction
        cancelled) or in the host tier; host pages are reloaded into fresh pages of the caller's class,
        stopping at the first one that cannot be allocated now. One reference is taken on every returned
        page. promote=True (a routed request) turns hit shadow pages into normal ones (§3.3)."""
        tokens = token_ids if token_ids.__class__ is list else as_token_sequence(token_ids)
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        blocks, device, host, shadow_tokens, ready = self._match(tokens, now, tenant, shadow, promote, limit, hashes)
        return PrefixMatch(blocks, device + host, device, host, shadow_tokens, ready)

    def allocate(self, n: int, *, now: float, shadow: bool = False) -> list[int] | None:
        """n fresh writable pages (ref 1) of the class, or None (nothing taken) if that cannot be done now.
        May evict cached pages (spilling them to the host tier). With async CUDA spills an evicted page is
        handed out only after poll() saw its copy complete: allocate starts the spills it needs and returns
        None; the same call succeeds on a later iteration."""
        if n.__class__ is not int or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        return self._allocate(n, now, shadow)

    def commit(self, block_ids, token_ids, *, now: float, tenant: str = "", num_tokens: int | None = None,
               hashes: PageHashes | None = None) -> int:
        """Register the full pages among the first `num_tokens` tokens (default: all; page i holds
        token_ids[i*bs:(i+1)*bs]) in the prefix index; the partial last page is not registered. Only pages
        after the last registered one are hashed (hashes=: taken from / added to the chain). Idempotent.
        Returns the number of pages that became cache entries (a page whose content is already cached
        elsewhere gets the hash, for the chain, but stays private and is freed on release)."""
        if token_ids.__class__ is not list:   # (the common case, a list, skips the call)
            token_ids = as_token_sequence(token_ids)
        return self._commit(block_ids, token_ids, now, tenant, num_tokens, hashes)

    def allocate_many(self, counts, *, now: float, shadow: bool = False) -> list[list[int]]:
        """allocate(n) for each n of `counts` in order, in one call: the page lists of the counts met, stopping
        at the first that cannot be met now (nothing taken for it or the rest). Counts are validated first
        (TypeError / ValueError, nothing taken)."""
        return self._allocate_many(counts, now, shadow)

    def commit_many(self, items, *, now: float) -> int:
        """commit for several page lists in one call: `items` are (block_ids, token_ids, tenant, num_tokens,
        hashes) tuples (token_ids a list or tuple; num_tokens and hashes may be None), committed in order as that
        many commit calls would be (an error in one leaves the earlier ones committed). Returns the total of
        pages that became cache entries."""
        return self._commit_many(items, now)

    def free(self, block_ids, *, now: float) -> None:
        """Drop one reference on each page: `block_ids`, a list of pages, or a request (all its pages). A page
        reaching ref 0 stays cached (evictable, most recently used of its class) if it is a registered prefix
        page, else returns to the free list. Raises ValueError (nothing changed) if a page is not owned or out
        of range. Tail pages are made older than head pages, so a prefix's end is evicted before its
        beginning."""
        if block_ids.__class__ is not list and hasattr(block_ids, "request_id"):
            table = self._tables.pop(block_ids.request_id, None)
            if table:
                self._free(table, now)
            return
        self._free(block_ids, now)

    def touch(self, block_ids, *, now: float) -> None:
        """Mark pages used now: cached ones become the most recently used of their class."""
        self._core.touch(block_ids, now)

    def start_reloads(self) -> None:
        """Issue the host-tier reloads matched since the last call as one layer-wise copy on the side stream
        (one event per layer, kv/reload.py), so they start before the forward pass is enqueued. Reloads not
        issued this way are issued by the first wait on them or the next spill. No-op without tensors."""
        if self.kv_cache is not None and self.host_tier is not None:
            self.host_tier.start_reloads(self.kv_cache)

    def poll(self, now: float) -> None:
        """Retire completed async copies: spilled device pages become free (CUDA; a no-op otherwise)."""
        self._poll(now)

    def import_prefix(self, token_ids, *, now: float, tenant: str = "", shadow: bool = False) -> tuple[int, int]:
        """Make `token_ids`' whole pages resident without computing them: KV that arrives from elsewhere (a
        P/D transfer, Oracle's free prefix). Cached pages (device or host) are reused; new ones come from what
        the class can get now (normal: free or evictable; shadow: free or cold within the cap). Returns
        (tokens resident, tokens added)."""
        bs = self.block_size
        tokens = as_token_sequence(token_ids)
        pages = len(tokens) // bs
        if pages == 0:
            return 0, 0
        blocks = self._match(tokens, now, tenant, shadow, False, pages * bs, None)[0]
        new = self._core.allocate_up_to(pages - len(blocks), now, shadow)
        blocks += new
        self._commit(blocks, tokens, now, tenant, len(blocks) * bs, None)
        self._free(blocks, now)
        return len(blocks) * bs, len(new) * bs

    def _copy(self, to_host: bool, src_ids: list[int], dst_ids: list[int]):
        """Move pages between the device cache and the host tier; the side-stream event (None: done)."""
        if to_host:
            return self.host_tier.spill(self.kv_cache, src_ids, dst_ids)
        return self.host_tier.reload(self.kv_cache, src_ids, dst_ids)
