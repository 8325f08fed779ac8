"""Workload-level analytic model of the Unified AI Gateway (paper 003, §VI).

Everything here is the paper's scalar model: Table III gives the defaults (:class:`AnalyticParams`),
§VI-B the formulas, and Table IV the eight workload profiles (:data:`PROFILES`). Times are in
milliseconds, as in the paper; the control plane converts to seconds.

The two quantities the paper reports without an explicit formula are reconstructed as:

* TTFT speedup  = T_prep^base / T_prep^UG                     (§VI-B prep times, TTFT ≈ prep time)
* E2E cost ratio = (L_in·C_in^base + λ·L_out) / (L_in·C_in^UG + λ·L_out)   (input + output token bill,
  both in units of c_miss; "also includes output-token charges with λ=5.0", Table IV caption)

With these and the Preble mean lengths for the five Preble profiles, every Table IV cell is reproduced
to the paper's two decimals (tests/gateway/test_analytic.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

SWITCH_RATES = (0.25, 0.50, 0.75)  # §VI-A: the three r_switch settings of Table IV


@dataclass(frozen=True)
class AnalyticParams:
    """Table III reference settings (paper 003). Units are in the field names."""

    kv_bytes_per_token: float = 15e3  # s_KV = 15 KB/token (effective, hybrid-attention models)
    compression_ratio: float = 4.0  # ρ = 4×
    a_prefill_ms: float = 0.04  # ms/token
    b_attn_ms: float = 3e-6  # ms/token²
    tau_prefill_ms: float = 20.0  # ms fixed prefill overhead
    t_decode_ms: float = 10.0  # ms/token (Table III; no Table IV metric uses it)
    t_route_ms: float = 2.0
    t_lookup_ms: float = 3.0
    eta: float = 0.10  # η = c_hit / c_miss
    output_price_ratio: float = 5.0  # λ = c_out / c_miss
    bandwidth_bytes_per_s: float = 8e9  # B = 8 GB/s cross-domain reference

    def __post_init__(self):
        for name in ("kv_bytes_per_token", "compression_ratio", "bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("a_prefill_ms", "b_attn_ms", "tau_prefill_ms", "t_decode_ms", "t_route_ms",
                     "t_lookup_ms", "output_price_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {self.eta!r}")

    def with_(self, **changes) -> "AnalyticParams":
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)


DEFAULT_PARAMS = AnalyticParams()


@dataclass(frozen=True)
class WorkloadProfile:
    """θ_w = (L_in, L_out, h, ·, B) of §VI-A, one Table IV row (r_switch and B are arguments)."""

    key: str
    name: str
    context_tokens: float  # L_in, unrounded where the source reports it
    output_tokens: float  # L_out
    hit_rate: float  # h, effective cache-hit rate
    reuse_pattern: str
    table_lengths: str  # the rounded "Context/Output" label printed in Table IV
    source: str

    def __post_init__(self):
        if not self.context_tokens > 0:
            raise ValueError(f"context_tokens must be > 0, got {self.context_tokens!r}")
        if self.output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {self.output_tokens!r}")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate!r}")


def _profile(key, name, lin, lout, h, pattern, label, source):
    return key, WorkloadProfile(key, name, lin, lout, h, pattern, label, source)


# Table IV. The five Preble rows use the unrounded mean prompt lengths of Preble's workload study (Srivatsa
# et al., ICLR'25, [47]), which Table IV prints rounded (1835 -> "1.8K"). These values were taken from
# memory of that paper, not re-read here; the evidence is that with them all 72 Table IV cells round to
# the printed values, while the printed lengths leave 14 cells off by up to 0.5%. Chat/RAG use the paper's
# 16K settings; the coding agent the ~80K turn-30 context with output rounded to 610 tokens (§VI-A).
PROFILES: dict[str, WorkloadProfile] = dict([
    _profile("multi-turn-chat", "Multi-turn chat", 16_000, 200, 0.70, "Historical dialogue",
             "16K/200", "CachedAttention [62]"),
    _profile("rag", "RAG", 16_000, 300, 0.50, "Non-prefix chunks", "16K/300", "CacheBlend [15]"),
    _profile("toolbench", "ToolBench", 1_835, 43, 0.85, "Shared tool instructions", "1.8K/43",
             "Preble [47], InferCept [70]"),
    _profile("embodied-agent", "Embodied agent", 2_285, 16, 0.97, "Shared context and pauses",
             "2.3K/16", "Preble [47], Continuum [71]"),
    _profile("programming", "Programming", 3_871, 190, 0.97, "Shared prompts and context", "3.9K/190",
             "Preble [47], CacheWise [72]"),
    _profile("video-qa", "Video QA", 9_865, 4, 0.88, "Repeated video context", "9.9K/4", "Preble [47]"),
    _profile("long-document-qa", "Long-document QA (LooGLE)", 23_474, 16, 0.91,
             "Shared long-document context", "23.5K/16", "Preble [47], SCBench [73]"),
    _profile("long-horizon-coding-agent", "Long-horizon coding agent", 80_000, 610, 0.942,
             "Persistent cross-turn prefix", "80K/610", "vLLM x Mooncake trace [1]"),
])


# ---- §VI-B formulas -------------------------------------------------------------------------------

def prefill_time_ms(tokens: float, params: AnalyticParams = DEFAULT_PARAMS) -> float:
    """T_prefill(L) = a·L + b·L² + τ."""
    return params.a_prefill_ms * tokens + params.b_attn_ms * tokens * tokens + params.tau_prefill_ms


def kv_bytes(tokens: float, params: AnalyticParams = DEFAULT_PARAMS) -> float:
    """S(L) = L·s_KV (uncompressed)."""
    return tokens * params.kv_bytes_per_token


def transfer_time_ms(tokens: float, params: AnalyticParams = DEFAULT_PARAMS) -> float:
    """T_transfer = S(L) / (ρ·B)."""
    return kv_bytes(tokens, params) / (params.compression_ratio * params.bandwidth_bytes_per_s) * 1e3


def switch_time_ms(tokens: float, params: AnalyticParams = DEFAULT_PARAMS) -> float:
    """T_switch = min{T_map+transfer, T_re-prefill}; mapping is overlapped, so T_map+transfer = T_transfer."""
    return min(transfer_time_ms(tokens, params), prefill_time_ms(tokens, params))


def prep_time_gateway_ms(tokens, hit_rate, r_switch, params=DEFAULT_PARAMS) -> float:
    """T_prep^UG = t_route + t_lookup + h·r·T_switch + (1−h)·T_re-prefill."""
    return (params.t_route_ms + params.t_lookup_ms + hit_rate * r_switch * switch_time_ms(tokens, params)
            + (1.0 - hit_rate) * prefill_time_ms(tokens, params))


def prep_time_baseline_ms(tokens, hit_rate, r_switch, params=DEFAULT_PARAMS) -> float:
    """T_prep^base = t_route + t_lookup + [(1−h) + h·r]·T_re-prefill."""
    return (params.t_route_ms + params.t_lookup_ms
            + ((1.0 - hit_rate) + hit_rate * r_switch) * prefill_time_ms(tokens, params))


def input_cost_baseline(hit_rate, r_switch, params=DEFAULT_PARAMS) -> float:
    """C_input^base / c_miss = h(1−r)η + h·r + (1−h)."""
    return hit_rate * (1.0 - r_switch) * params.eta + hit_rate * r_switch + (1.0 - hit_rate)


def input_cost_gateway(hit_rate, params=DEFAULT_PARAMS) -> float:
    """C_input^UG / c_miss = h·η + (1−h)."""
    return hit_rate * params.eta + (1.0 - hit_rate)


def input_cost_ratio(hit_rate, r_switch, params=DEFAULT_PARAMS) -> float:
    """G_input(θ_w) = C_input^base / C_input^UG."""
    return input_cost_baseline(hit_rate, r_switch, params) / input_cost_gateway(hit_rate, params)


def e2e_cost_ratio(tokens, output_tokens, hit_rate, r_switch, params=DEFAULT_PARAMS) -> float:
    """Input + output token bill, baseline over gateway (output priced λ·c_miss on both sides)."""
    out = params.output_price_ratio * output_tokens
    return ((tokens * input_cost_baseline(hit_rate, r_switch, params) + out)
            / (tokens * input_cost_gateway(hit_rate, params) + out))


# ---- Table IV / Figure 5 --------------------------------------------------------------------------

def get_profile(profile: str | WorkloadProfile) -> WorkloadProfile:
    """Resolve a profile key (see :data:`PROFILES`) or pass a :class:`WorkloadProfile` through."""
    if isinstance(profile, WorkloadProfile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a str key or WorkloadProfile, got {type(profile).__name__}")
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"profile {profile!r} unknown; choose from {sorted(PROFILES)}") from None


def _check_rate(r_switch) -> float:
    if isinstance(r_switch, bool) or not isinstance(r_switch, (int, float)):
        raise TypeError(f"r_switch must be a number, got {type(r_switch).__name__}")
    if not (0.0 <= r_switch <= 1.0) or math.isnan(r_switch):
        raise ValueError(f"r_switch must be in [0, 1], got {r_switch!r}")
    return float(r_switch)


def benefits(profile: str | WorkloadProfile, r_switch: float,
             params: AnalyticParams | None = None) -> dict[str, float]:
    """Table IV benefits of one workload profile at switching rate ``r_switch``.

    Returns ``{"ttft_speedup", "input_cost_ratio", "e2e_cost_ratio"}`` (baseline over gateway, >= 1).
    """
    p = get_profile(profile)
    r = _check_rate(r_switch)
    params = DEFAULT_PARAMS if params is None else params
    if not isinstance(params, AnalyticParams):
        raise TypeError(f"params must be AnalyticParams, got {type(params).__name__}")
    L, h = p.context_tokens, p.hit_rate
    return {
        "ttft_speedup": prep_time_baseline_ms(L, h, r, params) / prep_time_gateway_ms(L, h, r, params),
        "input_cost_ratio": input_cost_ratio(h, r, params),
        "e2e_cost_ratio": e2e_cost_ratio(L, p.output_tokens, h, r, params),
    }


def table_iv(params: AnalyticParams | None = None,
             rates: Iterable[float] = SWITCH_RATES) -> list[dict]:
    """All Table IV rows as computed: one dict per profile with per-rate metric lists."""
    rates = tuple(rates)
    rows = []
    for key, p in PROFILES.items():
        per = [benefits(p, r, params) for r in rates]
        rows.append({"profile": key, "name": p.name, "lengths": p.table_lengths, "hit_rate": p.hit_rate,
                     "rates": list(rates),
                     **{m: [b[m] for b in per] for m in ("ttft_speedup", "input_cost_ratio",
                                                         "e2e_cost_ratio")}})
    return rows


SWEEP_PARAMS = ("bandwidth", "hit_rate", "context")


def default_sweep_values(param: str) -> list[float]:
    """Grids for the Figure 5 sensitivity panels: bandwidth in bytes/s, hit rate, context tokens."""
    if param == "bandwidth":  # 0.1 .. 100 GB/s, log-spaced
        return [0.1e9 * 10 ** (i / 8) for i in range(25)]
    if param == "hit_rate":
        return [i / 50 for i in range(0, 50)] + [0.99]
    if param == "context":  # 1K .. 128K tokens, log-spaced
        return [1000 * 2 ** (i / 4) for i in range(29)]
    raise ValueError(f"param must be one of {SWEEP_PARAMS}, got {param!r}")


def sensitivity(param: str, values: Iterable[float] | None = None,
                profiles: Iterable[str] | None = None, rates: Iterable[float] = SWITCH_RATES,
                params: AnalyticParams | None = None) -> list[dict]:
    """Figure 5 sweep: benefits of each profile as one parameter varies (others at Table III / IV).

    ``param`` is ``bandwidth`` (B, bytes/s), ``hit_rate`` (h) or ``context`` (L_in, tokens; L_out stays the
    profile's). Returns flat rows: profile, r_switch, param, value and the metrics.
    """
    if param not in SWEEP_PARAMS:
        raise ValueError(f"param must be one of {SWEEP_PARAMS}, got {param!r}")
    base = DEFAULT_PARAMS if params is None else params
    values = default_sweep_values(param) if values is None else list(values)
    keys = list(PROFILES) if profiles is None else [get_profile(k).key for k in profiles]
    rows = []
    for key in keys:
        prof = PROFILES[key]
        for v in values:
            pr, pp = prof, base
            if param == "bandwidth":
                pp = base.with_(bandwidth_bytes_per_s=float(v))
            elif param == "hit_rate":
                pr = replace(prof, hit_rate=float(v))
            else:
                pr = replace(prof, context_tokens=float(v))
            for r in rates:
                rows.append({"profile": key, "r_switch": r, "param": param, "value": float(v),
                             **benefits(pr, r, pp)})
    return rows
