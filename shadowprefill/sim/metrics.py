"""Per-call records of a simulated run and the paper's §5 metrics over them.

A run (`RunResult`) holds one `CallRecord` per routed LLM call that completed, one `NormalRecord` per
normal-traffic request that arrived in the measurement window, and the run's totals (energy, busy time,
tokens). `summarize` turns a run into the metrics of the paper's §5; `compare` does so for several policies
of the same seed over only the calls that completed under every policy (§5.1 "Measurement"), and adds each
policy's reduction relative to the baseline (No Shadow) and the share of Oracle+Host's gain it captures.

Definitions:
- latency = time to last token (finish − arrival), TTFT = first token − arrival;
- a switch call is a call whose model differs from the session's previous call's;
- hit rate = cached prompt tokens / prompt tokens, token weighted (device or host cache);
- token cost = Σ uncached input × input price + cached input × 0.1 × input price + output × output price
  (catalog prices, USD per 1M tokens);
- normal SLO attainment = share of normal requests arriving in the window that meet both TTFT and TPOT
  SLOs (unfinished ones miss); TPOT = (finish − first token) / (output tokens − 1);
- energy per good request = energy of all instances over the window (busy and idle power of their GPUs)
  / requests arriving in the window that met both SLOs (normal and routed);
- prefill throughput = prefill tokens computed per second of window, with and without shadow tokens;
- shadow tokens = tokens computed by shadow work (Harvest chunks or Eager requests); unused = those never
  hit by a routed call (pages promoted by a routed hit count as used).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

from shadowprefill.cluster.call_stats import CallTimes, call_metrics

from shadowprefill.model.catalog import get_model


@dataclass
class CallRecord(CallTimes):
    """One routed LLM call of an agent session."""

    session_id: str
    call_index: int
    task: str
    model: str
    instance: str
    is_switch: bool
    arrival: float
    first_token: float
    finish: float
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    output_tokens: int
    ttft_slo: float = math.inf
    tpot_slo: float = math.inf
    measured: bool = True               # its session arrived inside the measurement window

    @property
    def key(self) -> tuple[str, int]:
        return (self.session_id, self.call_index)

    def cost(self) -> float:
        """USD of this call at its model's prices, cached input at 0.1x."""
        return get_model(self.model).token_cost(self.prompt_tokens, self.cached_tokens, self.output_tokens)


@dataclass
class NormalRecord(CallTimes):
    """One normal-traffic request; first_token / finish are None if it had not finished."""

    request_id: str
    model: str
    instance: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo: float
    tpot_slo: float
    first_token: float | None = None
    finish: float | None = None


@dataclass
class RunResult:
    """Everything one simulated run of one policy produced."""

    policy: str
    calls: list[CallRecord] = field(default_factory=list)
    normal: list[NormalRecord] = field(default_factory=list)
    window_s: float = 0.0               # measurement window length
    energy_j: float = 0.0               # all instances over the window
    busy_s: float = 0.0                 # summed over instances, within the window
    gpus: int = 0
    prefill_tokens: int = 0             # routed + normal prefill tokens computed within the window
    shadow_tokens: int = 0              # shadow tokens computed (whole run)
    shadow_tokens_used: int = 0         # ... of which a routed call hit (whole run)
    shadow_tokens_window: int = 0       # shadow tokens computed within the window
    sessions_measured: int = 0
    sessions_unfinished: int = 0
    end_time: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("calls")
        d.pop("normal")
        return d


def summarize(run: RunResult, keys: "set[tuple[str, int]] | None" = None) -> dict:
    """The §5 metrics of one run, over its measured calls (restricted to `keys` when given)."""
    calls = [c for c in run.calls if c.measured and (keys is None or c.key in keys)]
    window = run.window_s if run.window_s > 0 else math.nan
    normal_met = sum(1 for r in run.normal if r.meets_slo)
    routed_in_window = [c for c in run.calls if c.measured]
    good = normal_met + sum(1 for c in routed_in_window if c.meets_slo)
    tracked = run.extra.get("shadow_use_tracked", True)
    checked = run.extra.get("shadow_budget_iterations", 0)
    shadow_unused = max(0, run.shadow_tokens - run.shadow_tokens_used) if tracked else None
    return {
        **call_metrics(calls),
        "token_cost": float(sum(c.cost() for c in calls)),
        "normal_requests": len(run.normal),
        "normal_slo_attainment": normal_met / len(run.normal) if run.normal else None,
        "energy_j": run.energy_j,
        "energy_per_good_request_j": run.energy_j / good if good else None,
        "prefill_throughput_tok_s": (run.prefill_tokens + run.shadow_tokens_window) / window,
        "prefill_throughput_no_shadow_tok_s": run.prefill_tokens / window,
        "busy_fraction": run.busy_s / (window * max(1, run.extra.get("instances", 1))),
        "shadow_tokens": run.shadow_tokens,
        "shadow_tokens_used": run.shadow_tokens_used if tracked else None,
        "shadow_tokens_unused": shadow_unused,
        "shadow_unused_fraction": (shadow_unused / run.shadow_tokens
                                   if run.shadow_tokens and shadow_unused is not None else None),
        "gpus": run.gpus,
        "sessions_unfinished": run.sessions_unfinished,
        # Alg. 1 line 10: of the iterations given shadow chunks under a whole-iteration budget b, the share
        # that ran longer than b, and the largest executed duration / b (None: no such iteration)
        "shadow_over_budget_fraction": run.extra["shadow_over_budget"] / checked if checked else None,
        "shadow_budget_ratio_max": run.extra["shadow_budget_ratio_max"] if checked else None,
    }


# Figure 9c: switch calls binned by the context they carry (prompt tokens), and Figure 9a: by the size of
# the model they switch to (total parameters, §5.5 "< 15B, 15-50B, > 50B"). (label, upper bound).
CONTEXT_BINS = (("<2K", 2048), ("2-4K", 4096), ("4-8K", 8192), ("8-16K", 16384), ("16-32K", 32768),
                ("32-64K", 65536), (">64K", math.inf))
TARGET_BINS = (("<15B", 15.0), ("15-50B", 50.0), (">50B", math.inf))


def _bin(value: float, bins) -> str:
    return next(label for label, upper in bins if value < upper)


def target_bin(model: str) -> str:
    """The Figure 9a bin of a model switched to (its total parameters)."""
    return _bin(get_model(model).params_b, TARGET_BINS)


def _switch_bins(c: CallRecord) -> tuple[tuple[str, str], tuple[str, str]]:
    """A switch call's Figure 9c and 9a bins: (("by_context", bin), ("by_target", bin))."""
    return ("by_context", _bin(c.prompt_tokens, CONTEXT_BINS)), ("by_target", target_bin(c.model))


def switch_breakdown(calls: Iterable[CallRecord]) -> dict:
    """Summed latency and count of switch calls per context bin and per target-size bin:
    {"by_context": {bin: [latency_s, n]}, "by_target": {bin: [latency_s, n]}} (call-weighted sums, so runs
    and pairs add up; a bin's reduction is 1 - sum(policy) / sum(baseline) over the same calls)."""
    out: dict = {"by_context": {b: [0.0, 0] for b, _ in CONTEXT_BINS},
                 "by_target": {b: [0.0, 0] for b, _ in TARGET_BINS}}
    for c in calls:
        if not c.is_switch:
            continue
        for key, b in _switch_bins(c):
            out[key][b][0] += c.latency
            out[key][b][1] += 1
    return out


def switch_hits(calls: Iterable[CallRecord]) -> dict:
    """Prompt tokens and cached prompt tokens of switch calls per bin of `switch_breakdown`:
    {"by_context" | "by_target": {bin: [prompt_tokens, cached_tokens]}} (sums, so runs and pairs add up; a
    bin's switch hit rate is cached / prompt). Calls without a cached count are left out."""
    out: dict = {"by_context": {b: [0, 0] for b, _ in CONTEXT_BINS},
                 "by_target": {b: [0, 0] for b, _ in TARGET_BINS}}
    for c in calls:
        if not c.is_switch or c.cached_tokens is None:
            continue
        for key, b in _switch_bins(c):
            out[key][b][0] += c.prompt_tokens
            out[key][b][1] += c.cached_tokens
    return out


# Metrics where lower is better: reported as % reduction vs the baseline (positive = better).
REDUCTION_METRICS = ("switch_call_latency_mean_s", "switch_call_ttft_mean_s", "llm_call_latency_mean_s",
                     "llm_call_ttft_mean_s", "llm_time_per_session_s", "token_cost")
# Metrics reported as % increase vs the baseline.
INCREASE_METRICS = ("energy_per_good_request_j", "prefill_throughput_tok_s", "prefill_throughput_no_shadow_tok_s")


def common_call_keys(runs: Iterable[RunResult]) -> set[tuple[str, int]]:
    """Keys of measured calls that completed under every run."""
    keys: set | None = None
    for run in runs:
        mine = {c.key for c in run.calls if c.measured}
        keys = mine if keys is None else keys & mine
    return keys or set()


def _pct_reduction(base, value) -> float | None:
    if base is None or value is None or base == 0:
        return None
    return 100.0 * (base - value) / base


def compare(runs: "dict[str, RunResult]", baseline: str = "no-shadow",
            oracle: str = "oracle+host") -> dict[str, dict]:
    """Per-policy summaries over the calls common to all runs, with reductions vs `baseline` (when run):
    `<metric>_reduction_pct` for latency/TTFT/cost, `<metric>_increase_pct` for energy and throughput,
    `normal_slo_attainment_change_pp`, and `switch_latency_gain_vs_oracle` = this policy's switch-call
    latency reduction / `oracle`'s (when run)."""
    if not runs:
        raise ValueError("runs must not be empty")
    keys = common_call_keys(runs.values())
    out = {name: summarize(run, keys) for name, run in runs.items()}
    for name, run in runs.items():
        common = [c for c in run.calls if c.measured and c.key in keys]
        out[name]["switch_breakdown"] = switch_breakdown(common)
        out[name]["switch_hits"] = switch_hits(common)
    for s in out.values():
        s["switch_latency_gain_vs_oracle"] = None
    base = out.get(baseline)
    if base is None:
        return out
    for name, s in out.items():
        for m in REDUCTION_METRICS:
            s[f"{m}_reduction_pct"] = _pct_reduction(base[m], s[m])
        for m in INCREASE_METRICS:
            r = _pct_reduction(base[m], s[m])
            s[f"{m.removesuffix('_j').removesuffix('_tok_s')}_increase_pct"] = None if r is None else -r
        if base["normal_slo_attainment"] is not None and s["normal_slo_attainment"] is not None:
            s["normal_slo_attainment_change_pp"] = 100.0 * (s["normal_slo_attainment"]
                                                            - base["normal_slo_attainment"])
        for m in ("switch_hit_rate", "hit_rate"):
            if base[m] is not None and s[m] is not None:
                s[f"{m}_change_pp"] = 100.0 * (s[m] - base[m])
    if oracle in out:
        gain = out[oracle].get("switch_call_latency_mean_s_reduction_pct")
        for s in out.values():
            mine = s.get("switch_call_latency_mean_s_reduction_pct")
            s["switch_latency_gain_vs_oracle"] = (mine / gain if gain and mine is not None else None)
    return out
