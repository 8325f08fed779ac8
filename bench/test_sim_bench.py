"""Simulator speed: simulated seconds per wall second, 4 + 4 instances at ρ = 0.7, GHCP-like workload.

Goal (issue 6): one simulated hour in <= 2 minutes on one core, i.e. >= 30 simulated s per wall s.

    .venv/bin/python -m pytest -q bench/test_sim_bench.py --benchmark-only      # the number
    .venv/bin/python bench/test_sim_bench.py --sim-seconds 120 --profile        # where the time goes

The profile groups self time by package (engine, kv pool, shadow controller, simulator/manager, latency
model) so the owners of each part see their share. The normal-traffic capacity is calibrated once and
cached (`shadowprefill.sim.capacity`); SHADOWPREFILL_BENCH_CAPACITY="MODEL=R,MODEL=R" skips calibration.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

from shadowprefill.cluster.router import SwitchPredictor
from shadowprefill.cluster.workloads import generate_sessions
from shadowprefill.model.catalog import get_pair
from shadowprefill.sim.capacity import normal_rates
from shadowprefill.sim.simulator import SimConfig, Simulator

PAIR = "Q2.5-7B/L3.1-70B"       # one of the paper's GHCP-coding pairs (Table 3)
WORKLOAD = "ghcp-coding"


def _capacity_override() -> dict:
    text = os.environ.get("SHADOWPREFILL_BENCH_CAPACITY", "")
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        out[name.strip()] = float(value)
    return out


def build(policy: str = "harvest-slo+host", sim_seconds: float = 120.0, warmup: float = 30.0, seed: int = 0):
    models = get_pair(PAIR)
    base = SimConfig(models=models, seed=seed)
    rates, _ = normal_rates(models, base, 0.7, capacity=_capacity_override() or None)
    cfg = SimConfig(models=models, instances=4, normal_rate=rates, duration_s=sim_seconds - warmup,
                    warmup_s=warmup, max_drain_s=0.0, seed=seed)
    sessions = generate_sessions(WORKLOAD, models, duration_s=sim_seconds, seed=seed)
    return Simulator(cfg, policy, sessions, prior=SwitchPredictor())


def simulated_per_wall(policy: str = "harvest-slo+host", sim_seconds: float = 120.0) -> tuple[float, float, int]:
    """(simulated s per wall s, wall s, iterations) of one run of `sim_seconds` simulated seconds."""
    sim = build(policy, sim_seconds)
    start = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - start
    iterations = sum(i.engine.stats.iterations for i in sim.instances)
    return sim.clock.now() / wall, wall, iterations


def test_sim_speed(benchmark):
    result = {}

    def once():
        result["v"] = simulated_per_wall("harvest-slo+host", 60.0)

    benchmark.pedantic(once, rounds=1, iterations=1)
    rate, wall, iterations = result["v"]
    benchmark.extra_info.update(sim_s_per_wall_s=rate, wall_s=wall, iterations=iterations,
                                us_per_iteration=1e6 * wall / iterations, hour_wall_min=3600 / rate / 60)


_GROUPS = (("shadowprefill/engine/", "engine (scheduler, request, executor, predictor, loop)"),
           ("shadowprefill/kv/", "kv (block pool, host tier, eviction)"),
           ("shadowprefill/shadow/", "shadow (controller, jobs)"),
           ("shadowprefill.model.latency", "latency model"),
           ("shadowprefill/sim/", "simulator, metrics"),
           ("shadowprefill/cluster/", "cluster manager, workloads"),
           ("numpy", "numpy"))


def profile(policy: str, sim_seconds: float, top: int = 25) -> None:
    sim = build(policy, sim_seconds)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    sim.run()
    prof.disable()
    wall = time.perf_counter() - start
    iterations = sum(i.engine.stats.iterations for i in sim.instances)
    print(f"{policy}: {sim.clock.now():.0f} simulated s in {wall:.1f} wall s (profiled) = "
          f"{sim.clock.now() / wall:.2f} sim s / wall s; {iterations} iterations, "
          f"{1e6 * wall / iterations:.0f} us per iteration")
    stats = pstats.Stats(prof)
    by_group: dict[str, float] = {}
    total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        total += tottime
        group = next((label for key, label in _GROUPS if key in filename), "other (builtins, stdlib)")
        by_group[group] = by_group.get(group, 0.0) + tottime
    for group, t in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {100 * t / total:5.1f}%  {t:7.2f} s  {group}")
    stats.sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="harvest-slo+host")
    ap.add_argument("--sim-seconds", type=float, default=120.0)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.profile:
        profile(a.policy, a.sim_seconds)
    else:
        r, w, n = simulated_per_wall(a.policy, a.sim_seconds)
        print(f"{a.policy}: {r:.2f} simulated s per wall s ({w:.1f} wall s, {n} iterations, "
              f"{1e6 * w / n:.0f} us/iteration); one simulated hour = {3600 / r / 60:.1f} wall min")
