"""Summary statistics of routed calls shared by the simulator's and the serving manager's metrics."""
from __future__ import annotations

import math
from typing import Iterable, Sequence


def time_to_first_token(arrival: float, first_token: float | None) -> float | None:
    """TTFT (§5.1): the first token's time minus the arrival; None while there is no first token. The one
    definition: `CallTimes`, the serving manager's `ServeCall` and the engine's `RequestOutput` use it."""
    return None if first_token is None else first_token - arrival


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


def call_metrics(calls: Sequence) -> dict:
    """The paper's §5 call metrics over completed routed calls, one definition for the simulator, the
    serving manager and the engine demo. A call has `latency`, `ttft` (None: not measured, left out of the
    TTFT means), `is_switch`, `session_id` (and optionally `tenant`), `prompt_tokens`, `cached_tokens`.

    Keys: `num_calls`, `num_switch_calls`, `num_sessions`, `switch_call_latency_{mean,p50,p99}_s`,
    `switch_call_ttft_mean_s`, `llm_call_latency_mean_s`, `llm_call_ttft_mean_s`,
    `same_model_call_latency_mean_s`, `llm_time_per_session_s` (a session's summed call latency),
    `switch_hit_rate`, `hit_rate`, `same_model_hit_rate` (token weighted, see `token_hit_rate`)."""
    switch = [c for c in calls if c.is_switch]
    per_session: dict = {}
    for c in calls:
        key = (getattr(c, "tenant", ""), c.session_id)
        per_session[key] = per_session.get(key, 0.0) + c.latency
    switch_latency = [c.latency for c in switch]
    return {
        "num_calls": len(calls),
        "num_switch_calls": len(switch),
        "num_sessions": len(per_session),
        "switch_call_latency_mean_s": mean(switch_latency),
        "switch_call_latency_p50_s": percentile(switch_latency, 50),
        "switch_call_latency_p99_s": percentile(switch_latency, 99),
        "switch_call_ttft_mean_s": mean([c.ttft for c in switch if c.ttft is not None]),
        "llm_call_latency_mean_s": mean([c.latency for c in calls]),
        "llm_call_ttft_mean_s": mean([c.ttft for c in calls if c.ttft is not None]),
        "same_model_call_latency_mean_s": mean([c.latency for c in calls if not c.is_switch]),
        "llm_time_per_session_s": mean(list(per_session.values())),
        "switch_hit_rate": token_hit_rate(switch),
        "hit_rate": token_hit_rate(calls),
        "same_model_hit_rate": token_hit_rate(c for c in calls if not c.is_switch),
    }


class CallTimes:
    """Derived timings of a call or request that has `arrival`, `first_token`, `finish` (seconds; None or
    NaN while unknown), `output_tokens`, `ttft_slo` and `tpot_slo`: one definition of latency, TTFT, TPOT and
    the SLO check (§5.1) for routed calls, normal requests and in-flight tickets."""

    __slots__ = ()

    @property
    def latency(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float | None:
        return time_to_first_token(self.arrival, self.first_token)

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def meets_slo(self) -> bool:
        if self.finish is None or self.first_token is None:
            return False
        return self.ttft <= self.ttft_slo and self.tpot <= self.tpot_slo
