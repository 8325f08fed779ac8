"""Execution sites and the links between them (paper 003, §II-C End–Edge–Cloud, Eq. 1 transfer time)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from shadowprefill.cluster.link import Link

SITE_KINDS = ("end", "edge", "cloud")
TIERS = ("device", "host", "remote")  # where a cache object lives at a site


@dataclass(frozen=True)
class Site:
    """One execution / storage site.

    ``compute_scale`` is the prefill speed relative to the cost estimator's reference hardware (an edge box
    at 0.25 prefills 4× slower); ``host_bandwidth_bytes_per_s`` is the host→device reload rate and
    ``remote_bandwidth_bytes_per_s`` the read rate of the site's remote (object-store) tier;
    ``prefill_price_per_token`` is the gateway-side compute price of prefill run here, in units of the
    target's uncached input price.
    """

    name: str
    kind: str = "cloud"
    compute_scale: float = 1.0
    host_bandwidth_bytes_per_s: float = 25e9  # PCIe Gen4 x16, order of magnitude
    remote_bandwidth_bytes_per_s: float = 8e9  # Table III cross-domain B
    prefill_price_per_token: float = 1.0  # parity with the provider's uncached input price

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        if self.kind not in SITE_KINDS:
            raise ValueError(f"kind must be one of {SITE_KINDS}, got {self.kind!r}")
        for f in ("compute_scale", "host_bandwidth_bytes_per_s", "remote_bandwidth_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if self.prefill_price_per_token < 0:
            raise ValueError(f"prefill_price_per_token must be >= 0, got {self.prefill_price_per_token!r}")


LOCAL_LINK = Link(bandwidth_bytes_per_s=math.inf)  # same site: no network hop


class Topology:
    """Sites and symmetric links. Pairs without an explicit link use ``default_link`` (or are unreachable)."""

    def __init__(self, sites: Iterable[Site], links: dict[tuple[str, str], Link] | None = None,
                 default_link: Link | None = Link(8e9, rtt_s=0.02)):
        self.sites: dict[str, Site] = {}
        for s in sites:
            if not isinstance(s, Site):
                raise TypeError(f"sites must hold Site objects, got {type(s).__name__}")
            if s.name in self.sites:
                raise ValueError(f"sites: duplicate site name {s.name!r}")
            self.sites[s.name] = s
        self._links: dict[frozenset, Link] = {}
        for (a, b), link in (links or {}).items():
            for n in (a, b):
                if n not in self.sites:
                    raise ValueError(f"links: unknown site {n!r}")
            if a == b:
                raise ValueError(f"links: self-link on {a!r}")
            self._links[frozenset((a, b))] = link
        self.default_link = default_link

    def site(self, name: str) -> Site:
        try:
            return self.sites[name]
        except KeyError:
            raise ValueError(f"site {name!r} unknown; known: {sorted(self.sites)}") from None

    def link(self, src: str, dst: str) -> Link | None:
        """The link from ``src`` to ``dst``; LOCAL_LINK for the same site, None if unreachable."""
        self.site(src), self.site(dst)
        if src == dst:
            return LOCAL_LINK
        return self._links.get(frozenset((src, dst)), self.default_link)

    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst`` (inf when unreachable, 0 on the same site)."""
        link = self.link(src, dst)
        if link is None:
            return math.inf
        if link is LOCAL_LINK:
            return 0.0
        return link.transfer_time_s(nbytes)

    @classmethod
    def single(cls, name: str = "local") -> "Topology":
        """A one-site topology (a single cluster)."""
        return cls([Site(name)])
