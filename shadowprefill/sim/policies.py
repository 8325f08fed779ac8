"""The approaches of the paper's Table 2, each a configuration of the same engine and cluster manager.

| Policy            | engines' shadow mode | host tier | other                                             |
|-------------------|----------------------|-----------|---------------------------------------------------|
| no-shadow         | none                 | no        | cold switch; the baseline                         |
| host-tier         | none                 | yes       | No Shadow with the host-DRAM KV tier              |
| harvest           | harvest (δ = 0.1)    | no        | fixed credit on every busy iteration              |
| harvest-slo       | harvest-slo          | no        | Algorithm 1 with the SLO-slack controller         |
| harvest-slo+host  | harvest-slo          | yes       | the complete design                               |
| predictive        | harvest (δ = 0.1)    | no        | jobs gated on switch probability >= 0.25          |
| dedicated         | none on serving ones | no        | +1 instance per model runs all shadow work (+25%) |
| eager             | eager                | no        | shadow work as normal-priority requests           |
| oracle            | none                 | no        | switch call's prefix cached for free              |
| oracle+host       | none                 | yes       | Oracle with the host tier                         |

Choices the paper leaves open, fixed here:
- Dedicated ("one extra instance per model runs all shadow work"): the extra instance serves no normal
  traffic; every shadow job of the model goes to it, and it runs them with the Harvest-SLO controller
  whose shadow-only iterations are capped by the token budget instead of β·T (`dedicated_idle_cap_s`,
  it has no normal traffic to protect). A routed call may be placed on it (by the usual lowest estimated
  prefill completion) only if its session's shadow is there or the session already runs there: that is
  how a switch call finds its shadow, without turning the extra instance into spare capacity for every
  call (which would let Dedicated beat Oracle by serving routed calls on an unloaded instance).
- Oracle: at a switch call, the session history the call's prompt keeps is registered in the target
  instance's prefix cache without computing it (pages allocated and committed, costing no time), then
  the call is submitted as usual; it prefills only its new input (`ClusterManager.oracle_warm`).
- The host tier is 32 GB of DRAM per GPU (appendix C: "needs only 32 GB per GPU").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """One row of Table 2: how every engine and the manager are configured."""

    name: str
    shadow_mode: str                   # EngineConfig.shadow_mode of the serving instances (said explicitly)
    host_tier: bool = False
    min_switch_prob: float = 0.0       # Predictive gate (the orchestration core's min_switch_prob)
    dedicated: bool = False            # one extra shadow instance per model
    oracle: bool = False               # switch call's prefix cached for free
    description: str = ""

    @property
    def shadows(self) -> bool:
        """Whether the manager creates shadow jobs at all."""
        return self.shadow_mode != "none" or self.dedicated


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("no-shadow", shadow_mode="none", description="Cold switch; the baseline."),
    Policy("host-tier", shadow_mode="none", host_tier=True, description="No Shadow with the host-DRAM KV tier."),
    Policy("harvest", shadow_mode="harvest", description="Shadow jobs under a fixed credit (δ=0.1)."),
    Policy("harvest-slo", shadow_mode="harvest-slo", description="Shadow jobs under the SLO-slack controller."),
    Policy("harvest-slo+host", shadow_mode="harvest-slo", host_tier=True,
           description="Harvest-SLO with the host tier."),
    Policy("predictive", shadow_mode="harvest", min_switch_prob=0.25,
           description="Harvest, gated on switch probability >= 0.25."),
    Policy("dedicated", shadow_mode="none", dedicated=True,
           description="One extra instance per model runs all shadow work (+25% GPUs)."),
    Policy("eager", shadow_mode="eager", description="Shadow work as normal-priority requests."),
    Policy("oracle", shadow_mode="none", oracle=True, description="Switch call's prefix cached for free."),
    Policy("oracle+host", shadow_mode="none", oracle=True, host_tier=True,
           description="Switch call's prefix cached for free, with the host tier."),
)}

# The order of the paper's figures (Eager last: "Figures omit Eager").
POLICY_ORDER = tuple(POLICIES)

HOST_TIER_GB_PER_GPU = 32.0            # appendix C, Figure 15g default
DEDICATED_SHADOW_MODE = "harvest-slo"


def get_policy(name: "str | Policy") -> Policy:
    """A Table 2 policy by name (case-insensitive; "_" and " " read as "-")."""
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        raise TypeError(f"policy must be a name or a Policy, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[key]


def parse_policies(text: str) -> list[Policy]:
    """`"no-shadow,harvest-slo+host"` -> policies, in the given order, without duplicates; "all" = all ten."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"policies must be a comma-separated list of names, got {text!r}")
    if text.strip().lower() == "all":
        return list(POLICIES.values())
    out: list[Policy] = []
    for part in text.split(","):
        if part.strip():
            p = get_policy(part)
            if p not in out:
                out.append(p)
    return out
