"""Command-line arguments shared by `simulate`, `sweep` (sim/cli.py) and `demo` (sim/study.py).

Both command modules import these from here, so neither imports the other's command code.
"""
from __future__ import annotations

import argparse
import math

from shadowprefill.usage import UsageError, comma_list

# Simulated seconds before the measured window, for every simulator command: the paper's §5.1 ("excluding
# the first 120 s"). Caches, queues and the next-model prior fill first; shorter warm-ups let the first
# measured switch calls see emptier caches than a running system's.
WARMUP_S = 120.0


def add_admission_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admission", choices=("fcfs", "routed-first"), default="fcfs",
                   help="engines' admission order: fcfs (the paper's vLLM: routed and normal requests in one "
                        "queue by arrival) or routed-first (routed calls before normal traffic)")


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """`--ray` / `--ray-address` (shared by `sweep` and `demo`)."""
    p.add_argument("--ray", action="store_true", help="run the points as Ray tasks on the cluster ray.init() finds "
                   "(RAY_ADDRESS, a running local Ray, or a new local one); needs `ray` installed")
    p.add_argument("--ray-address", help="Ray cluster address for ray.init (implies --ray), e.g. ray://head:10001")


def check_ray(args) -> bool:
    """Whether to use Ray; a UsageError if asked for and Ray is not installed."""
    from shadowprefill.sim.runner import ray_available
    wanted = bool(args.ray or args.ray_address)
    if wanted and not ray_available():
        raise UsageError("--ray: Ray is not installed in this environment (pip install ray)")
    return wanted


def parse_capacity(text: str | None) -> dict:
    """`MODEL=REQ_S[,MODEL=REQ_S]` -> {catalog name: rate} (ValueError naming a bad item); `paper`: the
    paper's testbed capacities (appendix D.1, `sim.paper_point`) for the models it names."""
    if not text:
        return {}
    if text.strip() == "paper":
        from shadowprefill.sim.paper_point import paper_capacity
        return paper_capacity()
    from shadowprefill.model.catalog import resolve_name
    out = {}
    for item in comma_list(text):
        name, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"--capacity: {item!r} is not MODEL=REQ_PER_S") from None
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"--capacity: {item!r}: the rate must be > 0")
        out[resolve_name(name.strip())] = rate
    return out


def check_pair(models, text: str) -> None:
    """A routed cluster needs at least two different models: `--pair A/B` (ValueError naming --pair)."""
    if len(set(models)) < 2:
        raise ValueError(f"--pair must name two different models, SMALL/LARGE (e.g. Q2.5-7B/L3.1-70B), "
                         f"got {text!r}")
