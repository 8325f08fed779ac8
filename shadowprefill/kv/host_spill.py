"""The BlockPool's side of the host tier (paper §3.3): evict cached pages into it (spill) and track the
asynchronous copies between the two (reloads are started by prefix_lookup.py). A base class of BlockPool,
split off to keep files short: it works on the pool's state (block_pool.py documents it), not on its own.

CUDA (async) rules: a spilled device page stays in `_spilling` (not reusable) until its copy's event completed
(`poll`); a page hit while its spill is in flight is taken back (eviction cancelled); `_side_copy` remembers
pages a side-stream copy may still be reading or writing, so they are neither freed early nor read before
the forward pass waited on `_last_side_event`. On CPU and bookkeeping-only pools every copy is synchronous.
"""
from __future__ import annotations


class HostSpill:
    def poll(self, now: float) -> None:
        """Retire completed async copies: spilled device pages become free (CUDA; a no-op otherwise)."""
        self._clock(now)
        if self._spilling:
            self._retire_spills()
        side_copy = self._side_copy
        while side_copy:
            b, event = next(iter(side_copy.items()))
            if not event.query():
                break
            del side_copy[b]

    def _evict(self, victims: list[int]) -> None:
        """Evict cached ref-0 pages (already removed from their LRU, in eviction order): admit them to the
        host tier, copying the ones it does not hold yet in one batch, or drop them without a host tier."""
        cache, flags, st = self._cache, self._shadow, self._stats
        hashes = list(map(self._hash.__getitem__, victims))
        for h in hashes:
            del cache[h]
        shadows = list(map(flags.__getitem__, victims)) if self._num_shadow else None
        n_shadow = sum(shadows) if shadows else 0
        st.shadow_evictions += n_shadow
        st.normal_evictions += len(victims) - n_shadow
        host = self.host_tier
        if host is None or host.num_pages == 0:
            self._free_blocks(victims, lost=True)
            return
        slots, copy, dropped = host.put_many(hashes, list(map(self._key.__getitem__, victims)), shadows)
        if dropped:  # host full: its LRU entries were dropped (content lost unless still held somewhere)
            st.host_drops += len(dropped)
            spill_index = self._spill_index
            st.shadow_blocks_wasted += sum(1 for h, shadow in dropped if shadow and h not in cache
                                           and h not in spill_index and h not in host)
        if False not in copy:
            to_host, to_slots, free_now = victims, slots, ()   # the common case: copy every page
        else:
            to_host, to_slots, free_now = [], [], []
            for b, slot, must_copy in zip(victims, slots, copy):
                if must_copy:
                    to_host.append(b)
                    to_slots.append(slot)
                else:  # held by the host already, or stored and dropped again (waste counted above)
                    free_now.append(b)
        if free_now:
            if self._side_copy:
                for b in free_now:
                    self._free_after_side_copy(b)
            else:
                self._free_blocks(free_now, lost=False)
        if not to_host:
            return
        st.spills += len(to_host)
        st.spill_bytes += len(to_host) * self.page_bytes
        event = host.spill(self.kv_cache, to_host, to_slots) if self.kv_cache is not None else None
        if event is None:  # synchronous (CPU) or bookkeeping-only: the pages are free now
            self._free_blocks(to_host, lost=False)
            return
        self._last_side_event = event
        for b in to_host:  # handed out again only after the copy completed (poll)
            self._spilling[b] = event
            self._spill_index[self._hash[b]] = b

    def _free_after_side_copy(self, b: int) -> None:
        event = self._side_copy.pop(b, None) if self._side_copy else None
        if event is not None and not event.query():
            self._spilling[b] = event  # not indexed: the host copy serves hits; reusable after the copy
            return
        self._free_blocks((b,), lost=False)

    def _retire_spills(self) -> None:
        spilling, host = self._spilling, self.host_tier
        while spilling:
            b, event = next(iter(spilling.items()))
            if not event.query():
                break  # one side stream: copies complete in order
            del spilling[b]
            h = self._hash[b]
            if self._spill_index.get(h) == b:
                del self._spill_index[h]
            self._free_blocks((b,), lost=host.peek(h, self._key[b]) < 0)

    def _cancel_spill(self, page_hash: int) -> int:
        """A page hit while its spill is in flight: back into the cache with one reference."""
        b = self._spill_index.pop(page_hash)
        self._note_side_copy((b,), self._spilling.pop(b))  # the device->host copy may still be reading it
        self._cache[page_hash] = b
        self._ref[b] = 1
        self._stats.spills_cancelled += 1
        return b

    def _note_side_copy(self, block_ids, event) -> None:
        for b in block_ids:
            self._side_copy[b] = event
            self._side_copy.move_to_end(b)
        self._last_side_event = event
