"""Gateway cache registry: metadata of every KV cache object the gateway can reuse (paper 003, §II-B, §IV-E).

An entry records model id + version, the token span as a hash chain over full pages, the page layout,
the location (site and tier), the owning tenant, created / last-used times and provenance. Lookups find the
longest usable prefix for (tenant, model, tokens). Isolation is structural: the hash chain is seeded with
(tenant, model, version), the index is only searched through the caller's tenant, and revoking a tenant
deletes its entries before returning. A model version change deletes the model's older entries (§IV-E
"consistency maintenance during model updates"). Lifecycle: TTL on last use, byte capacity per site, LRU
eviction. The registry also keeps decayed request rates per (entry, requesting site), which
``gateway.placement`` turns into replication and migration decisions.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from shadowprefill.kv.page_hash import page_hashes

from .sites import TIERS
from .transfer import CODECS, layout_bytes_per_token

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class CacheLayout:
    """Page shape, element dtype and wire/storage compression of a cache object (DESIGN.md §3 page)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    compression: str | None = None  # None (raw pages) or a codec of transfer.CODECS, e.g. "fp8"

    def __post_init__(self):
        for f in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.compression is not None and self.compression not in CODECS:
            raise ValueError(f"compression must be None or one of {sorted(CODECS)}, got {self.compression!r}")

    @property
    def bytes_per_token(self) -> float:
        return layout_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                      _DTYPE_BYTES[self.dtype], self.block_size, self.compression)


@dataclass(frozen=True)
class Location:
    site: str
    tier: str = "device"  # device | host | remote

    def __post_init__(self):
        if not isinstance(self.site, str) or not self.site:
            raise ValueError(f"site must be a non-empty str, got {self.site!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")


@dataclass(frozen=True)
class CacheEntry:
    entry_id: int
    tenant: str
    model_id: str
    model_version: str
    block_hashes: tuple[int, ...]   # kv.page_hashes of the span, salted with (tenant, model, version)
    layout: CacheLayout
    location: Location
    created_at: float
    last_used_at: float
    provenance: str  # "prefill", "shadow", "edge_prefill", "transfer", "map:<mapper>", "replica:<id>", ...
    size_bytes: float

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.layout.block_size


@dataclass(frozen=True)
class PrefixHit:
    """An entry and how many leading tokens of the request it covers (whole pages only)."""

    entry: CacheEntry
    matched_tokens: int


def _namespace(tenant: str, model_id: str, version: str) -> str:
    """The page-hash salt of (tenant, model, version): the chain of kv.page_hashes seeded with it."""
    return f"{tenant}\x00{model_id}\x00{version}"


class CacheRegistry:
    """Metadata index of gateway-managed KV caches. ``now`` arguments default to ``time.monotonic()``."""

    def __init__(self, ttl_s: float = math.inf, capacity_bytes: dict[str, float] | None = None,
                 rate_window_s: float = 300.0):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if not rate_window_s > 0:
            raise ValueError(f"rate_window_s must be > 0, got {rate_window_s!r}")
        for site, cap in (capacity_bytes or {}).items():
            if cap < 0:
                raise ValueError(f"capacity_bytes[{site!r}] must be >= 0, got {cap!r}")
        self.ttl_s = ttl_s
        self.capacity_bytes = dict(capacity_bytes or {})
        self.rate_window_s = rate_window_s
        self._entries: dict[int, CacheEntry] = {}
        self._index: dict[int, set[int]] = {}  # chain hash -> ids of entries containing it
        self._versions: dict[str, str] = {}  # model id -> current version
        self._revoked: set[str] = set()
        self._used: dict[str, float] = {}  # site -> bytes
        self._access: dict[int, dict[str, tuple[float, float]]] = {}  # entry -> site -> (count, t)
        self._ids = itertools.count(1)
        self._block_sizes: dict[int, int] = {}  # page size -> entries using it (lookups hash once per size)

    # ---- models and tenants -----------------------------------------------------------------------
    def model_version(self, model_id: str) -> str | None:
        return self._versions.get(model_id)

    def set_model_version(self, model_id: str, version: str) -> int:
        """Make ``version`` current for ``model_id``; entries of any other version are deleted. Returns count."""
        _check_str("model_id", model_id), _check_str("version", version)
        self._versions[model_id] = version
        stale = [e.entry_id for e in self._entries.values()
                 if e.model_id == model_id and e.model_version != version]
        for eid in stale:
            self.remove(eid)
        return len(stale)

    def revoke_tenant(self, tenant: str) -> int:
        """Delete every entry of ``tenant`` now and refuse its inserts until reinstated. Returns count."""
        _check_str("tenant", tenant)
        self._revoked.add(tenant)
        ids = [e.entry_id for e in self._entries.values() if e.tenant == tenant]
        for eid in ids:
            self.remove(eid)
        return len(ids)

    def reinstate_tenant(self, tenant: str) -> None:
        self._revoked.discard(tenant)

    # ---- insert / remove --------------------------------------------------------------------------
    def insert(self, tenant: str, model_id: str, model_version: str, tokens: Sequence[int],
               layout: CacheLayout, location: Location, provenance: str = "prefill",
               now: float | None = None) -> CacheEntry | None:
        """Register the KV of ``tokens`` (full pages only) and return the entry.

        An existing entry at the same location whose span covers the new one is refreshed instead; one
        the new span extends is replaced. Returns None when the object exceeds the site's capacity.
        """
        now = _now(now)
        _check_str("tenant", tenant), _check_str("model_id", model_id)
        _check_str("model_version", model_version), _check_str("provenance", provenance)
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout must be CacheLayout, got {type(layout).__name__}")
        if not isinstance(location, Location):
            raise TypeError(f"location must be Location, got {type(location).__name__}")
        if tenant in self._revoked:
            raise ValueError(f"tenant {tenant!r} is revoked")
        current = self._versions.setdefault(model_id, model_version)
        if model_version != current:
            raise ValueError(f"model_version {model_version!r} of {model_id!r} is stale (current {current!r})")
        chain = tuple(page_hashes(tokens, layout.block_size, _namespace(tenant, model_id, current)))
        if not chain:
            raise ValueError(f"tokens: fewer than one full page of {layout.block_size} tokens")
        size = len(chain) * layout.block_size * layout.bytes_per_token
        if size > self.capacity_bytes.get(location.site, math.inf):
            return None
        for eid in list(self._index.get(chain[-1], ())):  # same span or a longer one already here?
            old = self._entries[eid]
            if self._expired(old, now):
                self.remove(eid)
            elif old.location == location and old.layout == layout:
                return self.touch(eid, now, location.site)
        for eid in list(self._index.get(chain[0], ())):  # a shorter span here that the new one extends
            old = self._entries[eid]
            if (old.location == location and old.layout == layout
                    and chain[:len(old.block_hashes)] == old.block_hashes):
                self.remove(eid)
        self._make_room(location.site, size, now)
        entry = CacheEntry(next(self._ids), tenant, model_id, current, chain, layout, location, now, now,
                           provenance, size)
        self._entries[entry.entry_id] = entry
        self._count_bs(entry, 1)
        for h in chain:
            self._index.setdefault(h, set()).add(entry.entry_id)
        self._used[location.site] = self._used.get(location.site, 0.0) + size
        self.touch(entry.entry_id, now, location.site)  # producing it here counts as a use here
        return self._entries[entry.entry_id]

    def remove(self, entry_id: int) -> CacheEntry | None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        self._count_bs(entry, -1)
        for h in entry.block_hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._index[h]
        self._used[entry.location.site] -= entry.size_bytes
        self._access.pop(entry_id, None)
        return entry

    def expire(self, now: float | None = None) -> list[CacheEntry]:
        """Delete and return the entries unused for longer than the TTL."""
        now = _now(now)
        dead = [e.entry_id for e in self._entries.values() if self._expired(e, now)]
        return [self.remove(eid) for eid in dead]

    def _count_bs(self, entry: CacheEntry, delta: int) -> None:
        bs = entry.layout.block_size
        self._block_sizes[bs] = self._block_sizes.get(bs, 0) + delta
        if self._block_sizes[bs] <= 0:
            del self._block_sizes[bs]

    def _expired(self, entry: CacheEntry, now: float) -> bool:
        return now - entry.last_used_at > self.ttl_s

    def _make_room(self, site: str, size: float, now: float) -> None:
        """Drop the site's expired entries, then its least recently used ones, until ``size`` more fits."""
        cap = self.capacity_bytes.get(site, math.inf)
        if math.isinf(cap) and math.isinf(self.ttl_s):
            return  # nothing can expire and everything fits
        for e in [e for e in self._entries.values() if e.location.site == site and self._expired(e, now)]:
            self.remove(e.entry_id)
        lru = sorted((e for e in self._entries.values() if e.location.site == site),
                     key=lambda e: (e.last_used_at, e.entry_id))
        for victim in lru:  # LRU within the site
            if self._used.get(site, 0.0) + size <= cap:
                break
            self.remove(victim.entry_id)

    # ---- lookup -----------------------------------------------------------------------------------
    def hits(self, tenant: str, model_id: str, tokens: Sequence[int],
             now: float | None = None) -> list[PrefixHit]:
        """Every live entry of (tenant, current version of model) that covers a prefix of ``tokens``."""
        now = _now(now)
        _check_str("tenant", tenant), _check_str("model_id", model_id)
        version = self._versions.get(model_id)
        if version is None or tenant in self._revoked:
            return []
        ns = _namespace(tenant, model_id, version)
        block_sizes = self._block_sizes  # usually one or two sizes; a size nobody of this tenant uses misses
        matched: dict[int, int] = {}
        for bs in sorted(list(block_sizes)):
            for i, h in enumerate(page_hashes(tokens, bs, ns)):
                ids = self._index.get(h)
                if not ids:
                    break
                for eid in ids:
                    matched[eid] = (i + 1) * bs
        out = []
        for eid, n in matched.items():
            e = self._entries[eid]
            if e.tenant != tenant or e.model_id != model_id or e.model_version != version:
                continue  # defence in depth; the namespace already separates them
            if self._expired(e, now):
                self.remove(eid)
                continue
            out.append(PrefixHit(e, n))
        return sorted(out, key=lambda hit: (-hit.matched_tokens, hit.entry.entry_id))

    def lookup(self, tenant: str, model_id: str, tokens: Sequence[int], site: str | None = None,
               now: float | None = None, touch: bool = True) -> PrefixHit | None:
        """Longest usable prefix for (tenant, model, tokens); ties prefer ``site`` and faster tiers.

        With ``touch`` the entry's last use is refreshed and the access is counted for ``site``.
        """
        now = _now(now)
        hits = self.hits(tenant, model_id, tokens, now)
        if not hits:
            return None
        tier_rank = {t: i for i, t in enumerate(TIERS)}
        best = min(hits, key=lambda h: (-h.matched_tokens, h.entry.location.site != site,
                                        tier_rank[h.entry.location.tier], -h.entry.last_used_at))
        if touch:
            best = PrefixHit(self.touch(best.entry.entry_id, now, site), best.matched_tokens)
        return best

    def touch(self, entry_id: int, now: float | None = None, site: str | None = None) -> CacheEntry:
        """Mark an entry used at ``now`` (LRU, TTL) and count one access from ``site``."""
        now = _now(now)
        if entry_id not in self._entries:
            raise ValueError(f"entry_id {entry_id!r} not in the registry")
        if site is not None:
            per_site = self._access.setdefault(entry_id, {})
            count, t = per_site.get(site, (0.0, now))
            per_site[site] = (count * math.exp(-max(now - t, 0.0) / self.rate_window_s) + 1.0, max(now, t))
        return self._touch(entry_id, now)

    def _touch(self, entry_id: int, now: float) -> CacheEntry:
        e = replace(self._entries[entry_id], last_used_at=max(now, self._entries[entry_id].last_used_at))
        self._entries[entry_id] = e
        return e

    def at_site(self, chain_hash: int, site: str) -> list[CacheEntry]:
        """The entries at ``site`` whose span contains the registry page hash ``chain_hash``."""
        return [self._entries[i] for i in self._index.get(chain_hash, ()) if self._entries[i].location.site == site]

    def truncate(self, entry_id: int, num_blocks: int) -> CacheEntry | None:
        """Keep only the first ``num_blocks`` pages of an entry (an engine evicted the rest); 0 removes it."""
        entry = self._entries.get(entry_id)
        if entry is None or num_blocks >= len(entry.block_hashes):
            return entry
        self.remove(entry_id)
        if num_blocks <= 0:
            return None
        size = entry.size_bytes * num_blocks / len(entry.block_hashes)
        short = replace(entry, block_hashes=entry.block_hashes[:num_blocks], size_bytes=size)
        self._entries[entry_id] = short
        self._count_bs(short, 1)
        for h in short.block_hashes:
            self._index.setdefault(h, set()).add(entry_id)
        self._used[entry.location.site] = self._used.get(entry.location.site, 0.0) + size
        return short

    def drop_site(self, site: str) -> int:
        """Delete every entry at ``site`` (its engine cleared its cache or died). Returns count."""
        ids = [e.entry_id for e in self._entries.values() if e.location.site == site]
        for eid in ids:
            self.remove(eid)
        return len(ids)

    # ---- inspection -------------------------------------------------------------------------------
    def get(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def used_bytes(self, site: str) -> float:
        return self._used.get(site, 0.0)

    def __len__(self) -> int:
        return len(self._entries)

    def request_rate(self, entry_id: int, site: str, now: float | None = None) -> float:
        """Exponentially decayed requests/s for ``entry_id`` from ``site``."""
        now = _now(now)
        count, t = self._access.get(entry_id, {}).get(site, (0.0, now))
        return count * math.exp(-max(now - t, 0.0) / self.rate_window_s) / self.rate_window_s

    def request_rates(self, entry_id: int, now: float | None = None) -> dict[str, float]:
        """Decayed requests/s for ``entry_id`` per requesting site."""
        now = _now(now)
        return {s: self.request_rate(entry_id, s, now) for s in self._access.get(entry_id, {})}

    def holds_span(self, entry: CacheEntry, site: str) -> bool:
        """Whether ``site`` has an entry covering ``entry``'s whole span (same tenant, model, version)."""
        return any(self._entries[i].location.site == site for i in self._index.get(entry.block_hashes[-1], ()))

    def copy_to(self, entry_id: int, location: Location, provenance: str,
                now: float | None = None) -> CacheEntry | None:
        """Register a copy of an entry at another location (capacity / LRU apply); None if it cannot fit.

        The requests that ``location.site`` made for the original are carried over to the copy.
        """
        now = _now(now)
        src = self._entries.get(entry_id)
        if src is None:
            return None
        if src.size_bytes > self.capacity_bytes.get(location.site, math.inf):
            return None
        self._make_room(location.site, src.size_bytes, now)
        entry = replace(src, entry_id=next(self._ids), location=location, created_at=now, last_used_at=now,
                        provenance=provenance)
        self._entries[entry.entry_id] = entry
        self._count_bs(entry, 1)
        for h in entry.block_hashes:
            self._index.setdefault(h, set()).add(entry.entry_id)
        self._used[location.site] = self._used.get(location.site, 0.0) + entry.size_bytes
        carried = self._access.get(entry_id, {}).get(location.site)
        if carried is not None:
            self._access[entry.entry_id] = {location.site: carried}
        return entry


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else float(now)


def _check_str(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")

