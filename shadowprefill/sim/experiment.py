"""One experiment: a workload on a model pair (or N models), several Table 2 policies on the same seed.

    result = run_experiment(Experiment(workload="fusionbench", models=get_pair("Q2.5-7B/L3.1-70B"),
                                       policies=["no-shadow", "harvest-slo+host", "oracle+host"]))
    result["policies"]["harvest-slo+host"]["switch_call_latency_mean_s_reduction_pct"]

Every policy sees the same sessions (same routes, token ids and arrivals) and the same normal traffic
(same arrival times and lengths per instance), and is compared over the calls that completed under all of
them (`metrics.compare`). Normal traffic runs at ρ × the calibrated per-instance capacity of each model
(`capacity.py`). Sessions come from the workload generators (Table 1), a JSONL file, and may be re-routed
by a Markov or random router (appendix C). Each policy run learns its own next-model prior online.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from shadowprefill.cluster.cache_aware_router import CALL_ROUTERS, make_call_router, route_quality
from shadowprefill.cluster.router import MarkovRouter, RandomRouter, SwitchPredictor
from shadowprefill.cluster.traces import load_azure_trace, load_sessions
from shadowprefill.cluster.workloads import Session, WorkloadSpec, generate_sessions, get_workload
from shadowprefill.model.catalog import PAIRS, get_pair, resolve_name
from shadowprefill.sim.capacity import normal_rates
from shadowprefill.sim.metrics import RunResult, common_call_keys, compare
from shadowprefill.sim.policies import get_policy
from shadowprefill.sim.deployment import SimConfig, azure_normal_source
from shadowprefill.sim.simulator import Simulator


# Normal-traffic load of the paper's three measurement windows relative to the peak hour (§5.1: "we run three
# one-hour windows (peak, median, and trough) at their relative trace load"). The paper gives no numbers and
# its week-long trace is not shipped; ours are assumptions inside its stated daily swing ("Load swings by
# 3-10x within a day", §2.2): the median hour at half and the trough at a quarter of the peak-hour rate.
WINDOW_LOAD = {"peak": 1.0, "median": 0.5, "trough": 0.25}


@dataclass
class Experiment:
    """What to simulate. `models`: catalog names (a pair, or N > 2). `router`: None (recorded routes),
    "markov" (switch with probability `switch_p` per call) or "random". `window`: peak, median or trough (normal load
    ρ × WINDOW_LOAD[window] × capacity). `capacity`: requests/s per
    instance per model, skipping calibration. `sim`: extra `SimConfig` fields (β, δ, caps, ...).
    `call_router`: None, "fixed", "sticky" or "cache-aware": a per-call router asked at issue time
    (`cluster.cache_aware_router`), on top of the (possibly re-routed) recorded routes; `router_knob`: its
    lam (a downgrade must save more than this fraction of the call's price; >= 1 never downgrades)."""

    workload: str = "fusionbench"
    models: tuple[str, ...] = ()
    policies: Sequence[str] = ("no-shadow", "harvest-slo+host", "oracle+host")
    duration_s: float = 600.0
    warmup_s: float = 120.0
    rho: float = 0.7
    instances: int = 4
    seed: int = 0
    lengths: str = "conv"
    trace: str | None = None
    sessions_file: str | None = None
    session_rate: float | None = None
    router: str | None = None
    switch_p: float = 0.25
    window: str = "peak"
    call_router: str | None = None
    router_knob: float | None = None
    capacity: dict = field(default_factory=dict)
    sim: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.models) < 1:
            raise ValueError("models must name at least one model")
        self.models = tuple(resolve_name(m) for m in self.models)
        self.policies = [get_policy(p).name for p in self.policies]
        if not self.policies:
            raise ValueError("policies must not be empty")
        if self.router not in (None, "replay", "markov", "random"):
            raise ValueError(f"router must be None, 'replay', 'markov' or 'random', got {self.router!r}")
        if self.call_router not in (None, *CALL_ROUTERS):
            raise ValueError(f"call_router must be None or one of {CALL_ROUTERS}, got {self.call_router!r}")
        make_call_router(self.call_router, self.models, self.router_knob)     # validates router_knob
        if not self.rho >= 0:
            raise ValueError(f"rho must be >= 0, got {self.rho}")
        if self.window not in WINDOW_LOAD:
            raise ValueError(f"window must be one of {list(WINDOW_LOAD)}, got {self.window!r}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_models(text: str, workload: str | None = None) -> tuple[str, ...]:
    """`"Q2.5-7B/L3.1-70B"` (a pair label) or `"A/B/C"` / `"A,B,C"` (N models) -> catalog names."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"pair must look like 'SMALL/LARGE', got {text!r}")
    parts = [p for p in text.replace(",", "/").split("/") if p.strip()]
    if len(parts) == 2:
        return get_pair("/".join(parts))
    return tuple(resolve_name(p.strip()) for p in parts)


def candidate_models(workload: str, base: Sequence[str], n: int) -> tuple[str, ...]:
    """The pair grown to `n` models along the workload's other pairs' models (appendix C, "More than two
    models per router")."""
    out = list(base)
    for pair in PAIRS.get(workload, {}).values():
        for m in pair:
            if len(out) >= n:
                break
            if m not in out:
                out.append(m)
    if len(out) < n:
        raise ValueError(f"workload {workload!r} has only {len(out)} candidate models, asked for {n}")
    return tuple(out[:n])


def reroute(sessions: Sequence[Session], router) -> list[Session]:
    """Sessions with every call's model replaced by `router.route(session, k, history)`."""
    out = []
    for s in sessions:
        history: list[str] = []
        calls = []
        for k, call in enumerate(s.calls):
            model = router.route(s, k, history)
            history.append(model)
            calls.append(dataclasses.replace(call, model=model))
        out.append(Session(s.session_id, s.tenant, s.task, s.arrival_s, calls, token_seed=s.token_seed))
    return out


def session_workload(exp: Experiment) -> WorkloadSpec:
    """The workload's generator spec, its compaction window capped so that every call fits each model's KV
    pool: §4 compacts the history "when the context reaches the model's window", and a prompt plus its
    output beyond an instance's whole KV pool cannot be served at all (GHCP-like contexts reach 131K tokens;
    Gemma-2-9B's pool on one H100 holds about 115K). Unchanged when every pool is larger."""
    from shadowprefill.model.latency import LatencyModel
    spec = get_workload(exp.workload)
    cfg = sim_config(exp)
    bs = cfg.engine.block_size
    pool = min((LatencyModel(m, cfg.gpu, tp=cfg.tp.get(m)).max_kv_tokens(cfg.hbm_fraction) // bs) * bs
               for m in exp.models)
    window = pool - spec.max_output - bs
    if window >= spec.context_window:
        return spec
    if window < 4 * spec.summary_tokens:
        raise ValueError(f"models {list(exp.models)}: a KV pool of {pool} tokens is too small for {exp.workload}")
    return dataclasses.replace(spec, context_window=int(window))


def build_sessions(exp: Experiment) -> list[Session]:
    """The experiment's sessions: generated (Table 1 statistics) or loaded, then optionally re-routed."""
    horizon = exp.warmup_s + exp.duration_s
    if exp.sessions_file:
        sessions = [s for s in load_sessions(exp.sessions_file) if s.arrival_s < horizon]
        unknown = {m for s in sessions for m in s.models} - set(exp.models)
        if unknown and exp.router in (None, "replay"):
            raise ValueError(f"sessions file routes to {sorted(unknown)}, not among models {list(exp.models)}")
    else:
        sessions = generate_sessions(session_workload(exp), exp.models, duration_s=horizon, seed=exp.seed,
                                     session_rate=exp.session_rate)
    if exp.router == "markov":
        sessions = reroute(sessions, MarkovRouter(exp.models, exp.switch_p, seed=exp.seed))
    elif exp.router == "random":
        sessions = reroute(sessions, RandomRouter(exp.models, seed=exp.seed))
    return sessions


def sim_config(exp: Experiment, normal_rate: dict | None = None) -> SimConfig:
    return SimConfig.make(models=exp.models, instances=exp.instances, normal_rate=dict(normal_rate or {}),
                          duration_s=exp.duration_s, warmup_s=exp.warmup_s, seed=exp.seed, **exp.sim)


def run_policy(exp: Experiment, policy: str, sessions: Sequence[Session], normal_rate: dict,
               progress: bool = False, latency_cache: dict | None = None) -> RunResult:
    """One policy's run (a fresh cluster, a fresh next-model prior)."""
    cfg = sim_config(exp, normal_rate)
    records = load_azure_trace(exp.trace) if exp.trace else None
    source = azure_normal_source(exp.lengths, records=records)
    sim = Simulator(cfg, policy, sessions, normal_source=source, prior=SwitchPredictor(),
                    latency_cache=latency_cache,
                    call_router=make_call_router(exp.call_router, exp.models, exp.router_knob))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.warmup_s + cfg.duration_s, desc=policy, unit="sim s", leave=False,
                   bar_format="{desc}: {bar}| {n:.0f}/{total:.0f} sim s [{elapsed}<{remaining}]")
    start = time.perf_counter()
    run = sim.run(progress=bar if bar is not None else False)
    run.extra["wall_s"] = time.perf_counter() - start
    return run


def _policy_job(args):
    exp, policy, sessions, rates = args
    return policy, run_policy(exp, policy, sessions, rates)


def run_experiment(exp: Experiment, *, progress: bool = False, jobs: int = 1,
                   log: Callable[[str], None] | None = None) -> dict:
    """Run every policy of `exp` on the same seed; returns {"config", "capacity", "policies", "runs"}:
    per-policy summaries (see `metrics.compare`) and the raw `RunResult`s (not JSON; for plots)."""
    cfg0 = sim_config(exp)
    rates, caps = normal_rates(exp.models, cfg0, exp.rho * WINDOW_LOAD[exp.window], lengths=exp.lengths,
                               capacity=exp.capacity, log=log)
    sessions = build_sessions(exp)
    runs: dict[str, RunResult] = {}
    if jobs > 1 and len(exp.policies) > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(min(jobs, len(exp.policies))) as pool:
            for name, run in pool.imap(_policy_job, [(exp, p, sessions, rates) for p in exp.policies]):
                runs[name] = run
                if log:
                    log(f"{name}: {run.extra['wall_s']:.1f} s wall, ended at {run.end_time:.0f} sim s")
    else:
        cache: dict = {}
        for p in exp.policies:
            runs[p] = run_policy(exp, p, sessions, rates, progress=progress, latency_cache=cache)
            if log:
                log(f"{p}: {runs[p].extra['wall_s']:.1f} s wall, ended at {runs[p].end_time:.0f} sim s")
    summaries = compare(runs)
    keys = common_call_keys(runs.values())
    for name, run in runs.items():
        summaries[name].update(route_quality(run.calls, sessions, keys))   # accuracy_proxy vs recorded routes
        summaries[name]["run"] = run.as_dict()
    config = exp.as_dict()
    config.update(normal_rate_per_instance=rates, capacity_per_instance=caps, sessions=len(sessions),
                  calls=sum(len(s.calls) for s in sessions), sim_config=cfg0.as_dict())
    return {"config": config, "policies": summaries, "runs": runs}
