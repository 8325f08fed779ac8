"""Where shadow work goes: computed, used by a routed call, or evicted and lost (issue 25, the no-host question).

Runs one study point (workload, pair, seed, window; the paper's run length with --paper-length) for the given
policies and prints, per policy, the shadow tokens computed and used, the shadow pages allocated and what
became of them (promoted by a routed hit, evicted from HBM, lost without a hit), the host tier's traffic, and
the latencies the treatment moved. A policy whose shadows are evicted before any switch uses them computes
the same prefixes again and again: "computed / used" says how many shadow tokens each used one cost.

    .venv/bin/python bench/shadow_fate.py --workload fusionbench --paper-length \\
        --policies no-shadow,harvest-slo,harvest-slo+host
"""
from __future__ import annotations

import argparse
import json
import time

from shadowprefill.sim.args import parse_capacity
from shadowprefill.sim.experiment import run_experiment
from shadowprefill.sim.study import DEMO_SESSION_RATE, PAPER_DURATION_S, StudySpec


def _tpot_ms(calls) -> float | None:
    """Mean time per output token after the first (decode), ms, over calls with more than one output token."""
    per = [(c.finish - c.first_token) / (c.output_tokens - 1) for c in calls if c.output_tokens > 1]
    return 1e3 * sum(per) / len(per) if per else None


def fate_rows(result: dict) -> list[dict]:
    """One row per policy from run_experiment's result."""
    rows = []
    for name, run in result["runs"].items():
        measured = [c for c in run.calls if c.measured]
        s, pool = result["policies"][name], run.extra.get("pool", {})
        rows.append({
            "policy": name,
            "shadow_tokens": run.shadow_tokens,
            "shadow_tokens_used": run.shadow_tokens_used,
            "computed_per_used": run.shadow_tokens / run.shadow_tokens_used if run.shadow_tokens_used else None,
            "shadow_pages": pool.get("shadow_blocks_allocated", 0),
            "shadow_pages_promoted": pool.get("shadow_blocks_promoted", 0),
            "shadow_pages_evicted": pool.get("shadow_evictions", 0),
            "shadow_pages_lost": pool.get("shadow_blocks_wasted", 0),
            "spills": pool.get("spills", 0), "reloads": pool.get("reloads", 0),
            "host_hit_tokens": pool.get("host_hit_tokens", 0),
            "shadow_chunk_share": pool.get("shadow_chunks", 0) / max(pool.get("iterations", 1), 1),
            "switch_hit_rate": s.get("switch_hit_rate"),
            "switch_call_latency_s": s.get("switch_call_latency_mean_s"),
            "same_model_call_latency_s": s.get("same_model_call_latency_mean_s"),
            "same_model_hit_rate": s.get("same_model_hit_rate"),
            "switch_tpot_ms": _tpot_ms([c for c in measured if c.is_switch]),
            "same_model_tpot_ms": _tpot_ms([c for c in measured if not c.is_switch]),
            "normal_slo_attainment": s.get("normal_slo_attainment"),
        })
    return rows


def table(rows: list[dict]) -> str:
    head = ("| policy | shadow tokens | used | computed / used | shadow pages | promoted | evicted | lost | "
            "spills | reloads | chunks per iteration | switch hit | switch call (s) | same-model call (s) | "
            "switch / same-model decode (ms per token) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cpu = f"{r['computed_per_used']:.1f}" if r["computed_per_used"] else "–"
        out.append(f"| {r['policy']} | {r['shadow_tokens']:,} | {r['shadow_tokens_used']:,} | {cpu} | "
                   f"{r['shadow_pages']:,} | {r['shadow_pages_promoted']:,} | {r['shadow_pages_evicted']:,} | "
                   f"{r['shadow_pages_lost']:,} | {r['spills']:,} | {r['reloads']:,} | {r['shadow_chunk_share']:.3f} | "
                   f"{100 * r['switch_hit_rate']:.1f}% | {r['switch_call_latency_s']:.2f} | "
                   f"{r['same_model_call_latency_s']:.2f} | {r['switch_tpot_ms']:.1f} / {r['same_model_tpot_ms']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="fusionbench")
    ap.add_argument("--pair", default="Q2.5-7B/L3.1-70B")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", default="peak")
    ap.add_argument("--paper-length", action="store_true", help="the paper's run length for the workload")
    ap.add_argument("--duration", type=float, default=300.0, help="measured seconds (without --paper-length)")
    ap.add_argument("--policies", default="no-shadow,harvest-slo,harvest-slo+host")
    ap.add_argument("--capacity", default="", help="as demo's --capacity ('paper': the testbed's)")
    ap.add_argument("--lost-shadow", default="recompute", choices=("recompute", "wait"),
                    help="what a shadow whose computed prefix was evicted does (EngineConfig.lost_shadow)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    duration = PAPER_DURATION_S[a.workload] if a.paper_length else a.duration
    spec = StudySpec(workloads=(a.workload,), pair=a.pair, seeds=(a.seed,), windows=(a.window,),
                     duration_s={a.workload: duration}, policies=tuple(a.policies.split(",")),
                     capacity=parse_capacity(a.capacity), session_rate=None if a.paper_length else DEMO_SESSION_RATE)
    exp = spec.experiments()[0]
    exp.sim["lost_shadow"] = a.lost_shadow
    start = time.perf_counter()
    result = run_experiment(exp, log=print)
    rows = fate_rows(result)
    print(f"{a.workload}, {a.pair}, seed {a.seed}, {a.window}, {duration:.0f} s measured, lost_shadow={a.lost_shadow} "
          f"({time.perf_counter() - start:.0f} s wall)")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
