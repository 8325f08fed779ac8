"""The headline study (`shadowprefill demo`, `make demo`): the paper's §5.2 comparison on a GHCP-like and a
FusionBench-like workload, as seeds × windows runs of the same policies, each reduction aggregated as
mean ± standard error over the runs ("3 seeds × 3 windows ... error bars: ±1 SE", §5.1), and printed side
by side with the paper's headline numbers.

    study = run_study(StudySpec(seeds=(0,), duration_s={"fusionbench": 300, "ghcp-coding": 300}))
    print(study_table(study))

Every run is one `Experiment` (same sessions and normal traffic for all its policies, compared over the
calls that complete under all of them); runs go to a process pool. The paper's protocol is
`--seeds 0,1,2 --windows peak,median,trough` with 600 s (1,800 s for GHCP) measured after 120 s.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shadowprefill.cluster.workloads import get_workload
from shadowprefill.model.catalog import PAIRS, get_model
from shadowprefill.sim.experiment import (
    WINDOW_LOAD,
    Experiment,
    parse_models,
    run_experiment,
)
from shadowprefill.sim.report import PAPER_HEADLINES

STUDY_POLICIES = ("no-shadow", "harvest-slo+host", "oracle+host")
# Baseline observables kept per run beside METRICS (issue 25, item 4; see docs/paper-comparison.md).
OBSERVABLES = ("num_switch_calls", "num_calls", "switch_call_latency_mean_s", "same_model_call_latency_mean_s",
               "llm_call_latency_mean_s", "switch_call_ttft_mean_s", "same_model_hit_rate", "switch_hit_rate",
               "shadow_over_budget_fraction", "shadow_budget_ratio_max")
PAPER_DURATION_S = {"fusionbench": 600.0, "ghcp-coding": 1800.0}     # §5.1 "Measurement"
# The short default study's session rate (sessions/s, both workloads): 2x FusionBench's and 5x GHCP's
# (appendix D.1 rates 0.05 and 0.02), for more switch calls per simulated second; --paper-length keeps theirs.
DEMO_SESSION_RATE = 0.1
METRICS = (   # (summary key, label)
    ("switch_call_latency_mean_s_reduction_pct", "switch-call latency red. (%)"),
    ("switch_call_ttft_mean_s_reduction_pct", "switch-call TTFT red. (%)"),
    ("llm_call_latency_mean_s_reduction_pct", "LLM-call latency red. (%)"),
    ("token_cost_reduction_pct", "token cost red. (%)"),
    ("switch_hit_rate", "switch-call hit rate"),
    ("hit_rate", "hit rate"),
    ("normal_slo_attainment_change_pp", "normal SLO change (pp)"),
    ("energy_per_good_request_increase_pct", "energy/good request change (%)"),
)


@dataclass
class StudySpec:
    """Which runs make up the study. `duration_s`: measured seconds per workload (warm-up `warmup_s` is
    added); `capacity`: requests/s per instance per model (skips calibration); `session_rate`: sessions/s (default:
    the workload's); `jobs`: parallel processes
    (default: CPU count); `admission`: the engines' admission order ("fcfs", the paper's; "routed-first")."""

    workloads: tuple[str, ...] = ("ghcp-coding", "fusionbench")
    pair: str = "Q2.5-7B/L3.1-70B"
    pairs: tuple[str, ...] = ()          # ("paper",): each workload's Table 3 pairs; else labels (overrides pair)
    seeds: tuple[int, ...] = (0,)
    windows: tuple[str, ...] = ("peak", "median", "trough")
    duration_s: dict = field(default_factory=lambda: {"fusionbench": 300.0, "ghcp-coding": 300.0})
    warmup_s: float = 120.0
    max_drain_s: float = 900.0
    policies: tuple[str, ...] = STUDY_POLICIES
    rho: float = 0.7
    capacity: dict = field(default_factory=dict)
    session_rate: float | None = None
    jobs: int | None = None
    admission: str = "fcfs"

    def __post_init__(self) -> None:
        if not self.workloads or not self.seeds or not self.windows:
            raise ValueError("workloads, seeds and windows must not be empty")
        bad = [w for w in self.windows if w not in WINDOW_LOAD]
        if bad:
            raise ValueError(f"windows: unknown {bad}; known: {list(WINDOW_LOAD)}")
        for w in self.workloads:
            get_workload(w)          # ValueError naming the unknown workload
        if "no-shadow" not in self.policies:
            raise ValueError("policies must include no-shadow (every reduction is relative to it)")

    def pairs_of(self, workload: str) -> list[str]:
        """The pair labels run on `workload`: `pair`, or `pairs` ("paper": its Table 3 pairs)."""
        if not self.pairs:
            return [self.pair]
        if "paper" in self.pairs:
            if workload not in PAIRS:
                raise ValueError(f"pairs: workload {workload!r} has no Table 3 pairs; known: {sorted(PAIRS)}")
            return list(PAIRS[workload])
        return list(self.pairs)

    def experiments(self) -> list[Experiment]:
        return [Experiment(workload=w, models=parse_models(pair), policies=list(self.policies),
                           duration_s=float(self.duration_s.get(w, 300.0)), warmup_s=self.warmup_s, rho=self.rho,
                           seed=s, window=win, capacity=dict(self.capacity),
                           session_rate=self.session_rate,
                           sim={"max_drain_s": self.max_drain_s, "admission": self.admission})
                for w in self.workloads for pair in self.pairs_of(w) for s in self.seeds for win in self.windows]


def _run_one(exp: Experiment) -> tuple[dict, dict]:
    result = run_experiment(exp)
    keep = {p: {k: v for k, v in summary.items() if k != "run"} for p, summary in result["policies"].items()}
    return exp.as_dict(), keep


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value); NaNs are dropped."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def aggregate(runs: list[tuple[dict, dict]]) -> dict:
    """{workload: {policy: {metric: (mean, se, n)}}} plus the share of Oracle+Host's switch-latency gain
    (ratio of the mean reductions, as the paper's "captures 52% of the latency gain of an oracle")."""
    out: dict = {}
    for config, summaries in runs:
        w = out.setdefault(config["workload"], {})
        for policy, summary in summaries.items():
            slot = w.setdefault(policy, {})
            for key in dict.fromkeys([k for k, _ in METRICS] + list(OBSERVABLES)):
                slot.setdefault(key, []).append(summary.get(key))
            sw, same = summary.get("switch_call_latency_mean_s"), summary.get("same_model_call_latency_mean_s")
            slot.setdefault("switch_same_ratio", []).append(sw / same if sw and same else None)
    for policies in out.values():
        _reduce(policies)
    return out


def _reduce(policies: dict) -> None:
    """{policy: {metric: [values]}} -> {policy: {metric: (mean, se, n)}} in place, plus the share of
    Oracle+Host's switch-latency gain (ratio of the mean reductions) when both ran."""
    for slot in policies.values():
        for key in list(slot):
            m, se = mean_se(slot[key])
            slot[key] = (m, se, len(slot[key]))
    ours, oracle = policies.get("harvest-slo+host"), policies.get("oracle+host")
    key = "switch_call_latency_mean_s_reduction_pct"
    if ours and oracle and oracle[key][0] > 0:
        policies["share_of_oracle_gain"] = ours[key][0] / oracle[key][0]


def pair_label(models) -> str:
    """"Q2.5-7B/L3.1-70B" of a (small, large) pair of catalog names."""
    return "/".join(get_model(m).label for m in models)


def aggregate_pairs(runs: list[tuple[dict, dict]]) -> dict:
    """Per workload and pair, `aggregate` of that pair's runs, and the paper's "mean over pairs": each metric
    as (mean of the per-pair means, SE over pairs, number of pairs), with Oracle+Host's share from the means.
    {"per_pair": {workload: {pair: aggregate}}, "means": {workload: {policy: {metric: (m, se, n)}}}}."""
    groups: dict = {}
    for config, summaries in runs:
        groups.setdefault(config["workload"], {}).setdefault(pair_label(config["models"]), []).append(
            (config, summaries))
    per_pair = {w: {p: aggregate(rs)[w] for p, rs in pairs.items()} for w, pairs in groups.items()}
    means: dict = {}
    for w, pairs in per_pair.items():
        out = means.setdefault(w, {})
        for agg in pairs.values():
            for policy, slot in agg.items():
                if policy == "share_of_oracle_gain":
                    continue
                for key, (m, _, _) in slot.items():
                    out.setdefault(policy, {}).setdefault(key, []).append(m)
        _reduce(out)
    return {"per_pair": per_pair, "means": means}


def breakdown(runs: list[tuple[dict, dict]]) -> dict:
    """Figures 9a and 9c: per workload, policy and bin (target size; context before the switch), the
    switch-call latency reduction vs No Shadow over all runs and pairs, call-weighted (1 - summed latency /
    No Shadow's summed latency over the same calls), the number of switch calls, and their token-weighted
    hit rate (nan where the runs carry no `switch_hits`, as studies written before it):
    {workload: {"by_target" | "by_context": {policy: {bin: (reduction_pct, n, hit_rate)}}}}."""
    sums: dict = {}
    for config, summaries in runs:
        for policy, summary in summaries.items():
            hits = summary.get("switch_hits", {})
            for cut, bins in summary.get("switch_breakdown", {}).items():
                slot = sums.setdefault(config["workload"], {}).setdefault(cut, {}).setdefault(policy, {})
                for b, (lat, n) in bins.items():
                    acc = slot.setdefault(b, [0.0, 0, 0, 0])
                    acc[0] += lat
                    acc[1] += n
                    prompt, cached = hits.get(cut, {}).get(b, (0, 0))
                    acc[2] += prompt
                    acc[3] += cached
    out: dict = {}
    for w, cuts in sums.items():
        for cut, policies in cuts.items():
            base = policies.get("no-shadow", {})
            for policy, bins in policies.items():
                out.setdefault(w, {}).setdefault(cut, {})[policy] = {
                    b: ((100.0 * (1.0 - lat / base[b][0]) if base.get(b) and base[b][0] > 0 else math.nan), n,
                        cached / prompt if prompt else math.nan)
                    for b, (lat, n, prompt, cached) in bins.items()}
    return out


# The paper's Figure 9 values where its text gives them (§5.5): Harvest-SLO+Host's switch-call latency
# reduction by target size and below 2K / beyond 64K tokens of context.
PAPER_BREAKDOWN = {"by_target": {"<15B": 12.0, "15-50B": 4.0, ">50B": 3.0},
                   "by_context": {"<2K": 0.7, ">64K": 20.5}}


def breakdown_table(study: dict) -> str:
    """Figure 9a/9c as text: per workload and cut, each policy's reduction per bin (n calls), the paper's."""
    from shadowprefill.sim.metrics import CONTEXT_BINS, TARGET_BINS
    lines = []
    for w, cuts in study.get("breakdown", {}).items():
        for cut, bins, fig, what in (("by_target", TARGET_BINS, "9a", "target-model size"),
                                     ("by_context", CONTEXT_BINS, "9c", "context before the switch")):
            policies = cuts.get(cut, {})
            lines.append(f"\n== {w}: switch-call latency reduction (%) by {what} (Figure {fig}), "
                         "call-weighted over all runs and pairs; (n switch calls)")
            lines.append("  " + f"{'policy':18s}" + "".join(f"{b:>15s}" for b, _ in bins))
            for policy, row in policies.items():
                if policy == "no-shadow":
                    continue
                cells = "".join(f"{row[b][0]:7.1f} ({row[b][1]:4d})" if row[b][1] else f"{'-':>15s}"
                                for b, _ in bins)
                lines.append(f"  {policy:18s}{cells}")
            paper = PAPER_BREAKDOWN[cut]
            lines.append("  " + f"{'paper (H-SLO+Host)':18s}" + "".join(
                f"{paper[b]:15.1f}" if b in paper else f"{'':15s}" for b, _ in bins))
    return "\n".join(lines)


def default_study_models() -> tuple[str, ...]:
    """The models of the default study and of the paper's protocol (`--paper-length`): their capacities
    ship with the package (`sim/data/capacity.json`)."""
    return parse_models(StudySpec.pair)


def run_study(spec: StudySpec, log=None, *, ray: bool = False, ray_address: str | None = None) -> dict:
    """Run every experiment of `spec` (a process pool of `spec.jobs`, or Ray tasks with `ray` /
    `ray_address`) and aggregate them; runs are kept in `spec.experiments()` order either way."""
    from shadowprefill.sim.runner import map_jobs
    exps = spec.experiments()
    jobs = max(1, min(spec.jobs or os.cpu_count() or 1, len(exps)))
    start = time.perf_counter()
    # capacities: shipped with the package for the default models; anything else is calibrated once, here,
    # so that local workers find it cached
    from shadowprefill.sim.capacity import normal_rates
    from shadowprefill.sim.experiment import sim_config
    for models in dict.fromkeys(e.models for e in exps):
        exp = next(e for e in exps if e.models == models)
        normal_rates(models, sim_config(exp), spec.rho, capacity=spec.capacity, log=log)
    runs = map_jobs(_run_one, exps, jobs=jobs, ray=ray, ray_address=ray_address, desc="runs",
                    progress=log is not None)
    out = {"spec": asdict(spec), "runs": runs, "aggregate": aggregate(runs), "breakdown": breakdown(runs),
           "wall_s": time.perf_counter() - start}
    if spec.pairs:                     # the paper's numbers are means over pairs: so are ours
        by_pair = aggregate_pairs(runs)
        out["aggregate"], out["per_pair"] = by_pair["means"], by_pair["per_pair"]
    return out


def _paper_value(workload: str, key: str, policy: str):
    group = "ghcp" if workload.startswith("ghcp") else "benchmarks"
    paper = PAPER_HEADLINES[group]
    names = {"switch_call_latency_mean_s_reduction_pct": "switch_call_latency",
             "switch_call_ttft_mean_s_reduction_pct": "switch_call_ttft",
             "llm_call_latency_mean_s_reduction_pct": "llm_call_latency", "token_cost_reduction_pct": "token_cost"}
    if policy == "harvest-slo+host" and key in names:
        return paper[names[key]]
    if policy == "oracle+host" and key == "switch_call_latency_mean_s_reduction_pct":
        return paper["oracle_switch_call_latency"]
    if policy == "oracle+host" and key == "llm_call_latency_mean_s_reduction_pct":
        return paper["oracle_llm_call_latency"]
    hit = {"no-shadow": "hit_rate_no_shadow", "harvest-slo+host": "hit_rate", "oracle+host": "hit_rate_oracle_host"}
    if key == "hit_rate" and policy in hit:
        return paper[hit[policy]] / 100.0
    return None


def study_table(study: dict) -> str:
    """Per workload: each policy's metrics as mean ± SE over the runs, beside the paper's headline number."""
    lines = []
    spec = study["spec"]
    n_runs = len(spec["seeds"]) * len(spec["windows"])
    for workload, policies in study["aggregate"].items():
        group = "GHCP-coding" if workload.startswith("ghcp") else "benchmarks (xRouteBench, FusionBench, Router-R1)"
        lines.append(f"\n== {workload}, {spec['pair']}: {n_runs} runs (seeds {list(spec['seeds'])} x windows "
                     f"{list(spec['windows'])}), mean ± SE; paper: {group} mean")
        for policy in spec["policies"]:
            if policy == "no-shadow" or policy not in policies:
                continue
            slot = policies[policy]
            lines.append(f"  {policy}")
            for key, label in METRICS:
                m, se, _ = slot[key]
                paper = _paper_value(workload, key, policy)
                scale = 100.0 if key.endswith("hit_rate") else 1.0
                ours = f"{m * scale:7.1f} ± {se * scale:4.1f}"
                ref = "" if paper is None else f"{paper * scale:8.1f}"
                lines.append(f"    {label:34s}{ours:>16s}{ref:>10s}")
        base = policies.get("no-shadow")
        if base:
            m, se, _ = base["hit_rate"]
            paper = _paper_value(workload, "hit_rate", "no-shadow")
            lines.append(f"  no-shadow hit rate (%){'':15s}{m * 100:7.1f} ± {se * 100:4.1f}{paper * 100:10.1f}")
            sw = base["num_switch_calls"][0]
            lines.append(f"  switch calls per run (mean)        {sw:9.1f}")
        share = policies.get("share_of_oracle_gain")
        if share is not None:
            paper = PAPER_HEADLINES["ghcp" if workload.startswith("ghcp") else "benchmarks"]["gain_vs_oracle"]
            lines.append(f"  share of Oracle+Host switch-latency gain captured by Harvest-SLO+Host: {share:.2f} "
                         f"(paper {paper:.2f})")
    return "\n".join(lines)


def _save(fig, out: Path, name: str) -> Path:
    from shadowprefill.sim.report import _pyplot
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_study(study: dict, out_dir: str | Path) -> Path:
    """One panel per workload: each policy's four reductions with ±1 SE bars, the paper's as markers."""
    from shadowprefill.sim.report import _pyplot
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    agg, spec = study["aggregate"], study["spec"]
    keys = METRICS[:4]
    fig, axes = plt.subplots(1, len(agg), figsize=(6.5 * len(agg), 4.2), squeeze=False)
    for ax, (workload, policies) in zip(axes[0], agg.items()):
        shown = [p for p in spec["policies"] if p != "no-shadow" and p in policies]
        width = 0.8 / max(1, len(shown))
        for i, policy in enumerate(shown):
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(keys))]
            ms = [policies[policy][k][0] for k, _ in keys]
            ses = [policies[policy][k][1] for k, _ in keys]
            ax.bar(xs, ms, width, yerr=ses, capsize=3, label=policy)
            for x, (k, _) in zip(xs, keys):
                ref = _paper_value(workload, k, policy)
                if ref is not None:
                    ax.plot([x], [ref], marker="D", markersize=6, color="black", linestyle="none",
                            label="paper" if (i, k) == (0, keys[0][0]) else None)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([label.replace(" red. (%)", "") for _, label in keys], rotation=15)
        ax.set_ylabel("reduction vs No Shadow (%)")
        ax.set_title(f"{workload} ({spec['pair']}), ±1 SE over {len(spec['seeds']) * len(spec['windows'])} runs")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.legend(fontsize=8)
    return _save(fig, out, "study_reductions.png")


PAIR_COLUMNS = (("switch_call_latency_mean_s_reduction_pct", "switch lat."),
                ("llm_call_latency_mean_s_reduction_pct", "LLM-call lat."),
                ("switch_call_ttft_mean_s_reduction_pct", "switch TTFT"),
                ("token_cost_reduction_pct", "token cost"))


def pairs_table(study: dict) -> str:
    """Per workload and pair: each policy's reductions (mean ± SE over that pair's runs), then the mean over
    pairs beside the paper's mean over its pairs."""
    lines = []
    for w, pairs in study["per_pair"].items():
        lines.append(f"\n== {w}: per pair (reduction vs No Shadow, %, mean ± SE over the pair's runs)")
        lines.append(f"  {'pair':22s}{'policy':18s}" + "".join(f"{label:>17s}" for _, label in PAIR_COLUMNS)
                     + f"{'cold switch (s)':>17s}")
        for pair, agg in pairs.items():
            for policy in study["spec"]["policies"]:
                if policy == "no-shadow" or policy not in agg:
                    continue
                cells = "".join(f"{agg[policy][k][0]:9.1f} ± {agg[policy][k][1]:4.1f}" for k, _ in PAIR_COLUMNS)
                cold = agg["no-shadow"]["switch_call_latency_mean_s"][0]
                lines.append(f"  {pair:22s}{policy:18s}{cells}{cold:17.2f}")
        means = study["aggregate"][w]
        lines.append(f"  {'mean over pairs':22s}")
        for policy in study["spec"]["policies"]:
            if policy == "no-shadow" or policy not in means:
                continue
            cells = "".join(f"{means[policy][k][0]:9.1f} ± {means[policy][k][1]:4.1f}" for k, _ in PAIR_COLUMNS)
            lines.append(f"  {'':22s}{policy:18s}{cells}")
            paper = [_paper_value(w, k, policy) for k, _ in PAIR_COLUMNS]
            if any(v is not None for v in paper):
                lines.append(f"  {'':22s}{'  paper':18s}" + "".join(
                    f"{v:17.1f}" if v is not None else f"{'':17s}" for v in paper))
    return "\n".join(lines)


def plot_pairs(study: dict, out_dir: str | Path) -> Path:
    """Per workload: switch-call latency reduction of each shown policy on every pair (±1 SE over the pair's
    runs), the mean over pairs as a dashed line and the paper's mean over its pairs as a diamond."""
    from shadowprefill.sim.report import _pyplot
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = "switch_call_latency_mean_s_reduction_pct"
    per_pair = study["per_pair"]
    fig, axes = plt.subplots(1, len(per_pair), figsize=(6.5 * len(per_pair), 4.2), squeeze=False)
    for ax, (w, pairs) in zip(axes[0], per_pair.items()):
        shown = [p for p in study["spec"]["policies"] if p != "no-shadow"]
        width = 0.8 / max(1, len(shown))
        labels = list(pairs)
        for i, policy in enumerate(shown):
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(labels))]
            ms = [pairs[p][policy][key][0] if policy in pairs[p] else math.nan for p in labels]
            ses = [pairs[p][policy][key][1] if policy in pairs[p] else 0.0 for p in labels]
            bars = ax.bar(xs, ms, width, yerr=ses, capsize=3, label=policy)
            mean = study["aggregate"][w].get(policy, {}).get(key, (math.nan,))[0]
            ax.axhline(mean, color=bars.patches[0].get_facecolor(), linestyle="--", linewidth=1)
            ref = _paper_value(w, key, policy)
            if ref is not None:
                ax.plot([len(labels) - 0.4], [ref], marker="D", color=bars.patches[0].get_facecolor(),
                        markeredgecolor="black", linestyle="none", label=f"paper mean, {policy}")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_ylabel("switch-call latency reduction (%)")
        ax.set_title(f"{w}: per pair (dashed: mean over pairs)", fontsize=9)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.3 * (high - low))          # headroom: the legend sits above the bars
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    return _save(fig, out, "pairs_switch_latency.png")


FIGURE4_PANELS = (("llm_call_latency_mean_s_reduction_pct", "all LLM calls"),
                  ("switch_call_latency_mean_s_reduction_pct", "switch calls"))


def plot_policies(study: dict, out_dir: str | Path) -> Path:
    """The paper's Figure 4 layout: per workload, the reduction of (a) all LLM calls' and (b) switch calls'
    latency against No Shadow for every policy of the study, ±1 SE bars, the paper's published value as a
    diamond where it gives one (Harvest-SLO+Host's mean, and Oracle's bound, drawn on Oracle+Host)."""
    from shadowprefill.sim.report import _pyplot
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    agg, spec = study["aggregate"], study["spec"]
    fig, axes = plt.subplots(len(agg), len(FIGURE4_PANELS), figsize=(12, 3.6 * len(agg)), squeeze=False)
    n_runs = len(spec["seeds"]) * len(spec["windows"])
    for row, (workload, policies) in zip(axes, agg.items()):
        shown = [p for p in spec["policies"] if p in policies]
        for ax, (key, label) in zip(row, FIGURE4_PANELS):
            ms = [policies[p][key][0] for p in shown]
            ses = [policies[p][key][1] for p in shown]
            colors = ["tab:red" if p == "harvest-slo+host" else "lightgrey" if p == "eager" else "tab:blue"
                      for p in shown]
            ax.bar(range(len(shown)), ms, 0.7, yerr=ses, capsize=3, color=colors)
            for x, (p, m) in enumerate(zip(shown, ms)):          # labels: the bar's value, as the paper's
                if p == "harvest-slo+host" and not math.isnan(m):
                    ax.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
                ref = _paper_value(workload, key, p)
                if ref is not None:
                    ax.plot([x], [ref], marker="D", color="black", linestyle="none",
                            label="paper (mean over pairs)" if p == "harvest-slo+host" else None)
            ax.set_xticks(range(len(shown)))
            ax.set_xticklabels(shown, rotation=35, ha="right", fontsize=8)
            ax.axhline(0, color="grey", linewidth=0.8)
            ax.set_ylabel("latency reduction vs No Shadow (%)")
            ax.set_title(f"{workload} ({spec['pair']}): {label}, ±1 SE over {n_runs} runs", fontsize=9)
            if any(_paper_value(workload, key, p) is not None for p in shown):
                ax.legend(fontsize=7)
    return _save(fig, out, "figure4_policies.png")


# ------------------------------------------------------------------------------------------------ CLI
def register(subparsers) -> None:
    """Adds `shadowprefill demo` (the main job: the headline study at paper defaults, reduced length)."""
    from shadowprefill.sim.args import WARMUP_S, add_admission_argument, add_ray_arguments
    from shadowprefill.sim.policies import POLICIES
    from shadowprefill.usage import nonneg_float, positive_float, positive_int
    p = subparsers.add_parser("demo", help="the paper's headline comparison (GHCP-like and FusionBench-like "
                                           "workloads), printed beside the paper's numbers, with figures",
                              description="The headline study (`make demo`): seeds x windows runs per workload, "
                                          "each reduction against No Shadow as mean ± SE over the runs, beside "
                                          "the paper's numbers; writes study.json and figures to --out.")
    p.add_argument("--workloads", default="ghcp-coding,fusionbench", help="comma-separated session generators")
    p.add_argument("--pair", default=StudySpec.pair, help="two different models, SMALL/LARGE")
    p.add_argument("--pairs", help="'paper': every Table 3 pair of each workload (per-pair results and the mean "
                                   "over pairs beside the paper's means); or comma-separated pair labels")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (paper: 0,1,2)")
    p.add_argument("--windows", default="peak,median,trough",
                   help="comma-separated measurement windows (normal load x 1, 0.5, 0.25 of the peak hour)")
    p.add_argument("--duration", type=positive_float, default=300.0,
                   help="measured simulated seconds per run (paper: 600; 1800 for GHCP; see --paper-length)")
    p.add_argument("--paper-length", action="store_true",
                   help="the paper's run lengths and each workload's own session rate")
    p.add_argument("--warmup", type=nonneg_float, default=WARMUP_S,
                   help="simulated seconds before the measured window (the paper: 120)")
    p.add_argument("--session-rate", type=positive_float,
                   help=f"sessions per second (default: {DEMO_SESSION_RATE}; with --paper-length each workload's)")
    p.add_argument("--policies", default=",".join(STUDY_POLICIES),
                   help=f"comma-separated, must include no-shadow ({', '.join(POLICIES)})")
    p.add_argument("--all-policies", action="store_true",
                   help="all ten policies of Table 2 (overrides --policies) and the Figure 4 chart of them")
    p.add_argument("--capacity", help="per-instance capacity, MODEL=REQ_S[,MODEL=REQ_S] (skips calibration), or "
                                      "'paper': the paper's testbed capacities (appendix D.1; Qwen2.5-7B=12.8,"
                                      "Llama-3.1-8B=11.0,Llama-3.1-70B=3.8)")
    p.add_argument("--jobs", type=positive_int, help="parallel processes (default: CPU count)")
    p.add_argument("--out", default="demo_out", help="directory for study.json and the figures")
    add_admission_argument(p)
    add_ray_arguments(p)
    p.set_defaults(func=_demo)


def spec_from_args(args) -> StudySpec:
    """The `StudySpec` of `demo`'s arguments (ValueError naming a bad one)."""
    from shadowprefill.sim.args import check_pair, parse_capacity
    from shadowprefill.sim.policies import parse_policies
    from shadowprefill.usage import comma_list
    workloads = tuple(comma_list(args.workloads))
    if args.paper_length:
        duration, warmup, rate = dict(PAPER_DURATION_S), args.warmup, args.session_rate
    else:
        duration, warmup = {w: args.duration for w in workloads}, args.warmup
        rate = DEMO_SESSION_RATE if args.session_rate is None else args.session_rate
    pairs = tuple(comma_list(args.pairs)) if getattr(args, "pairs", None) else ()
    spec = StudySpec(workloads=workloads, pair=args.pair, pairs=pairs, seeds=tuple(comma_list(args.seeds, int, "--seeds integer")),
                     capacity=parse_capacity(args.capacity), windows=tuple(comma_list(args.windows)),
                     duration_s=duration, warmup_s=warmup, session_rate=rate,
                     policies=tuple(p.name for p in parse_policies("all" if getattr(args, "all_policies", False) else args.policies)),
                     jobs=args.jobs, admission=getattr(args, "admission", "fcfs"))
    if any(s < 0 for s in spec.seeds):
        raise ValueError(f"--seeds must be integers >= 0, got {args.seeds!r}")
    if not spec.pairs:
        check_pair(spec.experiments()[0].models, args.pair)     # parse_models validates the names
    for w in spec.workloads:
        spec.pairs_of(w)             # validates --pairs paper against the workloads
    spec.experiments()               # validates the pairs
    return spec


def _demo(args) -> int:
    from shadowprefill.sim.args import check_ray
    from shadowprefill.usage import user_input
    use_ray = check_ray(args)
    with user_input():
        spec = spec_from_args(args)
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
    n = len(spec.experiments())
    pairs = {w: spec.pairs_of(w) for w in spec.workloads}
    where = ("Ray tasks" + (f" on {args.ray_address}" if args.ray_address else "") if use_ray
             else f"{spec.jobs or os.cpu_count()} processes")
    log = functools.partial(print, file=sys.stderr, flush=True)        # progress and logs: stderr
    log(f"shadowprefill demo: {n} runs ({', '.join(spec.workloads)} x seeds {list(spec.seeds)} x windows "
        f"{list(spec.windows)}), policies {', '.join(spec.policies)}, pairs {pairs}, {where}")
    study = run_study(spec, log=log, ray=use_ray, ray_address=args.ray_address)
    print(study_table(study))
    if "per_pair" in study:
        print(pairs_table(study))
    print(breakdown_table(study))
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({k: v for k, v in study.items()}, indent=1, default=str))
    figs = [plot_study(study, out)] + ([plot_policies(study, out)] if getattr(args, "all_policies", False) else [])
    if "per_pair" in study:
        figs.append(plot_pairs(study, out))
    print(f"\nwall time {study['wall_s']:.0f} s")
    for path in [out / "study.json", *figs]:
        print(f"wrote {path}")
    return 0
