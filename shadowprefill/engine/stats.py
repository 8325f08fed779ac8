"""EngineStats: what one engine instance counted since construction (the simulator and demo read it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineStats:
    """Counters since construction (tokens, iterations, seconds on the engine's clock)."""

    iterations: int = 0
    busy_time_s: float = 0.0
    shadow_only_iterations: int = 0
    decode_tokens: int = 0
    prefill_tokens_routed: int = 0
    prefill_tokens_normal: int = 0
    shadow_tokens: int = 0                 # computed by shadow chunks (Harvest modes)
    shadow_chunks: int = 0
    eager_shadow_tokens: int = 0           # computed by Eager's shadow requests
    preemptions: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0                 # of admitted user requests (first admission)
    cached_prompt_tokens: int = 0          # ... served from the prefix cache (device or host)
    host_cached_prompt_tokens: int = 0
    routed_prompt_tokens: int = 0
    routed_cached_prompt_tokens: int = 0
    routed_shadow_hit_tokens: int = 0      # routed prompt tokens found on shadow-class pages
    budget_branches: dict = field(default_factory=dict)
    # Alg. 1 line 10 kept? Iterations given shadow chunks under a whole-iteration budget b (the SLO-slack
    # and idle branches), how many of them ran longer than b, and the largest executed duration / b
    shadow_budget_iterations: int = 0
    shadow_over_budget: int = 0
    shadow_budget_ratio_max: float = 0.0
    shadow_probes: int = 0                 # liveness probes: idle iterations whose b admitted no chunk
    credit: float = 0.0
    credit_earned_s: float = 0.0
    credit_spent_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
