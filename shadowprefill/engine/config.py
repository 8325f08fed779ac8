"""Engine configuration: KV pool, batching limits, and the shadow-prefill controller's settings
(`shadow.policy.ShadowSettings`, declared once for the engine and the vLLM plugin).

Defaults follow the ShadowPrefill paper: 2,048-token chunked-prefill budget and 256 sequences (§4); the
controller's defaults are listed in `ShadowSettings`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shadowprefill.engine.scheduler import ADMISSIONS
from shadowprefill.engine.shadow_work import LOST_SHADOW
from shadowprefill.shadow.policy import SHADOW_POLICIES, ShadowSettings

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


@dataclass(frozen=True)
class EngineConfig(ShadowSettings):
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
    normal-priority requests), "none" (No Shadow: `add_shadow` is ignored). The controller's settings
    (`beta`, `delta`, `margin`, `n_min`, `shadow_fraction`, `cold_age_s`, `tpot_slo_s`, `ttft_slo_s`) are
    `ShadowSettings`' (keyword-only). `idle_cap_s`: overrides β·T as the cap of shadow-only iterations;
    `default_switch_prob`: a job's probability when the caller gives none (the Predictive gate is the
    orchestration core's: `cluster.ClusterManager(min_switch_prob=...)`). `lost_shadow`: what a shadow
    request whose computed prefix was evicted does, "recompute" (the paper's; the default) or "wait" for its
    session's next history (engine.shadow_work).

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
    host_tier_gib: float = 0.0
    page_bytes: int = 0
    idle_cap_s: float | None = None
    default_switch_prob: float = 0.5
    lost_shadow: str = "recompute"
    min_ttft_slo_s: float = 1.0
    min_tpot_slo_s: float = 0.025
    slo_factor: float = 5.0
    eos_token_id: int | None = None
    model_id: str = ""
    predictor_forgetting: float = 0.995
    refit_predictor: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("token_budget", self.token_budget, 1)
        _check_int("max_seqs", self.max_seqs, 1)
        if self.shadow_mode not in SHADOW_MODES:
            raise ValueError(f"shadow_mode must be one of {SHADOW_MODES}, got {self.shadow_mode!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        _check_number("host_tier_gib", self.host_tier_gib)
        _check_int("page_bytes", self.page_bytes, 0)
        _check_number("idle_cap_s", self.idle_cap_s, allow_none=True)
        _check_number("default_switch_prob", self.default_switch_prob, maximum=1.0)
        if self.lost_shadow not in LOST_SHADOW:
            raise ValueError(f"lost_shadow must be one of {LOST_SHADOW}, got {self.lost_shadow!r}")
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
