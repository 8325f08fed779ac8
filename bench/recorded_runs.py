"""Recorded seeded runs: every Table 2 policy on short FusionBench-like and GHCP-like runs, plus P/D,
three models and the cache-aware router, each reduced to its §5 metrics and a digest of every call.

Used to check that a refactor keeps the simulator's results (issue 12 "Keep"): run it before and after,
then compare the two JSON files.

    .venv/bin/python bench/recorded_runs.py --out before.json
    .venv/bin/python bench/recorded_runs.py --out after.json --compare before.json

`tests/sim/test_recorded_runs.py` replays a small subset of these cases against the checked-in
`tests/sim/data/recorded_runs.json` (made by this script with `--cases small`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time

from shadowprefill.model.catalog import get_pair
from shadowprefill.sim.experiment import Experiment, run_experiment

ALL_POLICIES = ("no-shadow", "host-tier", "harvest", "harvest-slo", "harvest-slo+host", "predictive",
                "dedicated", "eager", "oracle", "oracle+host")
CAPACITY = {"Qwen2.5-7B": 12.0, "Llama-3.1-70B": 4.0, "Llama-3.1-8B": 12.0}


def _case(name, workload, policies, duration=60.0, warmup=20.0, **kw) -> dict:
    return dict(name=name, workload=workload, policies=list(policies), duration_s=duration, warmup_s=warmup, **kw)


CASES = {
    "test": [   # tests/sim/test_recorded_runs.py
        _case("fusionbench-test", "fusionbench", ("no-shadow", "harvest-slo+host", "eager", "oracle+host"),
              duration=15.0, warmup=5.0, session_rate=0.3, sim={"max_drain_s": 15.0}),
        _case("ghcp-test", "ghcp-coding", ("harvest", "dedicated"), duration=10.0, warmup=5.0, session_rate=0.6,
              sim={"max_drain_s": 10.0}),
    ],
    "small": [
        _case("fusionbench-all", "fusionbench", ALL_POLICIES, duration=30.0, warmup=10.0, session_rate=0.3),
        _case("ghcp-host", "ghcp-coding", ("no-shadow", "harvest-slo+host", "oracle+host"), duration=30.0,
              warmup=10.0, session_rate=0.2),
    ],
    "full": [
        _case("fusionbench-all", "fusionbench", ALL_POLICIES, duration=90.0, warmup=30.0, session_rate=0.2),
        _case("ghcp-all", "ghcp-coding", ALL_POLICIES, duration=90.0, warmup=30.0, session_rate=0.1),
        _case("fusionbench-pd", "fusionbench", ("no-shadow", "harvest-slo", "oracle"), duration=60.0,
              session_rate=0.2, sim={"pd_prefill": 2}),
        _case("fusionbench-top1-3models", "fusionbench", ("no-shadow", "harvest-slo+host"), duration=60.0,
              session_rate=0.2, models=3, sim={"shadow_targets": "top1"}),
        _case("fusionbench-cache-aware", "fusionbench", ("no-shadow", "harvest-slo+host"), duration=60.0,
              session_rate=0.2, call_router="cache-aware", router_knob=0.9),
        _case("fusionbench-markov-seed1", "fusionbench", ("harvest", "predictive"), duration=60.0, seed=1,
              session_rate=0.2, router="markov"),
    ],
}


def call_digest(run) -> str:
    """A hash of every call's placement, timings (ns) and token counts."""
    h = hashlib.sha256()
    for c in sorted(run.calls, key=lambda c: (c.session_id, c.call_index)):
        h.update(repr((c.session_id, c.call_index, c.model, c.instance, c.is_switch, round(c.arrival * 1e9),
                       round(c.first_token * 1e9), round(c.finish * 1e9), c.prompt_tokens, c.cached_tokens,
                       c.host_cached_tokens, c.output_tokens)).encode())
    for n in sorted(run.normal, key=lambda n: n.request_id):
        h.update(repr((n.request_id, n.first_token if n.first_token is None else round(n.first_token * 1e9),
                       n.finish if n.finish is None else round(n.finish * 1e9))).encode())
    return h.hexdigest()[:16]


SKIP = ("run",)


def run_case(case: dict) -> dict:
    case = dict(case)
    name = case.pop("name")
    n_models = case.pop("models", 2)
    base = get_pair("Q2.5-7B/L3.1-70B")
    models = base
    if n_models > 2:
        from shadowprefill.sim.experiment import candidate_models
        models = candidate_models(case["workload"], base, n_models)
    capacity = {m: CAPACITY.get(m, 6.0) for m in models}
    exp = Experiment(models=models, capacity=capacity, **case)
    start = time.perf_counter()
    result = run_experiment(exp)
    out = {"wall_s": round(time.perf_counter() - start, 1), "policies": {}}
    for policy, summary in result["policies"].items():
        run = result["runs"][policy]
        row = {k: v for k, v in summary.items() if k not in SKIP}
        row["digest"] = call_digest(run)
        row["end_time"] = run.end_time
        out["policies"][policy] = row
    return name, out


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


def compare(before: dict, after: dict) -> list[str]:
    """Lines naming every metric that differs."""
    diffs = []
    for case, data in before.items():
        if case not in after:
            diffs.append(f"{case}: missing")
            continue
        for policy, row in data["policies"].items():
            other = after[case]["policies"].get(policy, {})
            for k, v in row.items():
                if not _close(v, other.get(k)):
                    diffs.append(f"{case}/{policy}/{k}: {v} -> {other.get(k)}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="full", choices=sorted(CASES))
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None, help="a JSON file of an earlier run to compare with")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    results = {}
    for case in CASES[args.cases]:
        if only and case["name"] not in only:
            continue
        name, out = run_case(case)
        results[name] = out
        print(f"{name}: {out['wall_s']} s", file=sys.stderr, flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        diffs = compare({k: v for k, v in before.items() if k in results}, results)
        print("\n".join(diffs) if diffs else "identical")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
