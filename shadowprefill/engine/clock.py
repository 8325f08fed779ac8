"""Clocks: the engine reads time only through one of these (DESIGN.md §5).

`WallClock` is real time (a real forward takes as long as it takes; `advance` does nothing).
`VirtualClock` is simulated time: it moves only when told, so the same engine code runs inside the
discrete-event simulator, where executing an iteration advances the clock by the latency model's
duration.
"""
from __future__ import annotations

import math
import time


class Clock:
    """Interface: `now()` in seconds; `advance(seconds)` after an iteration of known duration."""

    def now(self) -> float:
        raise NotImplementedError

    def advance(self, seconds: float) -> None:
        raise NotImplementedError


class WallClock(Clock):
    """Monotonic wall time in seconds since construction."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def advance(self, seconds: float) -> None:
        """Wall time advances by itself; an executed iteration already took its time."""


class VirtualClock(Clock):
    """Simulated time; starts at `start` and moves only through `advance` / `advance_to`."""

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start must be finite, got {start}")
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0 or not math.isfinite(seconds):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        """Jump to time `t` (not before now)."""
        if not t >= self._now or not math.isfinite(t):
            raise ValueError(f"t must be finite and >= now ({self._now}), got {t}")
        self._now = float(t)
