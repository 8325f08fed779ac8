"""HostOffload: the pool's side of the host tier (paper §3.3 "Host-memory spill tier"): evicted cached pages
are admitted to the HostTier and copied out (spill); host hits are copied into fresh device pages (reload).

CUDA copies run on a side stream and end with an event (HostTier); this part tracks them:
  spilling    evicted pages whose device->host copy may still run: not reusable until the event completed
              (`retire`), FIFO (one side stream completes in order); the indexed ones can be hit again
              meanwhile (`cancel`: the eviction is undone and the page served from the device);
  side copies pages a side-stream copy may still read or write (a cancelled spill, a reload): they are
              neither freed early nor read before the forward pass waited on `last_event`.
On CPU and bookkeeping-only caches every copy is synchronous: no event, nothing tracked.
Reference implementation; the native core (`csrc/kv/`) makes the same decisions.
"""
from __future__ import annotations

from collections import OrderedDict


class HostOffload:
    """Spills in flight, the hash -> spilling page index, side-stream copies, of one pool and its host tier's
    HostIndex. `copy(to_host, src_ids, dst_ids) -> event or None` moves the bytes (None: bookkeeping only)."""

    def __init__(self, host, copy=None):
        self.host, self.copy = host, copy
        self.spilling: OrderedDict[int, tuple] = OrderedDict()   # page -> (event, hash or None), FIFO
        self.spill_index: dict[int, int] = {}                    # hash -> spilling page (cancellable)
        self.side_copy: OrderedDict[int, object] = OrderedDict()  # page -> event of a copy maybe in flight
        self.last_event = None                                    # newest event recorded on the side stream

    @property
    def enabled(self) -> bool:
        return self.host is not None and self.host.num_pages > 0

    @property
    def num_spilling(self) -> int:
        return len(self.spilling)

    def holds(self, page_hash: int) -> bool:
        """Whether the content of a hash is still somewhere: being spilled or in the host tier."""
        return page_hash in self.spill_index or (self.host is not None and self.host.peek(page_hash) >= 0)

    # ---- spill -----------------------------------------------------------------------------------------
    def spill(self, pages: list[int], slots: list[int], hashes: list[int]) -> bool:
        """Copy evicted pages into their host slots. True if done (synchronous: the pages are free now);
        False if the copy runs on the side stream (the pages stay out until `retire` returns them)."""
        event = self.copy(True, pages, slots) if self.copy is not None else None
        if event is None:
            return True
        self.last_event = event
        spill_index = self.spill_index
        for b, h in zip(pages, hashes):
            self.spilling[b] = (event, h)
            spill_index[h] = b
        return False

    def park(self, b: int, page_hash: int) -> bool:
        """A page evicted without a copy (the host holds its content): True if a side copy still reads it
        (it stays out, unindexed, until that copy completed), False if it can be freed now."""
        event = self.side_copy.pop(b, None) if self.side_copy else None
        if event is not None and not event.query():
            self.spilling[b] = (event, page_hash)
            return True
        return False

    def retire(self) -> list[tuple[int, int]]:
        """(page, hash) of the spills whose copies completed, in order; they leave the spill index."""
        done, spilling, spill_index = [], self.spilling, self.spill_index
        while spilling:
            b, (event, h) = next(iter(spilling.items()))
            if not event.query():
                break   # one side stream: copies complete in order
            del spilling[b]
            if spill_index.get(h) == b:
                del spill_index[h]
            done.append((b, h))
        return done

    def cancel(self, page_hash: int) -> int:
        """A page hit while its spill is in flight: out of the spill (the copy may still read it)."""
        b = self.spill_index.pop(page_hash)
        self.note_side_copy((b,), self.spilling.pop(b)[0], newest=False)   # an older event: last_event stays
        return b

    def forget(self, hashes) -> None:
        """Hashes that got a new canonical device page: an older copy being spilled is not canonical."""
        if self.spill_index:
            pop = self.spill_index.pop
            for h in hashes:
                pop(h, None)

    # ---- reload and side copies ------------------------------------------------------------------------
    def reload(self, slots: list[int], pages: list[int]):
        """Copy host slots into fresh device pages; returns the event the forward waits on (None: done)."""
        event = self.copy(False, slots, pages) if self.copy is not None else None
        if event is not None:
            self.note_side_copy(pages, event)
        return event

    def note_side_copy(self, pages, event, newest: bool = True) -> None:
        side_copy = self.side_copy
        for b in pages:
            side_copy[b] = event
            side_copy.move_to_end(b)
        if newest:
            self.last_event = event

    def pending_event(self, pages, skip=()):
        """The event a reader of `pages` (but those in `skip`) must wait on: a side copy into or out of one
        may still run."""
        side_copy = self.side_copy
        if side_copy and any(b in side_copy and b not in skip for b in pages):
            return self.last_event
        return None

    def poll(self) -> None:
        """Forget side copies that completed."""
        side_copy = self.side_copy
        while side_copy:
            b, event = next(iter(side_copy.items()))
            if not event.query():
                break
            del side_copy[b]
