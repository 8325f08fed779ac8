"""KVCore: the bookkeeping behind KVCacheManager, in Python (the reference implementation; the native core in
`csrc/kv/` takes the same decisions and keeps the same accounting).

It sequences three parts that own their state: the page pool (page_pool.py), the prefix index
(prefix_index.py) and the host offload tier (offload.py over the HostTier). This is the one place where a
prefix match takes references, reloads host pages into fresh allocations and releases what it cannot use,
where an allocation evicts (spilling to the host) and where committed pages enter the index. Token lists
arrive as lists or tuples (the manager converts); every method that depends on time takes `now`.
"""
from __future__ import annotations

import itertools

from .offload import HostOffload
from .page_hash import PageHashes, chain_pages, pool_salt, salt_root
from .page_pool import PagePool
from .prefix_index import PrefixIndex
from .stats import PoolStats


_SERIALS = itertools.count(1)   # identifies a core in the chains it resolved pages for


class KVCore:
    """Page pool + prefix index + host offload of one KV cache (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, shadow_cap: int, cold_age_s: float, model_id: str,
                 host_index=None, page_bytes: int = 0, copy=None):
        self.num_blocks, self.block_size, self.model_id, self.page_bytes = num_blocks, block_size, model_id, page_bytes
        self.pool = PagePool(num_blocks, shadow_cap, cold_age_s)
        self.index = PrefixIndex(num_blocks)
        self.host = host_index    # the host tier's HostIndex (None: no host tier)
        self.offload = HostOffload(self.host, copy)
        self.stats = PoolStats(block_size=block_size, num_blocks=num_blocks, shadow_cap_blocks=shadow_cap)
        self._roots: dict[str, int] = {}
        self._now = float("-inf")
        self.serial = next(_SERIALS)

    # ---- queries ---------------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int, int, int]:
        """(free pages, shadow pages, cached pages, spilling pages)."""
        pool = self.pool
        return len(pool.free), pool.num_shadow, pool.num_cached, self.offload.num_spilling

    def page(self, b: int) -> tuple[int, bool, int | None]:
        """(ref count, shadow, hash) of one page."""
        return self.pool.ref[b], self.pool.shadow[b], self.index.page_hash[b]

    def stats_dict(self) -> dict:
        """The PoolStats fields: counters since construction, gauges now."""
        s, pool = self.stats, self.pool
        spilling = self.offload.spilling
        in_use_shadow = pool.num_shadow - len(pool.lru[1]) - sum(pool.shadow[b] for b in spilling)
        s.free_blocks = len(pool.free)
        s.normal_cached_blocks, s.shadow_cached_blocks = len(pool.lru[0]), len(pool.lru[1])
        s.spilling_blocks = len(spilling)
        s.shadow_in_use_blocks = in_use_shadow
        s.normal_in_use_blocks = (self.num_blocks - s.free_blocks - s.spilling_blocks - pool.num_cached
                                  - in_use_shadow)
        host = self.host
        if host is not None:
            s.host_capacity_pages = host.num_pages
            s.host_shadow_pages = host.num_shadow
            s.host_normal_pages = host.num_used - host.num_shadow
        return {k: getattr(s, k) for k in s.__dataclass_fields__}

    def snapshot(self) -> dict:
        pool = self.pool
        return {"ref": list(pool.ref), "shadow": list(pool.shadow), "hash": list(self.index.page_hash),
                "free": list(pool.free), "lru": [list(pool.lru[0].items()), list(pool.lru[1].items())],
                "spilling": list(self.offload.spilling), "index": dict(self.index.pages), "now": self._now}

    def hash_chain(self, tokens, tenant: str) -> PageHashes:
        return PageHashes(tokens, self.block_size, self._root(tenant))

    def peek(self, tokens, tenant: str, limit: int, hashes) -> tuple[int, int]:
        """(device tokens, host tokens) of the longest cached prefix of tokens[:limit]; changes nothing."""
        bs, tier = self.block_size, self.host
        chain = self._chain(tokens, tenant, hashes)
        known = self._known_pages(chain, hashes, limit // bs)
        device, host = known * bs, 0
        get, spill_index = self.index.pages.get, self.offload.spill_index
        for h in _hashes(chain, known, limit // bs):
            if get(h) is not None or h in spill_index:
                device += bs
            elif tier is not None and tier.peek(h) >= 0:
                host += bs
            else:
                break
        return device, host

    def available(self, now: float, shadow: bool, limit: int) -> int:
        """Pages (at most limit) one allocation of the class could get now."""
        self._clock(now)
        if self.offload.spilling:
            self._retire_spills()
        return self.pool.available(shadow, now, limit, self.offload.num_spilling)

    # ---- the request-level sequence ----------------------------------------------------------------------
    def match(self, tokens, now: float, tenant: str, shadow: bool, promote: bool, limit: int, hashes):
        """Take the longest cached prefix of tokens[:limit] (device pages, cancelled spills, host pages
        reloaded into fresh pages of the caller's class). Returns (pages, device tokens, host tokens, shadow
        tokens, event to wait on or None)."""
        self._clock(now)
        bs = self.block_size
        chain = self._chain(tokens, tenant, hashes)
        pool, offload, host = self.pool, self.offload, self.host
        get, spill_index = self.index.pages.get, offload.spill_index
        num_pages, num_host = limit // bs, 0
        known = self._known_pages(chain, hashes, num_pages)   # the chain's pages that are still canonical
        blocks = chain.pages[:known]
        run = list(map(get, chain.hashes[known:num_pages]))    # known hashes: looked up in bulk
        if None in run:
            del run[run.index(None):]
        blocks += run
        pool.acquire(blocks)      # references taken now, so reload allocations below cannot evict them
        for h in _hashes(chain, len(blocks), num_pages):    # blocks: device pages; host hits as tuples
            b = get(h)
            if b is not None:
                pool.acquire((b,))
                blocks.append(b)
            elif spill_index and h in spill_index:
                blocks.append(self._cancel_spill(h))
            elif host is not None and (slot := host.get(h)) >= 0:
                blocks.append((h, slot))
                num_host += 1
            else:
                break
        ready, reloaded, shadow_pages = None, (), 0
        if num_host:
            ready, reloaded, shadow_pages = self._reload_into(blocks, now, shadow, promote)
        st = self.stats
        if pool.num_shadow:
            flags = pool.shadow
            for b in blocks:
                if flags[b] and b not in reloaded:
                    shadow_pages += 1
                    if promote:  # §3.3: a routed request's hit turns the shadow page into a normal one
                        pool.promote(b)
                        st.shadow_blocks_promoted += 1
        if ready is None and offload.side_copy:
            ready = offload.pending_event(blocks, reloaded)   # a copy into / out of a page may still run
        if hashes is not None:    # a kept chain remembers where its pages are (all canonical now)
            gen = self.index.gen
            chain.owner, chain.pages, chain.gens = self.serial, list(blocks), [gen[b] for b in blocks]
        device = (len(blocks) - len(reloaded)) * bs
        matched = len(blocks) * bs
        st.lookups += 1
        st.lookup_tokens += limit
        st.device_hit_tokens += device
        st.host_hit_tokens += matched - device
        st.miss_tokens += limit - matched
        st.shadow_hit_tokens += shadow_pages * bs
        return blocks, device, matched - device, shadow_pages * bs, ready

    def allocate(self, n: int, now: float, shadow: bool) -> list[int] | None:
        """n fresh pages (ref 1) of the class, or None (nothing taken)."""
        self._clock(now)
        if n == 0:
            return []
        if self.offload.spilling:
            self._retire_spills()
        pool = self.pool
        if not pool.fits(n, shadow) and not self._make_room(n, shadow, now):
            self.stats.allocation_failures += 1
            return None
        ids = pool.take_free(n, shadow)
        if shadow:
            self.stats.shadow_blocks_allocated += n
        self.stats.allocated_blocks += n
        return ids

    def allocate_many(self, counts, now: float, shadow: bool) -> list[list[int]]:
        """allocate(n) for each n in order, stopping at the first that returns None: the page lists taken."""
        try:
            counts = list(counts)
        except TypeError:
            raise TypeError("counts: expected a sequence of ints") from None
        for n in counts:                 # validate before taking anything
            if n.__class__ is not int:
                raise TypeError("counts: expected ints")
            if n < 0:
                raise ValueError(f"counts: expected ints >= 0, got {n}")
        out = []
        for n in counts:
            ids = self.allocate(n, now, shadow)
            if ids is None:
                break
            out.append(ids)
        return out

    def allocate_up_to(self, n: int, now: float, shadow: bool) -> list[int]:
        """As many of n fresh pages as the class can get now (possibly none)."""
        if n <= 0:
            return []
        return self.allocate(self.available(now, shadow, n), now, shadow) or []

    def commit(self, pages, tokens, now: float, tenant: str, num_tokens: int | None, hashes) -> int:
        """Register the full pages among the first num_tokens tokens; returns how many became cache entries."""
        self._clock(now)
        bs, index = self.block_size, self.index
        n_tokens = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        n_full = min(len(pages), n_tokens // bs)
        first = index.first_unhashed(pages, n_full)
        if first == n_full:
            return 0
        self.pool.check_owned(pages[first:n_full])      # validate before changing anything
        parent = index.page_hash[pages[first - 1]] if first else self._root(tenant)
        chain = self._chain(tokens, tenant, hashes) if hashes is not None else None
        if chain is not None and (len(chain) < first or (chain.hashes[first - 1] if first else chain.root) != parent):
            chain = None   # the chain does not reach (or disagrees with) the registered pages: not used
        if chain is None:
            new = chain_pages(parent, tokens, first, n_full, bs)
        else:              # pages an earlier lookup or commit hashed, then the rest (added to the chain)
            known = chain.hashes
            new = known[first:n_full]
            if len(known) < n_full:
                more = chain_pages(known[-1] if known else chain.root, tokens, len(known), n_full, bs)
                chain.add(more)
                new += more
        registered = index.register(pages[first:n_full], new)
        self.offload.forget(registered)   # an older copy being spilled is no longer canonical
        if chain is not None and chain.owner != self.serial and first == 0:
            chain.owner, chain.pages, chain.gens = self.serial, [], []
        if chain is not None and chain.owner == self.serial and len(chain.pages) == first:
            get, gen = index.pages.get, index.gen     # the chain remembers the new canonical pages
            for b, h in zip(pages[first:n_full], new):
                if get(h) != b:
                    break
                chain.pages.append(b)
                chain.gens.append(gen[b])
        return len(registered)

    def commit_many(self, items, now: float) -> int:
        """commit(pages, tokens, now, tenant, num_tokens, hashes) for each item in order; the total registered."""
        try:
            items = list(items)
        except TypeError:
            raise TypeError("items: expected a sequence of (block_ids, token_ids, tenant, num_tokens, "
                            "hashes)") from None
        for item in items:               # the items' shape first: a malformed one changes nothing
            if item.__class__ is not tuple or len(item) != 5:
                raise TypeError("items: expected (block_ids, token_ids, tenant, num_tokens, hashes) tuples")
            if item[1].__class__ is not list and item[1].__class__ is not tuple:
                raise TypeError("token_ids: expected a list or tuple of ints")
        return sum([self.commit(pages, tokens, now, tenant, num_tokens, hashes)
                    for pages, tokens, tenant, num_tokens, hashes in items])

    def free(self, pages, now: float) -> None:
        """Drop a reference on each page; registered pages reaching ref 0 stay cached (tail pages older)."""
        self._clock(now)
        released = self.pool.release(pages)
        if released:
            cached, unregistered = self.index.split_canonical(released)
            self.pool.park(cached, now)
            if unregistered:
                self._give_back(unregistered, lost=True)

    def touch(self, pages, now: float) -> None:
        self._clock(now)
        self.pool.touch(pages, now)

    def poll(self, now: float) -> None:
        self._clock(now)
        if self.offload.spilling:
            self._retire_spills()
        self.offload.poll()

    # ---- internals -------------------------------------------------------------------------------------
    def _clock(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"now: {now} is earlier than a previous call's {self._now} (time must not decrease)")
        self._now = now

    def _root(self, tenant: str) -> int:
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = salt_root(pool_salt(self.model_id, tenant))
        return root

    def _chain(self, tokens, tenant: str, hashes) -> PageHashes:
        """The caller's chain (checked to belong to tokens, tenant and this pool) or a fresh one."""
        if hashes is None:
            return PageHashes(tokens, self.block_size, self._root(tenant))
        if not isinstance(hashes, PageHashes):
            raise TypeError(f"hashes: expected the manager's hash_chain(), got {type(hashes).__name__}")
        if hashes.tokens is not tokens or hashes.block_size != self.block_size or hashes.root != self._root(tenant):
            raise ValueError("hashes: built for another token list, tenant, model or block size "
                             "(use KVCacheManager.hash_chain(token_ids, tenant=...))")
        hashes.extend_to(0)   # O(1) check: drops known pages the token list no longer holds (append-only)
        return hashes

    def _known_pages(self, chain: PageHashes, hashes, num_pages: int) -> int:
        """How many leading pages of a kept chain this core resolved before and are still canonical (a
        generation check per page, no lookup: a long shadow job's prefix is not looked up per chunk)."""
        if hashes is None or chain.owner != self.serial:
            return 0
        return self.index.valid_prefix(chain.pages, chain.gens, num_pages)

    def _make_room(self, n: int, shadow: bool, now: float) -> bool:
        """Evict what an allocation of n pages needs; whether it can proceed now."""
        pool, spilling = self.pool, self.offload.num_spilling
        if spilling and n <= len(pool.free) + spilling:
            return False  # async: wait for the spills in flight (poll) instead of evicting more
        victims = pool.evict_for(n, shadow, now, spilling)
        if victims is None:
            return False
        self._evict(victims)
        return pool.fits(n, shadow)   # async spills: the victims are reusable only after their copies (poll)

    def _evict(self, victims: list[int]) -> None:
        """Evict cached ref-0 pages (already out of their LRU, in eviction order): admit them to the host
        tier, copying the ones it does not hold yet in one batch, or drop them without a host tier."""
        pool, offload, st = self.pool, self.offload, self.stats
        hashes = self.index.remove(victims)
        shadows = [pool.shadow[b] for b in victims] if pool.num_shadow else None
        n_shadow = sum(shadows) if shadows else 0
        st.shadow_evictions += n_shadow
        st.normal_evictions += len(victims) - n_shadow
        if not offload.enabled:
            self._give_back(victims, lost=True)
            return
        slots, copy, dropped = self.host.put_many(hashes, shadows)
        if dropped:  # host full: its LRU entries were dropped (content lost unless still held somewhere)
            st.host_drops += len(dropped)
            get = self.index.pages.get
            st.shadow_blocks_wasted += sum(1 for h, shadow in dropped
                                           if shadow and get(h) is None and not offload.holds(h))
        if False not in copy:
            to_host, to_slots, to_hashes, free_now = victims, slots, hashes, ()   # the common case
        else:
            to_host, to_slots, to_hashes, free_now = [], [], [], []
            for b, slot, h, must_copy in zip(victims, slots, hashes, copy):
                if must_copy:
                    to_host.append(b)
                    to_slots.append(slot)
                    to_hashes.append(h)
                else:  # held by the host already, or stored and dropped again (waste counted above)
                    free_now.append(b)
        if free_now:
            if offload.side_copy:
                page_hash = self.index.page_hash
                free_now = [b for b in free_now if not offload.park(b, page_hash[b])]
            self._give_back(free_now, lost=False)
        if not to_host:
            return
        st.spills += len(to_host)
        st.spill_bytes += len(to_host) * self.page_bytes
        if offload.spill(to_host, to_slots, to_hashes):
            self._give_back(to_host, lost=False)   # synchronous (CPU) or bookkeeping-only: free now

    def _give_back(self, pages, *, lost: bool) -> None:
        """Ref-0 pages, in no index entry, to the free list. lost: their content is gone from every tier."""
        self.index.clear(pages)
        n_shadow = self.pool.give_back(pages)
        if lost:  # shadow content gone without a routed hit
            self.stats.shadow_blocks_wasted += n_shadow

    def _retire_spills(self) -> None:
        host = self.host
        for b, h in self.offload.retire():
            self._give_back((b,), lost=host.peek(h) < 0)

    def _cancel_spill(self, page_hash: int) -> int:
        """A page hit while its spill is in flight: back into the index with one reference."""
        b = self.offload.cancel(page_hash)
        self.index.restore(page_hash, b)
        self.pool.revive(b)
        self.stats.spills_cancelled += 1
        return b

    def _unallocate(self, pages: list[int]) -> None:
        """Undo allocate() of pages that were never used (not counted as allocated or wasted)."""
        pool, st = self.pool, self.stats
        for b in pages:
            pool.ref[b] = 0
            st.shadow_blocks_allocated -= pool.shadow[b]
        st.allocated_blocks -= len(pages)
        self._give_back(pages, lost=False)

    def _reload_into(self, blocks: list, now: float, shadow: bool, promote: bool):
        """Replace the host entries ((hash, slot) tuples) in `blocks` by fresh pages of the caller's class
        holding their bytes, truncating `blocks` at the first host entry that cannot be reloaded now (device
        pages after it are released). Returns (ready event or None, set of reloaded pages, how many were
        shadow entries)."""
        host, st = self.host, self.stats
        new = self.allocate_up_to(sum(1 for item in blocks if type(item) is tuple), now, shadow)
        cut, used = len(blocks), 0
        for pos, item in enumerate(blocks):  # the allocation may have spilled pages and dropped host entries
            if type(item) is tuple:
                if used == len(new) or host.peek(item[0]) != item[1]:
                    cut = pos
                    break
                used += 1
        if used < len(new):
            self._unallocate(new[used:])
        tail = [b for b in blocks[cut:] if type(b) is int]
        del blocks[cut:]
        if tail:
            self.free(tail, now)
        slots, dsts, shadow_entries = [], [], 0
        fresh = iter(new)
        for pos, item in enumerate(blocks):
            if type(item) is tuple:
                h, slot = item
                b = blocks[pos] = next(fresh)
                self.index.set(b, h)
                if host.is_shadow(slot):
                    shadow_entries += 1
                    if promote:  # §3.3: a routed hit makes the content normal
                        host.set_class(slot, False)
                        st.shadow_blocks_promoted += 1
                slots.append(slot)
                dsts.append(b)
        st.reloads += len(dsts)
        st.reload_bytes += len(dsts) * self.page_bytes
        return self.offload.reload(slots, dsts), set(dsts), shadow_entries


def _hashes(chain: PageHashes, first: int, end: int):
    """Hashes of pages first..end-1 of the chain's tokens: known ones, then the rest hashed in doubling
    batches (a lookup that stops at its first page hashes one page) and kept in the chain."""
    known = chain.hashes
    if first < len(known):
        yield from known[first:end]
    pos, batch = max(first, len(known)), 1
    while pos < end:
        stop = min(end, pos + batch)
        new = chain_pages(known[-1] if known else chain.root, chain.tokens, pos, stop, chain.block_size)
        chain.add(new)
        yield from new
        pos, batch = stop, 2 * batch
