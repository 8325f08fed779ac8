"""Markdown tables for docs/paper-comparison.md from `shadowprefill demo` outputs (study.json):
the baseline observables beside the paper's, the per-pair table with the mean over pairs, and the
Figure 9a / 9c breakdowns.

    python bench/paper_comparison.py demo_out/study.json [more study.json ...]
    python bench/paper_comparison.py --merge fb/study.json ghcp_*/study.json   # one table over all pairs
    python bench/paper_comparison.py --merge --plot docs/img runs/*/study.json  # and the per-pair bar chart
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shadowprefill.cluster.workloads import TABLE1  # noqa: E402
from shadowprefill.sim.metrics import CONTEXT_BINS, TARGET_BINS, target_bin  # noqa: E402
from shadowprefill.sim.paper_point import PAPER_OBSERVABLES, PAPER_TESTBED_CAPACITY, paper_group  # noqa: E402
from shadowprefill.sim.study import PAPER_BREAKDOWN, _paper_value  # noqa: E402

RED = "llm_call_latency_mean_s_reduction_pct"
SW = "switch_call_latency_mean_s_reduction_pct"


def _fmt(cell, scale=1.0, digits=1):
    if cell is None:
        return "–"
    m, se, _ = cell
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "–"
    return f"{m * scale:.{digits}f} ± {se * scale:.{digits}f}"


def observables(study: dict) -> list[str]:
    rows = ["| workload | pairs × runs | No Shadow hit rate (%) | cold switch call (s) | same-model call (s) | "
            "switch / same-model | Host Tier LLM-call cut (%) | Eager LLM-call cut (%) | Harvest-SLO+Host "
            "LLM-call cut (%) |", "|---|---|---|---|---|---|---|---|---|"]
    for w, pol in study["aggregate"].items():
        paper = PAPER_OBSERVABLES[paper_group(w)]
        pairs = study.get("per_pair", {}).get(w, {})
        n_pairs = len(pairs) or 1
        if len(pairs) == 1:          # one pair: its own aggregate (± SE over runs, not over pairs)
            pol = next(iter(pairs.values()))
        base = pol["no-shadow"]
        runs = sum(c["workload"] == w for c, _ in study["runs"]) // n_pairs

        def p(v):
            return "" if v is None else f" ({v})"
        t1 = TABLE1.get(w)     # Table 1: this workload's No Shadow hit rate (the group's mean otherwise)
        hit = f"{100 * t1.hit_rate:.1f}, Table 1" if t1 else paper["no_shadow_hit_rate"]
        rows.append(
            f"| {w} | {n_pairs} × {runs} | {_fmt(base['hit_rate'], 100)}{p(hit)} | "
            f"{_fmt(base['switch_call_latency_mean_s'], digits=2)}{p(paper['cold_switch_s'])} | "
            f"{_fmt(base['same_model_call_latency_mean_s'], digits=2)} | "
            f"{_fmt(base['switch_same_ratio'], digits=2)}{p(paper['switch_same_ratio'])} | "
            f"{_fmt(pol['host-tier'][RED]) if 'host-tier' in pol else 'not run'}{p(paper['host_tier_llm'])} | "
            f"{_fmt(pol['eager'][RED]) if 'eager' in pol else 'not run'}{p(paper['eager_llm'])} | "
            f"{_fmt(pol['harvest-slo+host'][RED]) if 'harvest-slo+host' in pol else 'not run'}"
            f"{p(_paper_value(w, RED, 'harvest-slo+host'))} |")
    return rows


def capacities(study: dict) -> list[str]:
    """Our per-instance capacities of the models run (shipped, or calibrated once) beside the paper's testbed
    numbers (appendix D.1) where it gives one."""
    from shadowprefill.model.catalog import get_model
    from shadowprefill.model.latency import LatencyModel
    from shadowprefill.sim.capacity import normal_rates
    from shadowprefill.sim.experiment import Experiment, sim_config
    rows = ["| model (TP) | ours (req/s) | paper testbed (req/s) | ours / paper |", "|---|---|---|---|"]
    seen = {}
    for config, _ in study["runs"]:
        for m in config["models"]:
            seen.setdefault(m, config)
    for m, config in seen.items():
        cfg = sim_config(Experiment(workload=config["workload"], models=tuple(config["models"])))
        cap = normal_rates([m], cfg, 1.0)[1][m]
        paper = PAPER_TESTBED_CAPACITY.get(m)
        tp = LatencyModel(m, cfg.gpu, tp=cfg.tp.get(m)).tp
        rows.append(f"| {get_model(m).label} ({tp}) | {cap:.2f} | "
                    + (f"{paper} | {cap / paper:.2f} |" if paper else "– | |"))
    return rows


def per_pair(study: dict) -> list[str]:
    keys = (SW, "switch_call_ttft_mean_s_reduction_pct", RED, "token_cost_reduction_pct")
    rows = []
    for w, pairs in study.get("per_pair", {}).items():
        rows += [f"\n{w}:\n", "| pair | policy | switch-call latency | switch-call TTFT | LLM-call latency | "
                 "token cost | switch calls / run | cold switch (s) | No Shadow switch hit (%) |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for pair, agg in pairs.items():
            for policy, slot in agg.items():
                if policy in ("no-shadow", "share_of_oracle_gain"):
                    continue
                base = agg["no-shadow"]
                rows.append(f"| {pair} | {policy} | " + " | ".join(_fmt(slot[k]) for k in keys)
                            + f" | {base['num_switch_calls'][0]:.0f} | {base['switch_call_latency_mean_s'][0]:.2f}"
                            f" | {100 * base['switch_hit_rate'][0]:.1f} |")
        for policy, slot in study["aggregate"][w].items():
            if policy in ("no-shadow", "share_of_oracle_gain"):
                continue
            rows.append(f"| **mean over pairs** (± SE over pairs) | {policy} | "
                        + " | ".join(_fmt(slot[k]) for k in keys) + " | | | |")
            paper = [_paper_value(w, k, policy) for k in keys]
            if any(v is not None for v in paper):
                rows.append(f"| paper, mean over its pairs | {policy} | "
                            + " | ".join("–" if v is None else f"{v:.1f}" for v in paper) + " | | | |")
        share = study["aggregate"][w].get("share_of_oracle_gain")
        if share is not None:
            rows.append(f"\nHarvest-SLO+Host / Oracle+Host switch-call gain (means over pairs): {share:.2f}")
    return rows


def breakdowns(study: dict) -> list[str]:
    rows = []
    for w, cuts in study.get("breakdown", {}).items():
        for cut, bins in (("by_target", TARGET_BINS), ("by_context", CONTEXT_BINS)):
            rows += [f"\n{w}, switch-call latency cut (%) {cut.replace('_', ' ')} (n switch calls):\n",
                     "| policy | " + " | ".join(b for b, _ in bins) + " |", "|---" * (len(bins) + 1) + "|"]
            for policy, row in cuts[cut].items():
                if policy == "no-shadow":
                    continue
                rows.append(f"| {policy} | " + " | ".join(
                    f"{row[b][0]:.1f} ({row[b][1]})" if row[b][1] else "–" for b, _ in bins) + " |")
            paper = PAPER_BREAKDOWN[cut]
            rows.append("| paper, Harvest-SLO+Host | " + " | ".join(
                f"{paper[b]}" if b in paper else "–" for b, _ in bins) + " |")
            hit_rows = [(policy, row) for policy, row in cuts[cut].items()
                        if any(len(row[b]) > 2 and row[b][1] and not math.isnan(row[b][2]) for b, _ in bins)]
            if hit_rows:   # studies written before switch_hits carry none
                rows += [f"\n{w}, switch-call hit rate (%) {cut.replace('_', ' ')} (token-weighted):\n",
                         "| policy | " + " | ".join(b for b, _ in bins) + " |", "|---" * (len(bins) + 1) + "|"]
                rows += [f"| {policy} | " + " | ".join(
                    f"{100 * row[b][2]:.1f}" if row[b][1] else "–" for b, _ in bins) + " |" for policy, row in hit_rows]
    return rows


def by_target_model(study: dict) -> list[str]:
    """Figure 9a split by the model switched to: a pair's target-size bin names one of its two models unless
    both fall in it (then left out), so every study's `switch_breakdown` (and `switch_hits`, where the runs
    carry it) can be summed per target model. Per workload and model: No Shadow's mean switch call, the
    policies' call-weighted switch-latency cut, and the switch hit rates with the share of the No Shadow →
    Oracle+Host hit-rate gap that Harvest-SLO+Host closes."""
    from shadowprefill.model.catalog import get_model
    sums: dict = {}     # (workload, model) -> policy -> [latency, n, prompt, cached]
    for config, summaries in study["runs"]:
        bins: dict = {}
        for m in config["models"]:
            bins.setdefault(target_bin(m), []).append(m)
        for policy, summary in summaries.items():
            hits = summary.get("switch_hits", {}).get("by_target", {})
            for b, (lat, n) in summary.get("switch_breakdown", {}).get("by_target", {}).items():
                if len(bins.get(b, ())) != 1 or not n:
                    continue
                acc = sums.setdefault((config["workload"], bins[b][0]), {}).setdefault(policy, [0.0, 0, 0, 0])
                prompt, cached = hits.get(b, (0, 0))
                acc[0] += lat
                acc[1] += n
                acc[2] += prompt
                acc[3] += cached
    rows = []
    for w in dict.fromkeys(w for w, _ in sums):
        models = sorted((m for ww, m in sums if ww == w), key=lambda m: get_model(m).params_b)
        policies = [p for p in study["spec"]["policies"] if p != "no-shadow"]
        rows += [f"\n{w}, switch calls by the model switched to (pairs whose two models share a size bin left out):\n",
                 "| target | params (B) | bin | switch calls | No Shadow switch call (s) | "
                 + " | ".join(f"{p} cut (%)" for p in policies)
                 + " | switch hit (%): " + " / ".join(["no-shadow"] + policies) + " | H-SLO+Host share of the hit gap |",
                 "|---" * (7 + len(policies)) + "|"]
        for m in models:
            by = sums[(w, m)]
            base = by.get("no-shadow")
            if not base or not base[0]:
                continue
            cuts = " | ".join(f"{100 * (1 - by[p][0] / base[0]):.1f}" if p in by else "–" for p in policies)
            hit = {p: (v[3] / v[2] if v[2] else None) for p, v in by.items()}
            hits = " / ".join("–" if hit.get(p) is None else f"{100 * hit[p]:.1f}" for p in ["no-shadow"] + policies)
            gap = ("–" if None in (hit.get("no-shadow"), hit.get("harvest-slo+host"), hit.get("oracle+host"))
                   or hit["oracle+host"] <= hit["no-shadow"] else
                   f"{(hit['harvest-slo+host'] - hit['no-shadow']) / (hit['oracle+host'] - hit['no-shadow']):.2f}")
            rows.append(f"| {m} | {get_model(m).params_b:.1f} | {target_bin(m)} | {base[1]} | {base[0] / base[1]:.2f} | {cuts} "
                        f"| {hits} | {gap} |")
    return rows


def merge(studies: list[dict]) -> dict:
    """One study of several `demo` outputs of the same protocol: their runs pooled over the policies all of
    them ran (allowed only where every policy of a run finished all its sessions, so that the
    common-call summaries do not change), the per-pair aggregates, means over pairs and breakdowns recomputed."""
    from shadowprefill.sim.study import aggregate_pairs, breakdown
    policies = [p for p in studies[0]["spec"]["policies"] if all(p in st["spec"]["policies"] for st in studies)]
    for st in studies:   # summaries are over the calls common to the policies run: unchanged if all finished
        for _, summaries in st["runs"]:
            if set(summaries) != set(policies) and any(s["sessions_unfinished"] for s in summaries.values()):
                raise ValueError("cannot drop policies from a run in which some policy left sessions unfinished")
    runs = [(config, {p: summaries[p] for p in policies}) for st in studies for config, summaries in st["runs"]]
    spec = dict(studies[0]["spec"], policies=policies)
    for st in studies[1:]:    # seeds and windows may differ (one invocation per seed or window): pooled
        for key in ("warmup_s", "session_rate", "rho", "admission"):
            if st["spec"].get(key) != spec.get(key):
                raise ValueError(f"cannot merge studies with different {key}: {spec.get(key)} vs {st['spec'].get(key)}")
        spec["duration_s"] = {**spec["duration_s"], **st["spec"]["duration_s"]}
        spec["seeds"] = sorted(set(spec["seeds"]) | set(st["spec"]["seeds"]))
        spec["windows"] = [w for w in ("peak", "median", "trough") if w in set(spec["windows"]) | set(st["spec"]["windows"])]
    seen, durations = set(), {}
    for config, _ in runs:
        if durations.setdefault(config["workload"], config["duration_s"]) != config["duration_s"]:
            raise ValueError(f"cannot merge {config['workload']} runs of different durations: "
                             f"{durations[config['workload']]} vs {config['duration_s']}")
        key = (config["workload"], tuple(config["models"]), config["seed"], config["window"])
        if key in seen:
            raise ValueError(f"the same run twice in the merged studies: {key}")
        seen.add(key)
    by_pair = aggregate_pairs(runs)
    return {"spec": spec, "runs": runs, "aggregate": by_pair["means"], "per_pair": by_pair["per_pair"],
            "breakdown": breakdown(runs), "wall_s": sum(st["wall_s"] for st in studies)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("studies", nargs="+", help="study.json files written by `shadowprefill demo`")
    p.add_argument("--merge", action="store_true", help="pool the studies' runs into one (same protocol, "
                                                          "different pairs or workloads)")
    p.add_argument("--plot", metavar="DIR", help="also draw the per-pair bar chart (pairs_switch_latency.png) "
                                                 "of the merged study into DIR (with --merge)")
    args = p.parse_args()
    if args.plot and not args.merge:
        p.error("--plot needs --merge (one chart of the pooled runs)")
    loaded = [json.loads(Path(path).read_text()) for path in args.studies]
    named = [("merged", merge(loaded))] if args.merge else list(zip(args.studies, loaded))
    for path, study in named:
        s = study["spec"]
        print(f"\n### {path}: seeds {s['seeds']}, windows {s['windows']}, {s['duration_s']} s after "
              f"{s['warmup_s']} s, session rate {s['session_rate']}, policies {s['policies']}, "
              f"wall {study['wall_s'] / 60:.1f} min\n")
        print("\n".join(observables(study)))
        print()
        print("\n".join(capacities(study)))
        print("\n".join(per_pair(study)))
        print("\n".join(breakdowns(study)))
        print("\n".join(by_target_model(study)))
    if args.plot:
        from shadowprefill.sim.study import plot_pairs
        print(f"\nchart: {plot_pairs(named[0][1], args.plot)}")


if __name__ == "__main__":
    main()
