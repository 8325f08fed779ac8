"""Summary statistics of routed calls shared by the simulator's and the serving manager's metrics."""
from __future__ import annotations

import math
from typing import Iterable, Sequence


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for no values."""
    return float(sum(values) / len(values)) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile with linear interpolation between closest ranks, None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def token_hit_rate(calls: Iterable) -> float | None:
    """Token-weighted prefix hit rate: cached prompt tokens / prompt tokens over calls that report a cached
    count (`cached_tokens` None = unknown, left out); None when no prompt tokens were counted."""
    prompt = cached = 0
    for c in calls:
        if c.prompt_tokens and c.cached_tokens is not None:
            prompt += c.prompt_tokens
            cached += c.cached_tokens
    return cached / prompt if prompt else None
