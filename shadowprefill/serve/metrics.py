"""Per-call records of the manager and their per-policy summaries.

The summary keys are the simulator's (`shadowprefill.sim.metrics.summarize`) where the quantity exists in
a live run: `num_calls`, `num_switch_calls`, `num_sessions`, `switch_call_latency_{mean,p50,p99}_s`,
`switch_call_ttft_mean_s`, `llm_call_latency_mean_s`, `llm_call_ttft_mean_s`,
`same_model_call_latency_mean_s`, `llm_time_per_session_s`, `switch_hit_rate`, `hit_rate`,
`same_model_hit_rate` (hit rate = cached prompt tokens / prompt tokens, token weighted, with cached tokens
from the server's `usage.prompt_tokens_details.cached_tokens`). Added here: `switch_call_ttft_p50_s` and
`num_failed_calls`. TTFT is measured at the manager (first streamed chunk carrying output), so only
streamed calls have one; the TTFT means average over those.

The policy of a call is "harvest" when its session received shadows (request-level Harvest, paper
appendix D.1) and "no-shadow" otherwise, the simulator's policy names.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from shadowprefill.cluster.call_stats import CallTimes, call_metrics, percentile


@dataclass
class ServeCall(CallTimes):
    """One call forwarded by the manager. Times are `time.monotonic()` seconds at the manager; `latency` and
    `ttft` are `CallTimes`' (one definition for every call record)."""

    session_id: str
    call_index: int
    tenant: str
    model: str
    instance: str
    is_switch: bool
    policy: str
    arrival: float
    first_token: float | None
    finish: float
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    stream: bool
    status: int = 200
    error: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["latency_s"], d["ttft_s"] = self.latency, self.ttft
        return d


def summarize(calls: Sequence[ServeCall]) -> dict:
    """The simulator's §5 call metrics over successful calls (see module docstring)."""
    ok = [c for c in calls if c.status == 200 and c.error is None]
    out = call_metrics(ok)
    out["num_failed_calls"] = len(calls) - len(ok)
    out["switch_call_ttft_p50_s"] = percentile([c.ttft for c in ok if c.is_switch and c.ttft is not None], 50)
    return out


def summarize_by_policy(calls: Sequence[ServeCall]) -> dict[str, dict]:
    """`summarize` per policy ("harvest", "no-shadow")."""
    policies = sorted({c.policy for c in calls})
    return {p: summarize([c for c in calls if c.policy == p]) for p in policies}
