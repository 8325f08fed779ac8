"""Tables and paper-style figures of a simulation result (matplotlib, Agg backend; no display needed).

- `format_table(result)`: per-policy metrics and reductions vs No Shadow, as text;
- `paper_table(result, workload)`: our reductions side by side with the paper's headline numbers;
- `write_figures(result, runs, out_dir)`: reductions bar chart (Figures 4-6 style: switch-call latency,
  switch-call TTFT, LLM-call latency, token cost), hit-rate bars (Figure 5e-h), and CDFs of switch-call
  latency and TTFT per policy.
"""
from __future__ import annotations

from pathlib import Path

from shadowprefill.sim.metrics import RunResult, common_call_keys

# The paper's headline numbers (§5.2, abstract): "benchmarks" = xRouteBench, FusionBench, Router-R1 (16
# pairs), "ghcp" = GHCP-coding (6 pairs). Reductions in %, hit rates in %.
PAPER_HEADLINES = {
    "benchmarks": {"switch_call_latency": 10.4, "switch_call_ttft": 44.1, "llm_call_latency": 5.0,
                   "token_cost": 28.5, "oracle_switch_call_latency": 19.3, "oracle_llm_call_latency": 9.6,
                   "hit_rate_no_shadow": 75.0, "hit_rate": 82.1, "hit_rate_oracle_host": 84.4,
                   "gain_vs_oracle": 0.54},
    "ghcp": {"switch_call_latency": 14.3, "switch_call_ttft": 47.0, "llm_call_latency": 9.7, "token_cost": 32.0,
             "oracle_switch_call_latency": 27.4, "oracle_llm_call_latency": 13.8, "hit_rate_no_shadow": 55.4,
             "hit_rate": 76.3, "hit_rate_oracle_host": 81.3, "gain_vs_oracle": 0.52},
}

TABLE_ROWS = (
    ("num_calls", "calls (common)", "{:.0f}"),
    ("num_switch_calls", "switch calls", "{:.0f}"),
    ("switch_call_latency_mean_s", "switch-call latency (s)", "{:.3f}"),
    ("switch_call_ttft_mean_s", "switch-call TTFT (s)", "{:.3f}"),
    ("llm_call_latency_mean_s", "LLM-call latency (s)", "{:.3f}"),
    ("switch_hit_rate", "switch hit rate", "{:.3f}"),
    ("hit_rate", "hit rate", "{:.3f}"),
    ("token_cost", "token cost (USD)", "{:.4f}"),
    ("normal_slo_attainment", "normal SLO attainment", "{:.4f}"),
    ("energy_per_good_request_j", "energy / good request (J)", "{:.1f}"),
    ("shadow_tokens", "shadow tokens", "{:.0f}"),
    ("shadow_tokens_unused", "shadow tokens unused", "{:.0f}"),
    ("switch_call_latency_mean_s_reduction_pct", "switch-call latency red. (%)", "{:.1f}"),
    ("switch_call_ttft_mean_s_reduction_pct", "switch-call TTFT red. (%)", "{:.1f}"),
    ("llm_call_latency_mean_s_reduction_pct", "LLM-call latency red. (%)", "{:.1f}"),
    ("token_cost_reduction_pct", "token cost red. (%)", "{:.1f}"),
    ("normal_slo_attainment_change_pp", "normal SLO change (pp)", "{:+.2f}"),
    ("energy_per_good_request_increase_pct", "energy/good req. change (%)", "{:+.2f}"),
    ("switch_latency_gain_vs_oracle", "share of Oracle+Host gain", "{:.2f}"),
)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(result: dict) -> str:
    """Per-policy metrics as an aligned text table (policies as columns)."""
    policies = result["policies"]
    names = list(policies)
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["metric".ljust(30) + "".join(n.rjust(width) for n in names)]
    for key, label, fmt in TABLE_ROWS:
        if not any(key in policies[n] for n in names):
            continue
        lines.append(label.ljust(30) + "".join(_fmt(fmt, policies[n].get(key)).rjust(width) for n in names))
    return "\n".join(lines)


def paper_table(result: dict, workload: str, ours: str = "harvest-slo+host", oracle: str = "oracle+host") -> str:
    """Our reductions next to the paper's headline numbers for the workload's group."""
    group = "ghcp" if workload.startswith("ghcp") else "benchmarks"
    paper = PAPER_HEADLINES[group]
    pol = result["policies"]
    mine, orc, base = pol.get(ours, {}), pol.get(oracle, {}), pol.get("no-shadow", {})

    def pct(v):
        return None if v is None else 100.0 * v

    rows = [
        ("switch-call latency red. (%)", mine.get("switch_call_latency_mean_s_reduction_pct"),
         paper["switch_call_latency"]),
        ("switch-call TTFT red. (%)", mine.get("switch_call_ttft_mean_s_reduction_pct"), paper["switch_call_ttft"]),
        ("LLM-call latency red. (%)", mine.get("llm_call_latency_mean_s_reduction_pct"), paper["llm_call_latency"]),
        ("token cost red. (%)", mine.get("token_cost_reduction_pct"), paper["token_cost"]),
        ("Oracle+Host switch-call lat. red. (%)", orc.get("switch_call_latency_mean_s_reduction_pct"),
         paper["oracle_switch_call_latency"]),
        ("Oracle+Host LLM-call lat. red. (%)", orc.get("llm_call_latency_mean_s_reduction_pct"),
         paper["oracle_llm_call_latency"]),
        ("hit rate, No Shadow (%)", pct(base.get("hit_rate")), paper["hit_rate_no_shadow"]),
        (f"hit rate, {ours} (%)", pct(mine.get("hit_rate")), paper["hit_rate"]),
        ("hit rate, Oracle+Host (%)", pct(orc.get("hit_rate")), paper["hit_rate_oracle_host"]),
        ("share of Oracle+Host switch gain", mine.get("switch_latency_gain_vs_oracle"), paper["gain_vs_oracle"]),
    ]
    lines = [f"{'metric':40s}{'this run':>12s}{'paper':>10s}   ({workload}; paper: {group} mean)"]
    for label, value, ref in rows:
        lines.append(f"{label:40s}{_fmt('{:.2f}', value):>12s}{ref:>10.2f}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_reductions(result: dict, path: "str | Path") -> Path:
    """Grouped bars: per policy, % reduction of switch-call latency, switch-call TTFT, LLM-call latency
    and token cost relative to No Shadow (Figures 4-6)."""
    plt = _pyplot()
    metrics = [("switch_call_latency_mean_s_reduction_pct", "switch-call latency"),
               ("switch_call_ttft_mean_s_reduction_pct", "switch-call TTFT"),
               ("llm_call_latency_mean_s_reduction_pct", "LLM-call latency"),
               ("token_cost_reduction_pct", "token cost")]
    names = [n for n in result["policies"] if n != "no-shadow"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 3.6))
    width = 0.8 / len(metrics)
    for j, (key, label) in enumerate(metrics):
        values = [result["policies"][n].get(key) or 0.0 for n in names]
        xs = [i + (j - (len(metrics) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, values, width, label=label)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom" if v >= 0 else "top", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("reduction vs No Shadow (%)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_hit_rates(result: dict, path: "str | Path") -> Path:
    """Token-weighted prefix hit rate of all calls and of switch calls per policy (Figure 5e-h)."""
    plt = _pyplot()
    names = list(result["policies"])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 3.4))
    for j, (key, label) in enumerate((("hit_rate", "all calls"), ("switch_hit_rate", "switch calls"))):
        values = [100.0 * (result["policies"][n].get(key) or 0.0) for n in names]
        ax.bar([i + (j - 0.5) * 0.4 for i in range(len(names))], values, 0.4, label=label)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_cdfs(runs: "dict[str, RunResult]", path: "str | Path") -> Path:
    """CDFs of switch-call latency and switch-call TTFT per policy, over the calls common to all runs."""
    plt = _pyplot()
    keys = common_call_keys(runs.values())
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, run in runs.items():
        calls = [c for c in run.calls if c.measured and c.key in keys and c.is_switch]
        for ax, attr in zip(axes, ("latency", "ttft")):
            values = sorted(getattr(c, attr) for c in calls)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=name)
    for ax, label in zip(axes, ("switch-call latency (s)", "switch-call TTFT (s)")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_figures(result: dict, runs: "dict[str, RunResult]", out_dir: "str | Path") -> list[Path]:
    """All figures of one `simulate` result into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_hit_rates(result, out / "hit_rates.png"), plot_cdfs(runs, out / "switch_cdfs.png")]
    if "no-shadow" in result["policies"] and len(result["policies"]) > 1:
        paths.insert(0, plot_reductions(result, out / "reductions.png"))
    return paths
