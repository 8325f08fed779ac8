"""Layer-wise reload (issue 15): host-tier pages come back one layer at a time on the side stream, with one
event per layer, so the forward waits on layer l's copy just before layer l's attention and the copies of
later layers overlap the compute of earlier ones. Layer l of a block-major page is one contiguous byte range
(DESIGN.md §3), so each layer's copy is one `copy_blocks(..., layers=(l, l + 1))` over the pages.

The reloads of one KV cache accumulate in one open `ReloadBatch` until it is issued (the engine calls
`KVCacheManager.start_reloads()` once an iteration's matches are made; a wait, a query or any later copy
issues it too), layer-major: layer 0 of every page, event 0, layer 1, event 1, ... Batches run in the order
they were issued (one side stream): the reload-ahead of the next iteration's admissions is a batch of its
own, behind the current iteration's, and a spill enqueued later runs after both.

On CPU the same path runs in order, on demand: the side stream is a FIFO of issued batches whose layer
copies run when a forward waits on them (`wait(l)` copies layers up to l, earlier batches first), or all of
them when anyone queries a batch or a spill is enqueued that writes a slot it reads (or reads a page it
writes). So on CPU too, a forward that read layer l without waiting on it would read pages whose bytes have
not arrived.

`record_reloads()` is the debug recorder of issues, layer copies and waits (tests).
"""
from __future__ import annotations

import contextlib
import itertools
from collections import deque

import torch

_IDS = itertools.count(1)
_log: list | None = None


@contextlib.contextmanager
def record_reloads():
    """Debug recorder: yields a list that receives ("issue", batch id, None), ("copy", batch id, layer) (CPU:
    the copy ran; CUDA: it was enqueued) and ("wait", batch id, layer) for every reload while open."""
    global _log
    before, _log = _log, []
    try:
        yield _log
    finally:
        _log = before


def _note(kind: str, batch: "ReloadBatch", layer) -> None:
    if _log is not None:
        _log.append((kind, batch.id, layer))


class ReloadBatch:
    """Host slots being reloaded into pages of one device KV cache, layer by layer: one event per layer.
    `wait(layer)` makes the compute stream (CUDA) or the host (CPU) wait until that layer of every page has
    arrived (None: all layers); `query()` tells whether all have (CPU: it copies the rest first)."""

    def __init__(self, stream: "SideStream", src: torch.Tensor, dst: torch.Tensor) -> None:
        self.stream, self.src, self.dst = stream, src, dst
        self.slots: list[int] = []
        self.pages: list[int] = []
        self.id = next(_IDS)
        self.num_layers = dst.shape[1]
        self.issued = False
        self.events: list | None = None   # CUDA: one torch.cuda.Event per layer, once issued
        self.copied = 0                   # CPU: layers 0..copied-1 have arrived
        self._ids = None

    def wait(self, layer: int | None = None) -> None:
        layer = self.num_layers - 1 if layer is None else layer
        self.stream.issue(self)
        if self.events is not None:
            torch.cuda.current_stream(self.dst.device).wait_event(self.events[layer])
        else:
            self.stream.run(self, layer + 1)
        _note("wait", self, layer)

    def query(self) -> bool:
        self.stream.issue(self)
        if self.events is not None:
            return self.events[-1].query()
        self.stream.run(self, self.num_layers)
        return True

    def _copy_layer(self, layer: int) -> None:
        from shadowprefill.ops import copy_blocks  # ops sit below kv; imported on the first real copy
        if self._ids is None:                      # host ids: the copies read them without a sync
            self._ids = (torch.tensor(self.slots, dtype=torch.int64), torch.tensor(self.pages, dtype=torch.int64))
        copy_blocks(self.src, self.dst, *self._ids, layers=(layer, layer + 1))
        _note("copy", self, layer)

    def __repr__(self) -> str:
        return f"ReloadBatch(#{self.id}, {len(self.pages)} pages, issued={self.issued})"


class SideStream:
    """The side stream of one device, shared by the host tier's spills and reloads: on CUDA a
    torch.cuda.Stream that first waits for the compute stream; on CPU a FIFO of issued reload batches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.open: dict[int, ReloadBatch] = {}     # device cache data_ptr -> its batch not issued yet
        self.pending: deque[ReloadBatch] = deque()  # CPU: issued batches not fully copied, in order

    def reload(self, src: torch.Tensor, dst: torch.Tensor, slots: list[int], pages: list[int]) -> ReloadBatch:
        """Add host slots -> device pages to dst's open batch (the event a reader waits on)."""
        batch = self.open.get(dst.data_ptr())
        if batch is None:
            batch = self.open[dst.data_ptr()] = ReloadBatch(self, src, dst)
        batch.slots += slots
        batch.pages += pages
        return batch

    def issue(self, batch: ReloadBatch) -> None:
        """Enqueue a batch's copies, layer-major, one event per layer (CPU: queue it; layers run on demand)."""
        if batch.issued:
            return
        batch.issued = True
        if self.open.get(batch.dst.data_ptr()) is batch:
            del self.open[batch.dst.data_ptr()]
        _note("issue", batch, None)
        if self.cuda is None:
            self.pending.append(batch)
            return
        self.cuda.wait_stream(torch.cuda.current_stream(self.device))  # the pages' last readers are done
        events = []
        with torch.cuda.stream(self.cuda):
            for layer in range(batch.num_layers):   # layer l of every page, then its event
                batch._copy_layer(layer)
                events.append(torch.cuda.Event())
                events[-1].record(self.cuda)
        batch.events = events

    def run(self, batch: ReloadBatch, layers: int) -> None:
        """CPU: copy the first `layers` layers of `batch`, after every batch issued before it (in order)."""
        pending = self.pending
        while pending and pending[0] is not batch and batch.copied < layers:
            self._finish(pending[0])
        while batch.copied < layers:
            batch._copy_layer(batch.copied)
            batch.copied += 1
        if batch.copied == batch.num_layers and pending and pending[0] is batch:
            pending.popleft()

    def _finish(self, batch: ReloadBatch) -> None:
        self.run(batch, batch.num_layers)

    def before_copy(self, reads: list[int], writes: list[int]) -> None:
        """Before a spill that reads device pages `reads` into host slots `writes`: every open batch is
        issued first (stream order); on CPU the pending batches up to the last one that writes a page the
        spill reads or reads a slot it writes run now (the others stay on demand)."""
        for batch in list(self.open.values()):
            self.issue(batch)
        if not self.pending:
            return
        reads, writes = set(reads), set(writes)
        last = None
        for batch in self.pending:
            if not (reads.isdisjoint(batch.pages) and writes.isdisjoint(batch.slots)):
                last = batch
        if last is not None:
            self._finish(last)
