"""How an instance treats shadow work: the controller policies of the paper's Table 2.

| policy       | shadow work                         | budget (Algorithm 1)                                   |
|--------------|-------------------------------------|--------------------------------------------------------|
| none         | ignored (No Shadow, Oracle, ...)    | -                                                      |
| harvest      | shadow jobs                         | credit (δ = 0.1) on every busy iteration, βT when idle |
| harvest-slo  | shadow jobs                         | Eq. 1 slack; credit (δ = 0.025) beside routed calls    |
| eager        | normal-priority prefill requests    | - (no controller: the scheduler runs them)             |
"""
from __future__ import annotations

from dataclasses import dataclass

# The paper's defaults (§3.2, §3.3, §5.1), one place for the engine, the controller and the vLLM plugin:
BETA = 0.5              # idle cap: shadow-only iterations of at most β·T
MARGIN = 0.1            # SLO margin m of Eq. 1
N_MIN = 256             # smallest shadow chunk
SHADOW_FRACTION = 0.25  # cap of the shadow KV class, a fraction of the pool
COLD_AGE_S = 5.0        # cache entries idle this long may be taken for shadow pages


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


def get_shadow_policy(policy: "str | ShadowPolicy") -> ShadowPolicy:
    """A policy by name ("none", "harvest", "harvest-slo", "eager") or as given."""
    if isinstance(policy, ShadowPolicy):
        return policy
    if policy not in SHADOW_POLICIES:
        raise ValueError(f"shadow policy must be one of {tuple(SHADOW_POLICIES)}, got {policy!r}")
    return SHADOW_POLICIES[policy]
