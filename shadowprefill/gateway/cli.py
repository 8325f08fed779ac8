"""``shadowprefill gateway table|sweep``: Table IV as computed and the Figure 5 sensitivity (Unified AI Gateway
paper, §VI-C).

``register(subparsers)`` adds the ``gateway`` command to the main argparse parser; each leaf sets
``func`` so the main entry point runs ``args.func(args)``. ``python -m shadowprefill.gateway.cli`` works too; a bad argument is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from ..usage import Parser, run_cli, user_input
from .analytic import PROFILES, SWEEP_PARAMS, SWITCH_RATES, sensitivity, table_iv

METRICS = ("ttft_speedup", "input_cost_ratio", "e2e_cost_ratio")
_TITLES = {"ttft_speedup": "TTFT speedup", "input_cost_ratio": "Input-cost ratio", "e2e_cost_ratio": "E2E cost ratio"}

# Table IV of paper 003 as printed (for --compare only; the tests keep their own copy).
PAPER_TABLE_IV = {
    "multi-turn-chat": ((1.57, 2.14, 2.71), (1.43, 1.85, 2.28), (1.36, 1.73, 2.09)),
    "rag": ((1.25, 1.49, 1.74), (1.20, 1.41, 1.61), (1.17, 1.35, 1.52)),
    "toolbench": ((2.05, 3.09, 4.11), (1.81, 2.63, 3.44), (1.54, 2.09, 2.63)),
    "embodied-agent": ((4.37, 7.55, 10.56), (2.72, 4.44, 6.16), (2.35, 3.69, 5.04)),
    "programming": ((5.39, 9.48, 13.28), (2.72, 4.44, 6.16), (1.59, 2.17, 2.76)),
    "video-qa": ((2.70, 4.36, 5.99), (1.95, 2.90, 3.86), (1.94, 2.89, 3.83)),
    "long-document-qa": ((3.44, 5.83, 8.17), (2.13, 3.26, 4.39), (2.11, 3.22, 4.33)),
    "long-horizon-coding-agent": ((5.01, 8.97, 12.87), (2.39, 3.79, 5.18), (2.11, 3.23, 4.34)),
}


def format_table(compare: bool = False) -> str:
    """Table IV as a markdown table (``compare``: paper value → ours per cell)."""
    rates = " / ".join(f"{int(r * 100)}%" for r in SWITCH_RATES)
    head = ["Workload", "L_in/L_out", "h"] + [f"{_TITLES[m]} {rates}" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table_iv():
        cells = [row["name"], row["lengths"], f"{row['hit_rate']:g}"]
        for k, m in enumerate(METRICS):
            ours = row[m]
            if compare:
                paper = PAPER_TABLE_IV[row["profile"]][k]
                cells.append(" / ".join(f"{p:.2f}→{o:.2f}" for p, o in zip(paper, ours)))
            else:
                cells.append(" / ".join(f"{o:.2f}×" for o in ours))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_table(args) -> int:
    print(format_table(compare=args.compare))
    return 0


def _plot(rows: list[dict], param: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # bandwidth enters only the latency model (§VI-B): the cost ratios are flat in B, so plot TTFT alone
    metrics = ("ttft_speedup",) if param == "bandwidth" else METRICS
    fig, axes = plt.subplots(len(metrics), len(SWITCH_RATES), figsize=(4.2 * len(SWITCH_RATES), 3.2 * len(metrics)),
                             sharex=True, squeeze=False)
    scale = 1e9 if param == "bandwidth" else 1.0
    xlabel = {"bandwidth": "Bandwidth B (GB/s)", "hit_rate": "Cache hit rate h", "context": "Context L_in (tokens)"}
    for j, r in enumerate(SWITCH_RATES):
        for i, m in enumerate(metrics):
            ax = axes[i][j]
            for key in PROFILES:
                pts = [(row["value"] / scale, row[m]) for row in rows if row["profile"] == key and row["r_switch"] == r]
                if pts:
                    ax.plot(*zip(*pts), label=PROFILES[key].name)
            if param in ("bandwidth", "context"):
                ax.set_xscale("log")
            if i == 0:
                ax.set_title(f"r_switch = {int(r * 100)}%")
            if j == 0:
                ax.set_ylabel(_TITLES[m])
            if i == len(metrics) - 1:
                ax.set_xlabel(xlabel[param])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sweep(args) -> int:
    with user_input("--out"):
        os.makedirs(args.out, exist_ok=True)
    rows = sensitivity(args.param)
    stem = os.path.join(args.out, f"gateway_sweep_{args.param}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["profile", "r_switch", "param", "value", *METRICS])
        w.writeheader()
        w.writerows(rows)
    with open(stem + ".json", "w") as f:
        json.dump({"param": args.param, "rows": rows}, f, indent=1)
    _plot(rows, args.param, stem + ".png")
    for ext in ("png", "csv", "json"):
        print(f"wrote {stem}.{ext}" + (f" ({len(rows)} rows)" if ext != "png" else ""))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``gateway table`` and ``gateway sweep`` to the main parser's subparsers."""
    gw = subparsers.add_parser("gateway", help="the Unified AI Gateway paper's analytic model (its §VI)",
                               description="The Unified AI Gateway paper's analytic workload model: Table IV "
                                           "(`table`) and the Figure 5 sensitivity curves (`sweep`).")
    sub = gw.add_subparsers(dest="gateway_cmd", metavar="SUBCOMMAND", required=True)
    t = sub.add_parser("table", help="print Table IV as computed")
    t.add_argument("--compare", action="store_true", help="show the paper's value next to ours per cell")
    t.set_defaults(func=run_table)
    s = sub.add_parser("sweep", help="Figure 5 sensitivity sweep: PNG + CSV + JSON")
    s.add_argument("--param", required=True, choices=SWEEP_PARAMS,
                   help="the swept quantity: link bandwidth, cache hit rate or context length")
    s.add_argument("--out", default="out/gateway", help="output directory")
    s.set_defaults(func=run_sweep)
    return gw


def main(argv=None) -> int:
    parser = Parser(prog="shadowprefill")
    register(parser.add_subparsers(dest="cmd", required=True))
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
