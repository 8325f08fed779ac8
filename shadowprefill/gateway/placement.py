"""Background cache placement: replicate or migrate registry entries towards the sites that request them
(paper 003, §III-A: "KV cache management updates P_t(K) according to request frequency, locality, capacity,
freshness, authorization, and transfer cost"; §IV-E placement by access pattern).

Rule: for entry K stored at site a and requested from site s ≠ a at decayed rate r, a copy at s saves one
fetch a→s per request: over a horizon H the benefit is r·H·T(a→s) seconds of fetch latency, against the
one-off transfer T(a→s) of the copy. Propose it when benefit − cost ≥ ``min_saving_s`` and s can hold K
without evicting an entry requested more often. So hot entries behind slow links move; entries that are
cheap to fetch stay put and leave the capacity to others. If a itself no longer requests K (less than one
request per horizon), migrate instead of replicating. Isolation is untouched: a copy keeps its tenant,
model version and hash chain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .registry import CacheEntry, CacheRegistry, Location
from .sites import Topology


@dataclass(frozen=True)
class PlacementAction:
    kind: str  # "replicate" | "migrate"
    entry_id: int
    dst: Location
    benefit_s: float  # expected fetch time saved over the horizon
    cost_s: float  # one transfer
    reason: str


def _fits_without_hotter(reg: CacheRegistry, site: str, size: float, rate: float, now: float) -> bool:
    """Whether ``size`` bytes fit at ``site``, evicting (LRU order) only entries colder than ``rate``."""
    cap = reg.capacity_bytes.get(site, math.inf)
    if size > cap:
        return False
    free = cap - reg.used_bytes(site)
    for victim in sorted((e for e in reg.entries() if e.location.site == site),
                         key=lambda e: (e.last_used_at, e.entry_id)):
        if size <= free:
            break
        if sum(reg.request_rates(victim.entry_id, now).values()) >= rate:
            return False
        free += victim.size_bytes
    return size <= free


def plan_placement(reg: CacheRegistry, topology: Topology, now: float, horizon_s: float = 600.0,
                   min_saving_s: float = 1.0) -> list[PlacementAction]:
    """Replication / migration proposals for the live entries of ``reg`` (apply with :func:`apply_placement`)."""
    if not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    actions = []
    for e in reg.entries():
        if now - e.last_used_at > reg.ttl_s:
            continue
        rates = reg.request_rates(e.entry_id, now)
        for site, r in sorted(rates.items(), key=lambda kv: -kv[1]):
            if site == e.location.site or site not in topology.sites or reg.holds_span(e, site):
                continue
            t = topology.transfer_time_s(e.size_bytes, e.location.site, site)
            if not math.isfinite(t) or t <= 0:
                continue
            benefit = r * horizon_s * t
            if benefit - t < min_saving_s or not _fits_without_hotter(reg, site, e.size_bytes, r, now):
                continue
            kind = "migrate" if rates.get(e.location.site, 0.0) * horizon_s < 1.0 else "replicate"
            actions.append(PlacementAction(kind, e.entry_id, Location(site, "device"), benefit, t,
                                           f"{r * horizon_s:.1f} requests from {site} per {horizon_s:.0f}s"))
            if kind == "migrate":
                break
    return actions


def apply_placement(reg: CacheRegistry, action: PlacementAction, now: float) -> CacheEntry | None:
    """Carry out a proposal in the registry metadata (the bytes move through ``gateway.transfer``)."""
    copy = reg.copy_to(action.entry_id, action.dst, f"{action.kind}:{action.entry_id}", now)
    if copy is not None and action.kind == "migrate":
        reg.remove(action.entry_id)
    return copy
