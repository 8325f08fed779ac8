"""A KV transfer path, one concept for both papers: `Link` is the path (bandwidth, round-trip time,
queueing delay, egress price; paper 003 Eq. 1 transfer time), `LinkQueue` is a FIFO of transfers over one
link in simulated time (a P/D decode instance's inbound link, paper 000 §3.5).

    link = Link(50e9)                       # 50 GB/s, no RTT
    q = LinkQueue(link)
    done = q.reserve(now=1.0, nbytes=2e9)   # 1.04: starts when the link is free, takes transfer_time_s
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A network path: bandwidth, round-trip time, queueing delay, egress price per byte."""

    bandwidth_bytes_per_s: float
    rtt_s: float = 0.0
    queue_s: float = 0.0
    price_per_byte: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        for f in ("rtt_s", "queue_s", "price_per_byte"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)!r}")

    def transfer_time_s(self, nbytes: float) -> float:
        """Paper 003 Eq. 1: S/B + T_RTT + T_queue (copy/restore are overlapped with the transfer, §VI-B)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        return nbytes / self.bandwidth_bytes_per_s + self.rtt_s + self.queue_s


class LinkQueue:
    """Transfers over one `Link` in FIFO order: each starts when the previous one is done."""

    __slots__ = ("link", "free_at", "bytes_moved", "busy_s")

    def __init__(self, link: Link) -> None:
        if not isinstance(link, Link):
            raise TypeError(f"link must be a Link, got {type(link).__name__}")
        self.link = link
        self.free_at = 0.0          # when the last queued transfer completes
        self.bytes_moved = 0
        self.busy_s = 0.0

    def reserve(self, now: float, nbytes: float) -> float:
        """Queue a transfer of `nbytes` at time `now`; returns its completion time."""
        duration = self.link.transfer_time_s(nbytes)
        self.free_at = max(now, self.free_at) + duration
        self.bytes_moved += int(nbytes)
        self.busy_s += duration
        return self.free_at
