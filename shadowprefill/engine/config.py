"""Engine configuration: KV pool, batching limits and the shadow-prefill controller's parameters.

Defaults follow the ShadowPrefill paper: 2,048-token chunked-prefill budget and 256 sequences (§4),
β = 0.5 (§3.2), δ = 0.025 for Harvest-SLO and 0.1 for Harvest (§3.2, Table 2), n_min = 256 tokens
(appendix C), shadow class capped at 25% of the pool with 5 s cold age (§3.3). The paper does not state
its default SLO margin m (Figure 15e sweeps 0-0.4); we use 0.1.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shadowprefill.engine.scheduler import ADMISSIONS
from shadowprefill.shadow.policy import BETA, COLD_AGE_S, MARGIN, N_MIN, SHADOW_FRACTION, SHADOW_POLICIES

SHADOW_MODES = tuple(SHADOW_POLICIES)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value, minimum: float = 0.0, allow_none: bool = False,
                  maximum: float = math.inf) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (minimum <= value <= maximum) or math.isnan(value):
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")


@dataclass
class EngineConfig:
    """Everything one engine instance needs besides its model / executor.

    KV pool: `num_blocks` pages of `block_size` tokens; `shadow_fraction` of them at most hold shadow
    KV; shadow pages may also take pages idle for `cold_age_s`; `host_tier_gib` > 0 adds a host-memory
    spill tier of that size; `page_bytes` sizes it when the engine has no KV tensors (simulation).

    Batching: `token_budget` new tokens and `max_seqs` sequences per iteration.

    Admission (`admission`): "fcfs" (the default: routed calls and normal traffic in one queue by arrival,
    as the paper's vLLM engines; shadow work is the only lower class) or "routed-first" (waiting routed calls
    before normal traffic; a routed admission may preempt running normal requests).

    Shadow prefill (`shadow_mode`, a `shadow.policy` name): "harvest-slo" (Algorithm 1 with the SLO-slack
    controller; the default), "harvest" (fixed credit on busy iterations), "eager" (shadow jobs as
    normal-priority requests), "none" (No Shadow: `add_shadow` is ignored). `beta`: idle/iteration cap as a fraction of the TPOT SLO; `delta`: credit rate (None: the
    mode's default); `margin`: SLO margin m of Eq. 1; `n_min`: smallest shadow chunk;
    `idle_cap_s`: overrides β·T as the cap of shadow-only iterations; `default_switch_prob`: a job's
    probability when the caller gives none (the Predictive gate is the orchestration core's:
    `cluster.ClusterManager(min_switch_prob=...)`).

    SLOs: `ttft_slo_s` / `tpot_slo_s` fix the per-request SLOs; None applies the paper's rule (§5.1)
    TTFT <= max(`min_ttft_slo_s`, 5 x isolated prefill), TPOT <= max(`min_tpot_slo_s`, 5 x batch-1
    decode), computed from the latency model / predictor.
    """

    num_blocks: int
    block_size: int = 16
    token_budget: int = 2048
    max_seqs: int = 256
    admission: str = "fcfs"
    shadow_mode: str = "harvest-slo"
    beta: float = BETA
    delta: float | None = None
    margin: float = MARGIN
    n_min: int = N_MIN
    shadow_fraction: float = SHADOW_FRACTION
    cold_age_s: float = COLD_AGE_S
    host_tier_gib: float = 0.0
    page_bytes: int = 0
    idle_cap_s: float | None = None
    default_switch_prob: float = 0.5
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    min_ttft_slo_s: float = 1.0
    min_tpot_slo_s: float = 0.025
    slo_factor: float = 5.0
    eos_token_id: int | None = None
    model_id: str = ""
    predictor_forgetting: float = 0.995
    refit_predictor: bool = True

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("token_budget", self.token_budget, 1)
        _check_int("max_seqs", self.max_seqs, 1)
        _check_int("n_min", self.n_min, 0)
        if self.shadow_mode not in SHADOW_MODES:
            raise ValueError(f"shadow_mode must be one of {SHADOW_MODES}, got {self.shadow_mode!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        _check_number("beta", self.beta)
        _check_number("delta", self.delta, allow_none=True)
        _check_number("margin", self.margin, maximum=0.999)
        _check_number("shadow_fraction", self.shadow_fraction, maximum=1.0)
        _check_number("cold_age_s", self.cold_age_s)
        _check_number("host_tier_gib", self.host_tier_gib)
        _check_int("page_bytes", self.page_bytes, 0)
        _check_number("idle_cap_s", self.idle_cap_s, allow_none=True)
        _check_number("default_switch_prob", self.default_switch_prob, maximum=1.0)
        _check_number("ttft_slo_s", self.ttft_slo_s, allow_none=True)
        _check_number("tpot_slo_s", self.tpot_slo_s, allow_none=True)
        _check_number("min_ttft_slo_s", self.min_ttft_slo_s)
        _check_number("min_tpot_slo_s", self.min_tpot_slo_s)
        _check_number("slo_factor", self.slo_factor)
        _check_number("predictor_forgetting", self.predictor_forgetting, minimum=0.5, maximum=1.0)
        if self.eos_token_id is not None:
            _check_int("eos_token_id", self.eos_token_id, 0)
        if not isinstance(self.model_id, str):
            raise TypeError(f"model_id must be a str, got {type(self.model_id).__name__}")

    def as_dict(self) -> dict:
        return asdict(self)
