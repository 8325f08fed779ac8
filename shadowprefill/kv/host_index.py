"""HostIndex: the entries of a HostTier (paper §3.3 "Host-memory spill tier"): page hash -> slot, LRU, the
class of each slot. When full, admitting a page drops the least recently used entry. The reference
implementation; the native KV core works on its C++ twin (csrc/kv/host_index.h).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict


def make_host_index(num_pages: int, backend: str):
    """A HostIndex of `num_pages` slots for a KV core of `backend`: "python" (this class) or "native" (the
    C++ one, shadowprefill._C_kv.HostIndex: same methods, same decisions)."""
    if backend == "python":
        return HostIndex(num_pages)
    if backend == "native":
        from .native import native_module
        return native_module().HostIndex(num_pages)
    raise ValueError(f"backend: expected 'python' or 'native', got {backend!r}")


class HostIndex:
    """LRU of host entries: page hash -> slot; a class (normal / shadow) per slot."""

    backend = "python"

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._lru: OrderedDict[int, int] = OrderedDict()    # page hash -> slot, least recently used first
        self._slot_shadow: list[bool] = [False] * num_pages  # slot -> holds a shadow-class page
        self._free_slots = list(range(num_pages - 1, -1, -1))
        self.num_shadow = 0

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def items(self) -> list:
        """(page hash, slot) of every entry, least recently used first."""
        return list(self._lru.items())

    def peek(self, page_hash: int) -> int:
        """The slot holding the page, without touching the LRU; -1 if absent."""
        return self._lru.get(page_hash, -1)

    def get(self, page_hash: int) -> int:
        """The slot holding the page, made most recently used; -1 if absent."""
        slot = self._lru.get(page_hash, -1)
        if slot >= 0:
            self._lru.move_to_end(page_hash)
        return slot

    def is_shadow(self, slot: int) -> bool:
        return self._slot_shadow[slot]

    def set_class(self, slot: int, shadow: bool) -> None:
        if self._slot_shadow[slot] != shadow:
            self._slot_shadow[slot] = shadow
            self.num_shadow += 1 if shadow else -1

    def put_many(self, hashes: list, shadows: list | None) -> tuple[list[int], list[bool], list]:
        """Admit evicted device pages (parallel lists; shadows None = all normal), in eviction order. A page
        already held becomes the most recently used and takes the given class; another is stored in a free
        slot or in the slot of the least recently used entry, which is dropped (an entry stored earlier in
        the same call included, when more pages than num_pages are given).
        Returns (slot per page, -1 if the tier has no pages; whether the page's bytes must be copied into its
        slot: stored by this call and still held at its end; [(dropped hash, was shadow)] in drop order)."""
        n = len(hashes)
        copy = [False] * n
        if not self.num_pages:
            return [-1] * n, copy, []
        lru, free, slot_shadow = self._lru, self._free_slots, self._slot_shadow
        slots, dropped, stored, num_shadow = [-1] * n, [], {}, self.num_shadow  # stored: slot -> page index
        lru_get, move_to_end = lru.get, lru.move_to_end
        if shadows is None:
            shadows = itertools.repeat(False)
        for i, page_hash, shadow in zip(range(n), hashes, shadows):
            slot = lru_get(page_hash)
            if slot is not None:
                move_to_end(page_hash)
            else:
                if free:
                    slot = free.pop()
                else:
                    dropped_hash, slot = lru.popitem(last=False)
                    dropped.append((dropped_hash, slot_shadow[slot]))
                    earlier = stored.pop(slot, None)
                    if earlier is not None:    # stored by this call, dropped again: nothing to copy
                        copy[earlier] = False
                lru[page_hash] = slot
                copy[i] = True
                stored[slot] = i
            if slot_shadow[slot] != shadow:    # free slots hold False
                num_shadow += 1 if shadow else -1
                slot_shadow[slot] = shadow
            slots[i] = slot
        self.num_shadow = num_shadow
        return slots, copy, dropped
