"""HostTier: the host-memory spill tier of the KV pool (paper §3.3 "Host-memory spill tier", DESIGN.md §5).

Pages evicted from the device (shadow and normal) are copied into pinned host memory of the same page shape
and reloaded over PCIe when a prefix lookup hits them. The tier is an LRU of cache entries keyed by chained
page hash (page_hash.py); when full it drops its least recently used page. Copies run on a side stream
(reload.py's SideStream: on CUDA after it waited for the compute stream): a spill ends with an event and the
pool hands a spilled device page out again only after it completed; reloads are layer-wise (reload.py), one
event per layer, and the forward waits on layer l's just before layer l's attention (never the host). On CPU
spills are synchronous (no event) and reloads run in order when waited on. Without a spec the tier is
bookkeeping-only (the simulator): same decisions, no bytes.

The entries (hash -> slot, LRU, classes) are a HostIndex (host_index.py); the pool's side (which pages are
being spilled, which copies are in flight) is in offload.py.
"""
from __future__ import annotations

import torch

from .host_index import make_host_index
from .reload import ReloadBatch, SideStream

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
        self._index = None                                  # HostIndex, made by the first pool attached
        self._side_streams: dict = {}

    # ---- bookkeeping: the entries (HostIndex) ---------------------------------------------------------
    def attach(self, backend: str):
        """The tier's index for a pool of `backend` ("python" or "native"): made on first use; every pool
        sharing a tier must use the same backend."""
        if self._index is None:
            self._index = make_host_index(self.num_pages, backend)
        elif self._index.backend != backend:
            raise ValueError(f"host_tier: already used by a {self._index.backend!r} pool, not {backend!r}")
        return self._index

    @property
    def index(self):
        """The HostIndex (made for the default backend if no pool attached the tier yet)."""
        if self._index is None:
            from .native import resolve_backend
            self.attach(resolve_backend(None))
        return self._index

    @property
    def num_used(self) -> int:
        return self.index.num_used

    @property
    def num_shadow(self) -> int:
        return self.index.num_shadow

    def __contains__(self, page_hash: int) -> bool:
        return self.index.peek(page_hash) >= 0

    def items(self) -> list:
        """(page hash, slot) of every entry, least recently used first."""
        return self.index.items()

    def peek(self, page_hash: int) -> int:
        """The slot holding the page, without touching the LRU; -1 if absent."""
        return self.index.peek(page_hash)

    def get(self, page_hash: int) -> int:
        """The slot holding the page, made most recently used; -1 if absent."""
        return self.index.get(page_hash)

    def put(self, page_hash: int, shadow: bool) -> tuple[int, bool, list]:
        """put_many for one page: (slot, whether its bytes must be copied there, dropped)."""
        slots, copy, dropped = self.index.put_many([page_hash], [shadow])
        return slots[0], copy[0], dropped

    def put_many(self, hashes: list, shadows: list | None) -> tuple[list[int], list[bool], list]:
        """See HostIndex.put_many."""
        return self.index.put_many(hashes, shadows)

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
        """Copy device pages block_ids into host slots, after every reload issued or open (stream order);
        returns a CUDA event (None if done synchronously)."""
        if self.cache is None or not block_ids:
            return None
        from shadowprefill.ops import copy_blocks  # ops sit below kv; imported on the first real copy
        side = self._side(kv_cache)
        side.before_copy(block_ids, slots)
        src_t = torch.tensor(block_ids, dtype=torch.int64)  # host ids: the copy reads them without a sync
        dst_t = torch.tensor(slots, dtype=torch.int64)
        if side.cuda is None:
            copy_blocks(kv_cache, self.cache, src_t, dst_t)
            return None
        side.cuda.wait_stream(torch.cuda.current_stream(kv_cache.device))  # the pages' last writers are done
        with torch.cuda.stream(side.cuda):
            copy_blocks(kv_cache, self.cache, src_t, dst_t)
            event = torch.cuda.Event()
            event.record(side.cuda)
        return event

    def reload(self, kv_cache: torch.Tensor, slots: list[int], block_ids: list[int]) -> ReloadBatch | None:
        """Copy host slots into device pages block_ids, layer-wise: added to kv_cache's open ReloadBatch, the
        event a reader waits on (None: bookkeeping only or nothing to copy)."""
        if self.cache is None or not slots:
            return None
        return self._side(kv_cache).reload(self.cache, kv_cache, slots, block_ids)

    def start_reloads(self, kv_cache: torch.Tensor) -> None:
        """Issue kv_cache's open reload batch (the reloads matched since the last call), if any."""
        if self.cache is not None:
            side = self._side_streams.get(kv_cache.device)
            batch = side.open.get(kv_cache.data_ptr()) if side is not None else None
            if batch is not None:
                side.issue(batch)

    def _side(self, kv_cache: torch.Tensor) -> SideStream:
        side = self._side_streams.get(kv_cache.device)
        if side is None:
            side = self._side_streams[kv_cache.device] = SideStream(kv_cache.device)
        return side
