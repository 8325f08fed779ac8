"""HostTier: the host-memory spill tier of the KV pool (paper §3.3 "Host-memory spill tier", DESIGN.md §5).

Pages evicted from the device (shadow and normal) are copied into pinned host memory of the same page shape
and reloaded over PCIe when a prefix lookup hits them. The tier is an LRU of cache entries keyed by chained
page hash (prefix_hash.py); when full it drops its least recently used page. Copies run on a side CUDA stream
after it waited for the compute stream, each batch ends with an event: the pool hands a spilled device page
out again only after its event completed, and the forward pass stream-waits on a reload's event (never the
host). On CPU caches the copies are synchronous and no event is returned. Without a spec the tier is
bookkeeping-only (the simulator): same decisions, no bytes.

An entry is a slot number; per-slot arrays hold its page key (for exact matches) and class.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

DEFAULT_CAPACITY_BYTES = 32 * 2**30  # paper §3.3 / issue 4: 32 GiB of host memory per GPU


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return value


class HostTier:
    """LRU store of KV pages in (pinned) host memory, with async spill/reload copies.

    HostTier(num_pages=None, *, capacity_bytes=None, spec=None, page_bytes=0, pin_memory=None)
      num_pages or capacity_bytes (default 32 GiB) sizes the tier; spec (a KVCacheSpec) gives the page shape
      and makes the tier hold real bytes; without spec, page_bytes is used for sizing/accounting only.
      pin_memory defaults to torch.cuda.is_available(). A failed allocation raises MemoryError naming the size.
    """

    def __init__(self, num_pages: int | None = None, *, capacity_bytes: int | None = None, spec=None,
                 page_bytes: int = 0, pin_memory: bool | None = None):
        page_bytes = spec.page_bytes if spec is not None else _check_count(page_bytes, "page_bytes")
        if num_pages is None:
            capacity = DEFAULT_CAPACITY_BYTES if capacity_bytes is None else _check_count(capacity_bytes,
                                                                                           "capacity_bytes")
            if page_bytes <= 0:
                raise ValueError("page_bytes: needed (> 0, or a spec) to size the tier from capacity_bytes")
            num_pages = capacity // page_bytes
        elif capacity_bytes is not None:
            raise ValueError("capacity_bytes: give num_pages or capacity_bytes, not both")
        self.num_pages = _check_count(num_pages, "num_pages")
        self.page_bytes = page_bytes
        self.spec = spec
        self.cache: torch.Tensor | None = None
        if spec is not None:
            pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
            try:
                self.cache = spec.allocate(num_pages, "cpu", pin_memory=pin)
            except (RuntimeError, MemoryError) as e:
                kind = "pinned host" if pin else "host"
                raise MemoryError(f"HostTier: could not allocate {num_pages * page_bytes} bytes of {kind} memory "
                                  f"({num_pages} pages of {page_bytes} bytes): {e}") from e
        self._lru: OrderedDict[int, int] = OrderedDict()    # page hash -> slot, least recently used first
        self.slot_key: list = [None] * num_pages            # slot -> page key (parent hash, tokens)
        self.slot_shadow: list[bool] = [False] * num_pages  # slot -> holds a shadow-class page
        self._free_slots = list(range(num_pages - 1, -1, -1))
        self._num_shadow = 0
        self._side_streams: dict = {}

    # ---- bookkeeping --------------------------------------------------------------------------------
    @property
    def has_tensors(self) -> bool:
        return self.cache is not None

    @property
    def num_used(self) -> int:
        return len(self._lru)

    @property
    def num_shadow(self) -> int:
        return self._num_shadow

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._lru

    def items(self):
        """(page hash, slot) of every entry, least recently used first."""
        return self._lru.items()

    def peek(self, page_hash: int, key: tuple) -> int:
        """The slot holding (hash, key), without touching the LRU; -1 if absent."""
        slot = self._lru.get(page_hash, -1)
        return slot if slot >= 0 and self.slot_key[slot] == key else -1

    def get(self, page_hash: int, key: tuple) -> int:
        """The slot holding (hash, key), made most recently used; -1 if absent."""
        slot = self._lru.get(page_hash, -1)
        if slot < 0 or self.slot_key[slot] != key:
            return -1
        self._lru.move_to_end(page_hash)
        return slot

    def set_class(self, slot: int, shadow: bool) -> None:
        if self.slot_shadow[slot] != shadow:
            self.slot_shadow[slot] = shadow
            self._num_shadow += 1 if shadow else -1

    def put(self, page_hash: int, key: tuple, shadow: bool) -> tuple[int, bool, list]:
        """put_many for one page: (slot, whether its bytes must be copied there, dropped)."""
        slots, copy, dropped = self.put_many([page_hash], [key], [shadow])
        return slots[0], copy[0], dropped

    def put_many(self, hashes: list, keys: list, shadows: list | None) -> tuple[list[int], list[bool], list]:
        """Admit evicted device pages (parallel lists; shadows None = all normal), in eviction order. A page
        already held (same key) becomes the most recently used and takes the given class; another is stored in
        a free slot or in the slot of the least recently used entry, which is dropped (an entry stored earlier
        in the same call included, when more pages than num_pages are given).
        Returns (slot per page, -1 if the tier has no pages; whether the page's bytes must be copied into its
        slot: stored by this call and still held at its end; [(dropped hash, was shadow)] in drop order)."""
        n = len(hashes)
        copy = [False] * n
        if not self.num_pages:
            return [-1] * n, copy, []
        lru, free, slot_key, slot_shadow = self._lru, self._free_slots, self.slot_key, self.slot_shadow
        slots, dropped, stored, num_shadow = [-1] * n, [], {}, self._num_shadow  # stored: slot -> page index
        lru_get, move_to_end = lru.get, lru.move_to_end
        if shadows is None:
            shadows = itertools.repeat(False)
        for i, page_hash, key, shadow in zip(range(n), hashes, keys, shadows):
            slot = lru_get(page_hash)
            if slot is not None and slot_key[slot] == key:
                move_to_end(page_hash)
            else:
                if slot is not None:           # same hash, other key (a collision): replaced
                    del lru[page_hash]
                elif free:
                    slot = free.pop()
                else:
                    dropped_hash, slot = lru.popitem(last=False)
                    dropped.append((dropped_hash, slot_shadow[slot]))
                    earlier = stored.pop(slot, None)
                    if earlier is not None:    # stored by this call, dropped again: nothing to copy
                        copy[earlier] = False
                lru[page_hash] = slot
                slot_key[slot] = key
                copy[i] = True
                stored[slot] = i
            if slot_shadow[slot] != shadow:    # free slots hold False
                num_shadow += 1 if shadow else -1
                slot_shadow[slot] = shadow
            slots[i] = slot
        self._num_shadow = num_shadow
        return slots, copy, dropped

    def discard(self, page_hash: int) -> None:
        """Forget a page (its slot becomes free)."""
        slot = self._lru.pop(page_hash, -1)
        if slot >= 0:
            self._num_shadow -= self.slot_shadow[slot]
            self.slot_shadow[slot], self.slot_key[slot] = False, None
            self._free_slots.append(slot)

    # ---- copies -------------------------------------------------------------------------------------
    def check_compatible(self, kv_cache: torch.Tensor | None, page_bytes: int) -> None:
        """Raise ValueError unless this tier can hold pages of kv_cache (or, bookkeeping-only, of page_bytes)."""
        if (kv_cache is None) != (self.cache is None):
            raise ValueError("host_tier: the pool and its host tier must both hold tensors or both be "
                             "bookkeeping-only (kv_cache=None and HostTier without spec)")
        if kv_cache is not None:
            if tuple(kv_cache.shape[1:]) != tuple(self.cache.shape[1:]) or kv_cache.dtype != self.cache.dtype:
                raise ValueError(f"host_tier: page shape {tuple(self.cache.shape[1:])} {self.cache.dtype} differs "
                                 f"from kv_cache pages {tuple(kv_cache.shape[1:])} {kv_cache.dtype}")
        elif self.page_bytes and page_bytes and self.page_bytes != page_bytes:
            raise ValueError(f"host_tier: page_bytes {self.page_bytes} differs from the pool's {page_bytes}")

    def spill(self, kv_cache: torch.Tensor, block_ids: list[int], slots: list[int]):
        """Copy device pages block_ids into host slots; returns a CUDA event (None if done synchronously)."""
        return self._copy(kv_cache, self.cache, block_ids, slots, kv_cache)

    def reload(self, kv_cache: torch.Tensor, slots: list[int], block_ids: list[int]):
        """Copy host slots into device pages block_ids; returns a CUDA event (None if done synchronously)."""
        return self._copy(self.cache, kv_cache, slots, block_ids, kv_cache)

    def _copy(self, src, dst, src_ids, dst_ids, kv_cache):
        if self.cache is None or not src_ids:
            return None
        from shadowprefill.ops import copy_blocks  # ops sit below kv; imported on the first real copy
        src_t = torch.tensor(src_ids, dtype=torch.int64)  # host ids: the copy reads them without a sync
        dst_t = torch.tensor(dst_ids, dtype=torch.int64)
        if not kv_cache.is_cuda:
            copy_blocks(src, dst, src_t, dst_t)
            return None
        device = kv_cache.device
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the pages' last writers/readers are done
        with torch.cuda.stream(side):
            copy_blocks(src, dst, src_t, dst_t)
            event = torch.cuda.Event()
            event.record(side)
        return event
