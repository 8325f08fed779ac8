"""Cost vs accuracy proxy of per-call routers, with and without shadow prefill (issue #7).

    SHADOWPREFILL_CACHE_DIR=/tmp/spcache nice -n 10 .venv/bin/python bench/router_tradeoff.py \\
        --duration 120 --warmup 30 --session-rate 0.2 --out out/router_tradeoff

Runs the same sessions and normal traffic (FusionBench-like, Q2.5-7B/L3.1-70B by default) under every
(router, policy): the fixed router (recorded routes), the sticky cost router and the cache-aware router
(`shadowprefill.cluster.cache_aware_router`) at each `--knobs` value of lam, each under `--policies`
(default No Shadow and Harvest-SLO+Host). Every point is measured over the measured calls that completed
in every run, so costs compare like for like. Writes `tradeoff.json` (one row per run) and `tradeoff.png`
(token cost relative to fixed/no-shadow against the accuracy proxy) under `--out`, and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shadowprefill.cluster.cache_aware_router import route_quality
from shadowprefill.sim.experiment import (
    Experiment,
    build_sessions,
    parse_models,
    run_experiment,
)
from shadowprefill.sim.metrics import common_call_keys, summarize

COLUMNS = ("token_cost", "accuracy_proxy", "downgraded_calls", "upgraded_calls", "num_calls", "num_switch_calls",
           "hit_rate", "switch_hit_rate", "llm_call_latency_mean_s", "switch_call_latency_mean_s",
           "shadow_tokens", "sessions_unfinished")


def router_configs(knobs: list[float]) -> list[tuple[str, str | None, float | None]]:
    """(label, call_router, knob): fixed, then sticky and cache-aware at every knob."""
    out = [("fixed", None, None)]
    for name in ("sticky", "cache-aware"):
        out += [(f"{name} lam={k:g}", name, k) for k in knobs]
    return out


def run(args) -> dict:
    models = parse_models(args.pair, args.workload)
    base = {"workload": args.workload, "models": models, "policies": args.policies.split(","),
            "duration_s": args.duration, "warmup_s": args.warmup, "rho": args.rho, "instances": args.instances,
            "seed": args.seed, "session_rate": args.session_rate}
    runs, meta = {}, {}
    sessions = None
    for label, router, knob in router_configs(args.knobs):
        exp = Experiment(**base, call_router=router, router_knob=knob)
        start = time.perf_counter()
        result = run_experiment(exp, log=None)
        sessions = sessions or build_sessions(exp)
        meta = result["config"]
        for policy, r in result["runs"].items():
            runs[(label, policy)] = r
        print(f"{label}: {time.perf_counter() - start:.0f} s wall", file=sys.stderr, flush=True)
    keys = common_call_keys(runs.values())
    rows = []
    for (label, policy), r in runs.items():
        s = summarize(r, keys)
        s.update(route_quality(r.calls, sessions, keys))
        rows.append({"router": label, "policy": policy, **{c: s[c] for c in COLUMNS}})
    ref = next(r["token_cost"] for r in rows if r["router"] == "fixed" and r["policy"] == args.policies.split(",")[0])
    for r in rows:
        r["cost_vs_fixed"] = r["token_cost"] / ref if ref else None
    meta.pop("sim_config", None)
    return {"config": {**meta, "knobs": args.knobs, "common_calls": len(keys)}, "rows": rows}


def table(result: dict) -> str:
    lines = [("| router | policy | token cost (USD) | cost / fixed no-shadow | accuracy proxy | downgrades | "
             "upgrades | switch calls | hit rate | LLM-call latency (s) |"), "|" + "---|" * 10]
    for r in result["rows"]:
        lines.append(f"| {r['router']} | {r['policy']} | {r['token_cost']:.4f} | {r['cost_vs_fixed']:.3f} | "
                     f"{r['accuracy_proxy']:.3f} | {r['downgraded_calls']} | {r['upgraded_calls']} | "
                     f"{r['num_switch_calls']} | {r['hit_rate']:.3f} | {r['llm_call_latency_mean_s']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    policies = sorted({r["policy"] for r in result["rows"]})
    styles = {"sticky": "s--", "cache-aware": "o-"}
    for pi, policy in enumerate(policies):
        color = f"C{pi}"
        for router, style in styles.items():
            pts = [r for r in result["rows"] if r["policy"] == policy and r["router"].startswith(router + " ")]
            pts.sort(key=lambda r: r["accuracy_proxy"])
            ax.plot([r["accuracy_proxy"] for r in pts], [r["cost_vs_fixed"] for r in pts], style, color=color,
                    label=f"{router} / {policy}", alpha=0.85)
            for r in pts:
                ax.annotate(r["router"].split("=")[1], (r["accuracy_proxy"], r["cost_vs_fixed"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points", color=color)
        fixed = [r for r in result["rows"] if r["policy"] == policy and r["router"] == "fixed"]
        ax.plot([r["accuracy_proxy"] for r in fixed], [r["cost_vs_fixed"] for r in fixed], "*", ms=13,
                color=color, label=f"fixed / {policy}")
    ax.set_xlabel("accuracy proxy (share of calls not downgraded below the recorded model)")
    ax.set_ylabel("routed token cost / fixed router, no shadow")
    ax.set_title(f"{result['config']['workload']} {'/'.join(result['config']['models'])}: routers (labels: lam)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def merge(paths: list[str]) -> dict:
    """One result from several runs of this script on the same sessions (e.g. more knob values later): the
    fixed rows must agree (same seed, same sessions), the other rows are pooled."""
    results = [json.loads((Path(p) / "tradeoff.json").read_text()) for p in paths]
    rows: dict = {}
    for res in results:
        for r in res["rows"]:
            key = (r["router"], r["policy"])
            if key in rows and r["router"] == "fixed" and rows[key]["token_cost"] != r["token_cost"]:
                raise SystemExit(f"--merge: the fixed router's {r['policy']} cost differs between runs; "
                                 "not the same sessions")
            rows.setdefault(key, r)
    order = {"fixed": 0, "sticky": 1, "cache-aware": 2}
    policies = results[0]["config"]["policies"]

    def rank(r):
        lam = float(r["router"].split("=")[1]) if "=" in r["router"] else 0.0
        return order[r["router"].split(" ")[0]], -lam, policies.index(r["policy"])

    pooled = sorted(rows.values(), key=rank)
    config = {**results[0]["config"], "knobs": sorted({k for res in results for k in res["config"]["knobs"]},
                                                      reverse=True), "merged_from": paths}
    return {"config": config, "rows": pooled}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="fusionbench")
    p.add_argument("--pair", default="Q2.5-7B/L3.1-70B")
    p.add_argument("--policies", default="no-shadow,harvest-slo+host")
    p.add_argument("--knobs", default="1.0,0.9,0.75,0.5", help="lam values of the sticky and cache-aware routers")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--warmup", type=float, default=30.0)
    p.add_argument("--session-rate", type=float, default=0.2, help="sessions/s (FusionBench default 0.05 gives "
                   "only ~6 measured sessions in 120 s)")
    p.add_argument("--rho", type=float, default=0.7)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/router_tradeoff", help="output directory")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="do not simulate: pool the tradeoff.json of earlier "
                   "runs (same sessions; costs are relative to the same fixed run) into --out")
    args = p.parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tradeoff.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "tradeoff.png")
        print(table(result))
        return 0
    try:
        args.knobs = [float(v) for v in args.knobs.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--knobs: expected numbers, got {args.knobs!r}") from None
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tradeoff.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "tradeoff.png")
    print(table(result))
    print(f"wrote {out / 'tradeoff.json'} and {out / 'tradeoff.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
