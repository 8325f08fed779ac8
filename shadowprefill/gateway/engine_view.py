"""Engine truth in the registry: one instance's KV-cache events applied to the gateway's `CacheRegistry`.

An `EngineView` follows one engine (a site of the registry, named by its URL). `BlockStored` events carry
each block's tokens and its parent's hash, so the view rebuilds the whole token prefix that ends at the
stored blocks and registers it for (tenant, model) at the site: the registry hashes it in its own
tenant-seeded namespace, so an entry never matches another tenant's lookup. The tenant is the request's
`cache_salt` found in the first block's `extra_keys` (the manager sends `cache_salt=<tenant>`); blocks
without a salt belong to `default_tenant`. `BlockRemoved` truncates the registry entries at the site
before the removed block; `AllBlocksCleared` (or a dead engine, `clear()`) drops the site. Events arrive
in sequence order (`apply(seq, batch)`): a gap is reported to the caller (who replays), an old or
malformed event is logged and skipped; seq 0 after a higher one is a restarted publisher (the view is
cleared). Thread-safe: the subscriber thread applies, the manager looks up.
"""
from __future__ import annotations

import logging
import threading
import time

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from .registry import CacheLayout, CacheRegistry, Location

log = logging.getLogger(__name__)
LIVE_VERSION = "live"          # engine-reported caches are one version per model


def registry_tenant(tenant: str) -> str:
    """The registry's name of a manager tenant ("" — no API keys configured — is "(default)")."""
    return tenant or "(default)"


class EngineView:
    """The registry's picture of one engine's prefix cache, fed by its KV-cache events."""

    def __init__(self, registry: CacheRegistry, lock: threading.RLock, site: str, model: str,
                 default_tenant: str = "", salt_tenants: dict[str, str] | None = None) -> None:
        self.registry, self.lock, self.site, self.model = registry, lock, site, model
        self.default_tenant = default_tenant
        self.salt_tenants = salt_tenants  # cache_salt -> tenant (None: the salt is the tenant's name)
        self.block_size: int | None = None
        self.last_seq: int | None = None
        self.last_event_at: float | None = None     # monotonic time of the last batch applied
        self.expect_by: float | None = None         # an event is due by then (a call computed new blocks)
        self.stats = {"batches": 0, "stored": 0, "removed": 0, "cleared": 0, "skipped": 0, "gaps": 0,
                      "replayed": 0, "lag_s": 0.0}
        self._blocks: dict = {}                     # engine hash -> (parent hash, tokens, tenant, registry hash)

    # ------------------------------------------------------------------------------------------ events
    def apply(self, seq: int, batch: EventBatch, replayed: bool = False) -> str:
        """Apply one batch: 'applied', 'gap' (seq skipped ahead: replay from last_seq + 1 first, then apply
        again) or 'old' (already applied or out of order: skipped)."""
        if seq == 0 and self.last_seq is not None and self.last_seq > 0:       # the publisher restarted
            log.warning("kv events from %s: sequence restarted at 0; forgetting what it held", self.site)
            self.clear()
            self.last_seq = None
        if self.last_seq is not None and seq <= self.last_seq:
            self.stats["skipped"] += 1
            log.warning("kv events from %s: out-of-order seq %d after %d, skipped", self.site, seq, self.last_seq)
            return "old"
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq != expected and not replayed:
            self.stats["gaps"] += 1
            return "gap"
        with self.lock:
            for ev in batch.events:
                try:
                    self._apply_event(ev)
                except (ValueError, TypeError, KeyError) as exc:
                    self.stats["skipped"] += 1
                    log.warning("kv events from %s: event %r skipped: %s", self.site, type(ev).__name__, exc)
        self.last_seq = seq
        self.last_event_at = time.monotonic()
        self.expect_by = None
        self.stats["batches"] += 1
        self.stats["replayed"] += int(replayed)
        self.stats["lag_s"] = max(0.0, time.time() - batch.ts)
        return "applied"

    def skip_to(self, seq: int) -> None:
        """Give up on a gap that cannot be replayed: continue from `seq` (what was missed stays unknown)."""
        self.last_seq = seq - 1

    def _tenant_of(self, ev: BlockStored) -> str:
        if ev.parent_block_hash is not None and ev.parent_block_hash in self._blocks:
            return self._blocks[ev.parent_block_hash][2]
        keys = ev.extra_keys[0] if ev.extra_keys else None
        salts = [k for k in (keys or ()) if isinstance(k, str)]
        if not salts:
            return self.default_tenant
        salt = salts[-1]                         # vLLM puts the cache_salt after the LoRA name
        return salt if self.salt_tenants is None else self.salt_tenants.get(salt, "\x00unknown-salt")

    def _prefix_tokens(self, parent) -> list[int] | None:
        chain = []
        while parent is not None:
            node = self._blocks.get(parent)
            if node is None:
                return None                      # the parent's store was never seen (evicted or missed)
            chain.append(node[1])
            parent = node[0]
        return [t for block in reversed(chain) for t in block]

    def _apply_event(self, ev) -> None:
        if isinstance(ev, BlockStored):
            self.block_size = ev.block_size
            tenant = self._tenant_of(ev)
            prefix = self._prefix_tokens(ev.parent_block_hash)
            if prefix is None:
                raise ValueError("parent block unknown")
            tokens = prefix + list(ev.token_ids)
            layout = CacheLayout(ev.block_size, 1, 1, 1)      # page metadata only: engines own the bytes
            entry = self.registry.insert(registry_tenant(tenant), self.model, LIVE_VERSION, tokens, layout,
                                         Location(self.site), provenance="engine")
            first = len(prefix) // ev.block_size
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                bs = ev.block_size
                reg_hash = entry.block_hashes[first + i] if entry is not None else None
                self._blocks[h] = (parent, tuple(ev.token_ids[i * bs:(i + 1) * bs]), tenant, reg_hash)
                parent = h
            self.stats["stored"] += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                node = self._blocks.pop(h, None)
                if node is None:
                    continue
                self.stats["removed"] += 1
                for e in (self.registry.at_site(node[3], self.site) if node[3] is not None else ()):
                    self.registry.truncate(e.entry_id, e.block_hashes.index(node[3]))   # keep what precedes it
        elif isinstance(ev, AllBlocksCleared):
            self.clear()
            self.stats["cleared"] += 1
        else:
            raise TypeError(f"unknown event {ev!r}")

    def clear(self) -> int:
        """Forget everything the engine held (cache reset, dead engine). Returns registry entries dropped."""
        with self.lock:
            self._blocks.clear()
            return self.registry.drop_site(self.site)

    # ------------------------------------------------------------------------------------------ queries
    def expect_event(self, within_s: float = 2.0, since: float | None = None) -> None:
        """A call (started at monotonic `since`) computed new full blocks here: its BlockStored is due
        within `within_s` seconds, unless a batch already came after the call started."""
        if since is not None and self.last_event_at is not None and self.last_event_at >= since:
            return
        if self.expect_by is None:
            self.expect_by = time.monotonic() + within_s

    def stale(self, now: float | None = None) -> bool:
        """The stream went silent: an event was due (`expect_event`) and did not come in time."""
        now = time.monotonic() if now is None else now
        return self.expect_by is not None and now > self.expect_by

    def cached_tokens(self, tenant: str, tokens) -> int:
        """Whole-block prefix of `tokens` the engine holds for `tenant` (registry lookup at this site)."""
        with self.lock:
            hits = self.registry.hits(registry_tenant(tenant), self.model, tokens)
        return max((h.matched_tokens for h in hits if h.entry.location.site == self.site), default=0)

    def num_blocks(self) -> int:
        return len(self._blocks)
