"""Prefix lookup across the device and host tiers (paper §3.3, DESIGN.md §5): find the longest cached prefix
of full pages of a token sequence, take references on its device pages, reload its host pages into fresh
device pages (host->device on the side stream; the caller's forward pass stream-waits on the returned event),
promote shadow pages a routed request hits. A base class of BlockPool, split off to keep files short: it works
on the pool's state (block_pool.py documents it), not on its own.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from .prefix_hash import PageHashes, as_token_sequence


@dataclass
class PrefixMatch:
    """Result of BlockPool.acquire_prefix: the caller holds one reference on each page in block_ids."""
    block_ids: list[int]        # pages covering the matched prefix, in order
    num_tokens: int             # len(block_ids) * block_size
    device_tokens: int          # matched on the device (incl. cancelled spills)
    host_tokens: int            # reloaded from the host tier into fresh pages
    shadow_tokens: int          # matched pages that were shadow-class pages
    ready_event: object | None = None  # CUDA event the forward must stream-wait on before reading the pages


def _walk(chain: PageHashes, num_pages: int, first: int = 0):
    """An iterator over (hash, key) of pages first..num_pages-1 of the chain's tokens; unknown pages are
    hashed lazily (a lookup that misses early hashes no further) and remembered in the chain."""
    if len(chain.hashes) >= num_pages:
        return zip(chain.hashes[first:num_pages], chain.keys[first:num_pages])
    return _walk_lazily(chain, num_pages, first)


def _walk_lazily(chain: PageHashes, num_pages: int, first: int):
    hashes, keys = chain.hashes, chain.keys
    known = len(hashes)
    yield from zip(hashes[first:], keys[first:])
    tokens, bs = chain.tokens, chain.block_size
    parent = hashes[-1] if known else chain.root
    for start in range(max(known, first) * bs, num_pages * bs, bs):
        key = (parent, tuple(tokens[start:start + bs]))
        parent = hash(key)
        hashes.append(parent)
        keys.append(key)
        yield parent, key


def _walk_from(chain: PageHashes, first_page: tuple, first: int, num_pages: int):
    """(hash, key) of pages first..num_pages-1, page `first` being given, the rest hashed lazily (not kept)."""
    parent, key = first_page
    yield parent, key
    tokens, bs = chain.tokens, chain.block_size
    for start in range((first + 1) * bs, num_pages * bs, bs):
        key = (parent, tuple(tokens[start:start + bs]))
        parent = hash(key)
        yield parent, key


class PrefixLookup:
    def peek_prefix(self, token_ids, *, tenant: str = "", max_tokens: int | None = None,
                    hashes: PageHashes | None = None) -> tuple[int, int]:
        """(device_tokens, host_tokens) of the longest cached prefix, without taking references, touching
        LRUs or moving bytes: how much of a shadow job's sequence the instance already holds.
        hashes: token_ids' PageHashes (BlockPool.page_hash_chain), to skip re-hashing known pages."""
        tokens = as_token_sequence(token_ids)
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        chain = self._chain(tokens, tenant, hashes)
        device, host, tier = 0, 0, self.host_tier
        cache_get, spill_get, page_key = self._cache.get, self._spill_index.get, self._key
        for h, key in _walk(chain, limit // bs):
            b = cache_get(h)
            if b is None:
                b = spill_get(h)
            if b is not None and page_key[b] == key:
                device += bs
            elif tier is not None and tier.peek(h, key) >= 0:
                host += bs
            else:
                break
        return device, host

    def acquire_prefix(self, token_ids, *, now: float, tenant: str = "", shadow: bool = False,
                       promote: bool = False, max_tokens: int | None = None,
                       hashes: PageHashes | None = None) -> PrefixMatch:
        """Take the longest cached prefix of full pages of token_ids (at most max_tokens tokens).

        Each page is found on the device (a page whose spill is in flight is taken back, the eviction
        cancelled) or in the host tier; host pages are reloaded into fresh pages of the caller's class,
        stopping at the first one that cannot be allocated now. One reference is taken on every returned
        page. promote=True (a routed request) turns hit shadow pages into normal ones (paper §3.3).
        hashes: token_ids' PageHashes (BlockPool.page_hash_chain): pages hashed by an earlier call are not
        hashed again, and the ones hashed now are kept for the next call and for commit."""
        self._clock(now)
        tokens = as_token_sequence(token_ids)
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        chain = self._chain(tokens, tenant, hashes)
        cache_get, keys, ref, lru, flags = self._cache.get, self._key, self._ref, self._lru, self._shadow
        host, spill_index = self.host_tier, self._spill_index
        num_pages, num_host = limit // bs, 0
        # prefix order; host entries are added as tuples. A fresh chain (no hashes=) is not filled: it dies here
        blocks, miss = self._device_run(chain, num_pages, remember=hashes is not None)
        if miss is None:   # pages after the device run: known to the chain or hashed lazily
            rest = _walk(chain, num_pages, len(blocks))
        else:
            rest = _walk_from(chain, miss, len(blocks), num_pages)
        for h, key in rest:
            b = cache_get(h)
            if b is not None and keys[b] == key:
                if ref[b] == 0:
                    del lru[flags[b]][b]
                ref[b] += 1      # taken now, so reload allocations below cannot evict it
                blocks.append(b)
            elif spill_index and spill_index.get(h) is not None and keys[spill_index[h]] == key:
                blocks.append(self._cancel_spill(h))
            elif host is not None and (slot := host.get(h, key)) >= 0:
                blocks.append((h, key, slot))
                num_host += 1
            else:
                break
        ready, reloaded, shadow_pages = None, (), 0
        if num_host:
            ready, reloaded, shadow_pages = self._reload_into(blocks, now, shadow, promote)
        side_copy = self._side_copy
        for b in (blocks if self._num_shadow or side_copy else ()):   # (else: no shadow page, no copy)
            if reloaded and b in reloaded:
                continue
            if flags[b]:
                shadow_pages += 1
                if promote:  # §3.3: a routed request's hit turns the shadow page into a normal one
                    flags[b] = False
                    self._num_shadow -= 1
                    self._stats.shadow_blocks_promoted += 1
            if side_copy and ready is None and b in side_copy:
                ready = self._last_side_event  # a copy into / out of b may still run on the side stream
        device_pages = len(blocks) - len(reloaded)
        st, matched = self._stats, len(blocks) * bs
        st.lookups += 1
        st.lookup_tokens += limit
        st.device_hit_tokens += device_pages * bs
        st.host_hit_tokens += matched - device_pages * bs
        st.miss_tokens += limit - matched
        st.shadow_hit_tokens += shadow_pages * bs
        return PrefixMatch(blocks, matched, device_pages * bs, matched - device_pages * bs, shadow_pages * bs,
                           ready)

    def _device_run(self, chain: PageHashes, num_pages: int, remember: bool) -> tuple[list[int], tuple | None]:
        """The leading device hits among the first num_pages pages of chain, with a reference taken on each.
        Known hashes are looked up in bulk (C-level map/index); then pages are hashed one by one (remembered
        in the chain if `remember`), up to and including the first one that is not a device hit. Returns
        (the pages, (hash, key) of that first other page when it was hashed here and not remembered)."""
        hashes, keys = chain.hashes, chain.keys
        run = list(map(self._cache.get, hashes[:num_pages]))
        if None in run:
            del run[run.index(None):]
        same_key = list(map(operator.eq, map(self._key.__getitem__, run), keys))
        if False in same_key:   # a hash collision: stop where the keys differ
            del run[same_key.index(False):]
        ref, lru, flags = self._ref, self._lru, self._shadow
        for b in run:
            if not ref[b]:
                del lru[flags[b]][b]
            ref[b] += 1      # taken now, so reload allocations cannot evict it
        if len(run) < len(hashes) or len(run) >= num_pages:
            return run, None
        cache_get, page_key, tokens, bs = self._cache.get, self._key, chain.tokens, chain.block_size
        parent = hashes[-1] if hashes else chain.root
        for start in range(len(hashes) * bs, num_pages * bs, bs):
            key = (parent, tuple(tokens[start:start + bs]))
            parent = hash(key)
            if remember:
                hashes.append(parent)
                keys.append(key)
            b = cache_get(parent)
            if b is None or page_key[b] != key:
                return run, None if remember else (parent, key)
            if not ref[b]:
                del lru[flags[b]][b]
            ref[b] += 1
            run.append(b)
        return run, None

    def _reload_into(self, blocks: list, now: float, shadow: bool, promote: bool):
        """Replace the host entries (tuples) in `blocks` by fresh pages of the caller's class holding their
        bytes, truncating `blocks` at the first host page that cannot be reloaded now (device pages after it
        are released). Returns (ready event or None, set of reloaded pages, how many were shadow entries)."""
        host, st = self.host_tier, self._stats
        wanted = sum(1 for item in blocks if type(item) is tuple)
        new = self.allocate(self.available_blocks(now=now, shadow=shadow, limit=wanted), now=now, shadow=shadow)
        new = new or []
        cut, used = len(blocks), 0
        for pos, item in enumerate(blocks):  # the allocation may have spilled pages and dropped host entries
            if type(item) is tuple:
                h, key, slot = item
                if used == len(new) or host.peek(h, key) != slot:
                    cut = pos
                    break
                used += 1
        if used < len(new):
            self._unallocate(new[used:])
        tail = [b for b in blocks[cut:] if type(b) is int]
        del blocks[cut:]
        if tail:
            self.release(tail, now=now)
        slots, dsts, shadow_entries = [], [], 0
        fresh = iter(new)
        for pos, item in enumerate(blocks):
            if type(item) is tuple:
                h, key, slot = item
                b = blocks[pos] = next(fresh)
                self._hash[b], self._key[b] = h, key
                if h not in self._cache:
                    self._cache[h] = b
                if host.slot_shadow[slot]:
                    shadow_entries += 1
                    if promote:  # §3.3: a routed hit makes the content normal
                        host.set_class(slot, False)
                        st.shadow_blocks_promoted += 1
                slots.append(slot)
                dsts.append(b)
        st.reloads += len(dsts)
        st.reload_bytes += len(dsts) * self.page_bytes
        event = host.reload(self.kv_cache, slots, dsts) if self.kv_cache is not None else None
        if event is not None:
            self._note_side_copy(dsts, event)
        return event, set(dsts), shadow_entries
