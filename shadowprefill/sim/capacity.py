"""Capacity calibration: the highest normal-traffic rate one instance sustains with >= 90% of requests
meeting both SLOs (paper §5.1 "the normal-traffic rate is ρ=0.7 of the capacity at which 90% of requests
meet both SLOs", appendix D.1 "Capacity is the highest tested rate with at least 90% attainment of both
TTFT and TPOT SLOs").

One instance of the model (No Shadow, same engine and pool as the cluster runs) serves only normal
traffic (Azure lengths, Poisson arrivals) at a probed rate for a window; attainment counts the requests
arriving in the window (unfinished ones miss). The search doubles the rate until attainment falls below
the target, then bisects (geometrically) between the last good and the first bad rate. Every probe uses the
same seed (common random numbers), so attainment is close to monotone in the rate.

Calibration always uses seed 0 (`CALIBRATION_SEED`), whatever the experiment's seed. Results are cached
in a JSON file (`$SHADOWPREFILL_CACHE_DIR/capacity.json`, default
`~/.cache/shadowprefill/`) keyed by everything that changes them. For reference, the paper's vLLM testbed
measured 12.8, 11.0 and 3.8 requests/s for Qwen2.5-7B, Llama-3.1-8B (one H100) and Llama-3.1-70B (four).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from shadowprefill.model.latency import LatencyModel
from shadowprefill.sim.metrics import NormalRecord
from shadowprefill.sim.deployment import SimConfig, azure_normal_source
from shadowprefill.sim.simulator import Simulator

TARGET_ATTAINMENT = 0.9


@dataclass(frozen=True)
class CapacityProbe:
    rate: float
    attainment: float
    requests: int


def cache_path() -> Path:
    root = os.environ.get("SHADOWPREFILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "shadowprefill")
    return Path(root) / "capacity.json"


CALIBRATION_SEED = 0   # capacity is a property of the deployment, not of an experiment's seed


def _cache_key(model: str, config: SimConfig, lengths: str, duration_s: float, target: float) -> str:
    parts = dict(model=model, gpu=config.gpu, tp=config.tp.get(model), hbm=config.hbm_fraction,
                 block=config.engine.block_size, budget=config.engine.token_budget, seqs=config.engine.max_seqs,
                 lengths=lengths,
                 duration=duration_s, seed=CALIBRATION_SEED, target=target, v=1)
    return json.dumps(parts, sort_keys=True)


def attainment(model: str, rate: float, base: SimConfig, *, lengths: str = "conv", duration_s: float = 120.0,
               warmup_s: float = 20.0, seed: int = CALIBRATION_SEED) -> CapacityProbe:
    """SLO attainment of one instance of `model` serving normal traffic alone at `rate` requests/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    cfg = SimConfig(models=(model,), instances=1, normal_rate={model: float(rate)}, duration_s=duration_s,
                    warmup_s=warmup_s, max_drain_s=max(60.0, duration_s), seed=seed, gpu=base.gpu,
                    tp=dict(base.tp), hbm_fraction=base.hbm_fraction, engine=base.engine)
    sim = Simulator(cfg, "no-shadow", [], normal_source=azure_normal_source(lengths))
    run = sim.run()
    records: list[NormalRecord] = run.normal
    met = sum(1 for r in records if r.meets_slo)
    return CapacityProbe(float(rate), met / len(records) if records else 1.0, len(records))


def initial_guess(model: str, base: SimConfig) -> float:
    """Where the search starts: a quarter of the rate at which back-to-back isolated prefills of a mean
    Azure conversation prompt (about 1.1K tokens) would saturate the instance."""
    lm = LatencyModel(model, base.gpu, tp=base.tp.get(model))
    return 0.25 / lm.prefill_time(1100, chunk=base.engine.token_budget)


def calibrate_capacity(model: str, base: SimConfig, *, lengths: str = "conv", target: float = TARGET_ATTAINMENT,
                       duration_s: float = 120.0, start_rate: float | None = None, steps: int = 5,
                       use_cache: bool = True, log=None) -> float:
    """Highest rate (requests/s per instance) with attainment >= `target`, to ~2^(-steps) relative precision
    of the bracket found by doubling. Cached on disk unless use_cache=False."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    key = _cache_key(model, base, lengths, duration_s, target)
    path = cache_path()
    cache = {}
    if use_cache and path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return float(cache[key])
    probes: list[CapacityProbe] = []

    def probe(rate: float) -> bool:
        p = attainment(model, rate, base, lengths=lengths, duration_s=duration_s)
        probes.append(p)
        if log is not None:
            log(f"capacity {model}: {rate:.3f} req/s -> {100 * p.attainment:.1f}% of {p.requests}")
        return p.attainment >= target

    good, bad = 0.0, None
    rate = start_rate if start_rate is not None else initial_guess(model, base)
    while bad is None:                      # bracket: double until attainment drops below target
        if probe(rate):
            good, rate = rate, rate * 2.0
            if rate > 1e4:
                raise RuntimeError(f"capacity of {model} did not saturate below 1e4 requests/s")
        else:
            bad = rate
    if good == 0.0:                         # even start_rate fails: halve down
        while good == 0.0 and bad > 1e-3:
            rate = bad / 2.0
            if probe(rate):
                good = rate
            else:
                bad = rate
    for _ in range(steps):                  # geometric bisection
        mid = math.sqrt(good * bad) if good > 0 else bad / 2.0
        if probe(mid):
            good = mid
        else:
            bad = mid
    if use_cache:
        cache[key] = good
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError:
            pass
    return good


def normal_rates(models, base: SimConfig, rho: float, *, lengths: str = "conv", capacity: dict | None = None,
                 log=None) -> tuple[dict, dict]:
    """(rate per instance = ρ × capacity, capacity) for each model; `capacity` overrides calibration."""
    if not rho >= 0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    caps = {}
    for m in models:
        caps[m] = float(capacity[m]) if capacity and m in capacity else calibrate_capacity(m, base, lengths=lengths,
                                                                                          log=log)
    return {m: rho * c for m, c in caps.items()}, caps
