"""The direction study behind `tests/sim/test_directions.py`: small seeded runs of five Table 2 policies on
both workload families (FCFS admission), and the paper's qualitative effects as mean ± SE over seeds.

    python bench/direction_seeds.py --seeds 0-11 --jobs 2      # how the test's sizes and seeds were checked

The test runs the first seeds of `SIZES`; this script runs as many as asked and prints, per workload and
effect, the mean ± SE over all of them and over the test's seeds, so one can see that each effect holds by
more than its SE beyond the seeds the test happens to use.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shadowprefill.sim.experiment import Experiment  # noqa: E402
from shadowprefill.sim.runner import map_jobs  # noqa: E402
from shadowprefill.sim.study import _run_one, mean_se  # noqa: E402

PAIR = ("Qwen2.5-7B", "Llama-3.1-70B")
CAPACITY = {"Qwen2.5-7B": 22.287, "Llama-3.1-70B": 8.138}       # the shipped calibration, fixed here
POLICIES = ("no-shadow", "host-tier", "harvest-slo", "harvest-slo+host", "oracle+host", "eager")
# workload -> (measured s, warm-up s, sessions/s, the test's seeds); one instance per model
SIZES = {"fusionbench": (40.0, 10.0, 0.5, (0, 1, 2, 3, 4, 5)),
         "ghcp-coding": (60.0, 10.0, 0.2, (0, 1, 2))}
# effect -> (how it is computed from one run's summaries); each must have mean > SE
EFFECTS = {
    "switch latency cut": lambda s: s["harvest-slo+host"]["switch_call_latency_mean_s_reduction_pct"],
    "switch TTFT cut": lambda s: s["harvest-slo+host"]["switch_call_ttft_mean_s_reduction_pct"],
    "token cost cut": lambda s: s["harvest-slo+host"]["token_cost_reduction_pct"],
    "oracle bound": lambda s: (s["oracle+host"]["switch_call_latency_mean_s_reduction_pct"]
                               - s["harvest-slo+host"]["switch_call_latency_mean_s_reduction_pct"]),
    "host tier gain": lambda s: (s["harvest-slo+host"]["switch_call_latency_mean_s_reduction_pct"]
                                 - s["harvest-slo"]["switch_call_latency_mean_s_reduction_pct"]),
    "eager LLM-call slowdown": lambda s: -s["eager"]["llm_call_latency_mean_s_reduction_pct"],
    "normal SLO change (pp)": lambda s: s["harvest-slo+host"]["normal_slo_attainment_change_pp"],
    # the shadow work's own cost: against the same host tier without shadows (see tests/sim/test_directions.py)
    "normal SLO cost of shadows (pp)": lambda s: (s["harvest-slo+host"]["normal_slo_attainment_change_pp"]
                                                  - s["host-tier"]["normal_slo_attainment_change_pp"]),
}


def experiments(workload: str, seeds=None, admission: str = "fcfs") -> list[Experiment]:
    """The direction study's runs of `workload` (default: the test's seeds)."""
    duration, warmup, rate, test_seeds = SIZES[workload]
    return [Experiment(workload=workload, models=PAIR, policies=POLICIES, duration_s=duration, warmup_s=warmup,
                       instances=1, seed=s, capacity=dict(CAPACITY), session_rate=rate,
                       sim={"max_drain_s": 300.0, "admission": admission})
            for s in (test_seeds if seeds is None else seeds)]


def run(workload: str, seeds=None, jobs: int = 2, progress: bool = False, admission: str = "fcfs") -> list[dict]:
    """Per-run summaries {policy: summary} of the direction study of `workload`."""
    return [s for _, s in map_jobs(_run_one, experiments(workload, seeds, admission), jobs=jobs,
                                   progress=progress, desc=workload)]


def effects(summaries: list[dict]) -> dict[str, tuple[float, float]]:
    """{effect: (mean, SE)} over the runs."""
    return {name: mean_se([f(s) for s in summaries]) for name, f in EFFECTS.items()}


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-11", help="e.g. 0-11 or 0,3,5")
    ap.add_argument("--workloads", default=",".join(SIZES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--admission", default="fcfs", choices=("fcfs", "routed-first"))
    ap.add_argument("--out", help="write the per-run summaries and effects here (JSON)")
    args = ap.parse_args()
    seeds = _seeds(args.seeds)
    out = {}
    for w in args.workloads.split(","):
        t = time.perf_counter()
        summaries = run(w, seeds, args.jobs, progress=True, admission=args.admission)
        test_seeds = SIZES[w][3]
        in_test = [s for seed, s in zip(seeds, summaries) if seed in test_seeds]
        print(f"\n== {w}: {len(seeds)} seeds in {time.perf_counter() - t:.0f} s wall; "
              f"switch calls per run {[s['no-shadow']['num_switch_calls'] for s in summaries]}")
        print(f"  {'effect':26s}{'all seeds':>18s}{'test seeds':>18s}")
        every, tested = effects(summaries), effects(in_test) if in_test else {}
        for name, (m, se) in every.items():
            t_m, t_se = tested.get(name, (float("nan"), float("nan")))
            print(f"  {name:26s}{m:10.2f} ± {se:5.2f}{t_m:10.2f} ± {t_se:5.2f}")
        for policy in ("harvest-slo", "harvest-slo+host"):     # what test_filled_iterations_... bounds
            over = [s[policy]["shadow_over_budget_fraction"] or 0.0 for s in summaries]
            ratio = [s[policy]["shadow_budget_ratio_max"] or 0.0 for s in summaries]
            print(f"  {policy}: filled iterations past b, largest share {max(over):.3f}; "
                  f"largest duration / b {max(ratio):.3f}")
        out[w] = {"seeds": seeds, "effects_all": every, "effects_test_seeds": tested,
                  "runs": [{p: {k: v for k, v in s[p].items() if isinstance(v, (int, float))} for p in s}
                           for s in summaries]}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
