"""`shadowprefill simulate` and `shadowprefill sweep` (the lead wires `register` into shadowprefill/cli.py).

    shadowprefill simulate --workload ghcp-coding --pair Q2.5-7B/L3.1-70B \\
        --policies no-shadow,harvest-slo+host,oracle+host --duration 600 --warmup 120 --out run.json --plot figs/
    shadowprefill sweep --param beta --workload fusionbench --pair Q2.5-7B/L3.1-70B --duration 300 --out beta.json

`simulate` writes {"config": {...}, "policies": {name: {metrics...}}}; `sweep` writes
{"param": NAME, "values": [...], "points": [{"value": v, "config": ..., "policies": ...}, ...]}, running the
points in parallel processes (`--jobs`), or as Ray tasks with `--ray` when Ray is installed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from shadowprefill.sim.policies import POLICIES, parse_policies

ROUTERS = ("replay", "fixed", "markov", "random", "sticky", "cache-aware")
DEFAULT_SWEEP_POLICIES = "no-shadow,host-tier,harvest-slo,harvest-slo+host,oracle+host"

# Appendix C / Figures 9, 15, 16: parameter -> (values, how a value changes the experiment)
SWEEPS: dict[str, tuple[tuple, str]] = {
    "beta": ((0.25, 0.5, 1.0), "sim.beta"),
    "delta": ((0.0, 0.025, 0.05, 0.1), "sim.delta"),
    "margin": ((0.0, 0.1, 0.2, 0.4), "sim.margin"),
    "shadow_cap": ((0.05, 0.25, 1.0), "sim.shadow_fraction"),
    "cold_age": ((0.0, 2.0, 5.0, 10.0, 120.0), "sim.cold_age_s"),
    "rho": ((0.2, 0.5, 0.7, 0.9), "rho"),
    "switch_p": ((0.05, 0.1, 0.2, 0.3, 0.5), "switch_p"),
    "instances": ((2, 4, 8, 16), "instances"),
    "tp_scale": ((1, 2), "tp_scale"),
    "models": ((2, 3, 4, 5), "models"),
    "host_gb": ((16.0, 32.0, 64.0, 128.0, 256.0), "sim.host_gb_per_gpu"),
    "pcie_gbps": ((8.0, 16.0, 25.0, 50.0), "sim.pcie_bw"),
    "chunk": ((512, 1024, 2048, 4096, 8192), "sim.token_budget"),
    "min_chunk": ((64, 256, 512, 1024), "sim.n_min"),
    "pd_prefill": ((1, 2, 3), "sim.pd_prefill"),
    "link_gbps": ((10.0, 20.0, 40.0, 80.0, 160.0), "sim.link_bw_per_gpu"),
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="fusionbench", help="xroutebench | fusionbench | router-r1 | "
                   "ghcp-coding | swe-bench (session generator; default fusionbench)")
    p.add_argument("--pair", required=True, help="SMALL/LARGE as in the paper's figures (e.g. Q2.5-7B/L3.1-70B), "
                   "or A/B/C for N models")
    p.add_argument("--duration", type=float, default=600.0, help="measured simulated seconds (default 600)")
    p.add_argument("--warmup", type=float, default=120.0, help="simulated warm-up seconds (default 120)")
    p.add_argument("--rho", type=float, default=0.7, help="normal load as a fraction of capacity (default 0.7)")
    p.add_argument("--window", default="peak", choices=("peak", "median", "trough"),
                   help="measurement window: normal load x 1, 0.5 or 0.25 of the peak hour (default peak)")
    p.add_argument("--instances", type=int, default=4, help="instances per model (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", help="Azure LLM trace CSV to replay as normal traffic")
    p.add_argument("--sessions", help="JSONL file of agent sessions (see shadowprefill.cluster.traces)")
    p.add_argument("--lengths", default="conv", choices=("conv", "code"), help="normal-traffic lengths")
    p.add_argument("--session-rate", type=float, help="sessions per second (default: the workload's)")
    p.add_argument("--capacity", help="per-instance capacity override, MODEL=REQ_S[,MODEL=REQ_S] (skips "
                   "calibration)")
    p.add_argument("--shadow-targets", choices=("all", "top1"), default="all")
    p.add_argument("--max-drain", type=float, default=3600.0, help="simulated seconds to drain after the window")
    p.add_argument("--pd-prefill", type=int, help="P/D-disaggregated cluster: prefill instances per model "
                   "(the rest decode); default colocated")
    p.add_argument("--link-gbps", type=float, default=50.0, help="P/D KV link GB/s per GPU (default 50)")
    p.add_argument("--jobs", type=int, default=1, help="parallel processes")
    p.add_argument("--router", default="replay", choices=ROUTERS,
                   help="replay|fixed: recorded routes; markov|random: re-route sessions up front (appendix C); "
                        "sticky|cache-aware: price each call at issue time by its warm prefix (issue #7)")
    p.add_argument("--router-knob", type=float, help="sticky / cache-aware lam: a downgrade below the recorded "
                   "model must save more than this fraction of the call's price (default 1.0: never)")


def register(subparsers) -> None:
    """Add `simulate` and `sweep` to a `shadowprefill` argparse sub-command set."""
    sim = subparsers.add_parser("simulate", help="simulate Table 2 policies on a routed agent workload",
                                description="Discrete-event simulation of a routed cluster (paper §5).")
    _add_common(sim)
    sim.add_argument("--policies", default="no-shadow,harvest-slo+host,oracle+host",
                     help=f"comma-separated, or 'all' ({', '.join(POLICIES)})")
    sim.add_argument("--out", required=True, help="output JSON file")
    sim.add_argument("--plot", help="directory for figures (per-policy reductions, CDFs)")
    sim.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    sim.set_defaults(func=cmd_simulate)

    sw = subparsers.add_parser("sweep", help="appendix C sensitivity studies",
                               description="Vary one parameter; every point runs the given policies.")
    _add_common(sw)
    sw.add_argument("--param", required=True, choices=sorted(SWEEPS))
    sw.add_argument("--values", help="comma-separated values (default: the paper's)")
    sw.add_argument("--policies", default=DEFAULT_SWEEP_POLICIES)
    sw.add_argument("--out", required=True)
    sw.add_argument("--ray", action="store_true", help="run points as Ray tasks (needs `ray` installed)")
    sw.set_defaults(func=cmd_sweep)


def _capacity(text: str | None) -> dict:
    if not text:
        return {}
    from shadowprefill.model.catalog import resolve_name
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            raise SystemExit(f"--capacity: {item!r} is not MODEL=REQ_PER_S") from None
        out[resolve_name(name.strip())] = rate
    return out


def _routers(args) -> dict:
    """--router / --router-knob -> Experiment fields (up-front re-routing or a per-call router)."""
    name = getattr(args, "router", "replay") or "replay"
    knob = getattr(args, "router_knob", None)
    if knob is not None and name not in ("sticky", "cache-aware"):
        raise SystemExit(f"--router-knob needs --router sticky or cache-aware, got --router {name}")
    if knob is not None and not knob >= 0:
        raise SystemExit(f"--router-knob must be >= 0, got {knob}")
    if name in ("markov", "random"):
        return {"router": name}
    if name in ("sticky", "cache-aware"):
        return {"call_router": name, "router_knob": knob}
    return {}


def experiment_from_args(args, policies: str) -> "Experiment":
    from shadowprefill.sim.experiment import Experiment, parse_models
    return Experiment(**_routers(args), workload=args.workload, models=parse_models(args.pair, args.workload),
                      policies=[p.name for p in parse_policies(policies)], duration_s=args.duration,
                      warmup_s=args.warmup, rho=args.rho, window=args.window, instances=args.instances, seed=args.seed,
                      lengths=args.lengths, trace=args.trace, sessions_file=args.sessions,
                      session_rate=args.session_rate, capacity=_capacity(args.capacity),
                      sim={"shadow_targets": args.shadow_targets, "max_drain_s": args.max_drain,
                           "pd_prefill": args.pd_prefill, "link_bw_per_gpu": args.link_gbps * 1e9})


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_json_safe(payload), indent=1))


def cmd_simulate(args) -> int:
    from shadowprefill.sim.experiment import run_experiment
    from shadowprefill.sim.report import format_table, write_figures
    exp = experiment_from_args(args, args.policies)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    result = run_experiment(exp, progress=not args.quiet, jobs=args.jobs, log=log)
    runs = result.pop("runs")
    write_json(args.out, result)
    if not args.quiet:
        print(format_table(result), file=sys.stderr)
    if args.plot:
        for path in write_figures(result, runs, args.plot):
            if not args.quiet:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def sweep_point(args_dict: dict, param: str, value) -> dict:
    """Run one sweep point (a plain function so multiprocessing / Ray can ship it)."""
    from shadowprefill.sim.experiment import candidate_models, run_experiment
    from shadowprefill.model.latency import LatencyModel
    ns = argparse.Namespace(**args_dict)
    exp = experiment_from_args(ns, ns.policies)
    target = SWEEPS[param][1]
    if target.startswith("sim."):
        key = target[4:]
        exp.sim[key] = value * 1e9 if key in ("pcie_bw", "link_bw_per_gpu") else value
    elif target == "rho":
        exp.rho = float(value)
    elif target == "instances":
        exp.instances = int(value)
    elif target == "switch_p":
        exp.router, exp.switch_p = "markov", float(value)
    elif target == "models":
        exp.models = candidate_models(exp.workload, exp.models, int(value))   # generators route over all N
    elif target == "tp_scale":
        exp.sim["tp"] = {m: LatencyModel(m, exp.sim.get("gpu", "h100")).tp * int(value) for m in exp.models}
    result = run_experiment(exp)
    result.pop("runs")
    return {"value": value, **result}


def _parse_values(param: str, text: str | None) -> list:
    defaults = SWEEPS[param][0]
    if not text:
        return list(defaults)
    kind = type(defaults[0])
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--values: expected {kind.__name__} values, got {text!r}") from None


def cmd_sweep(args) -> int:
    values = _parse_values(args.param, args.values)
    parse_policies(args.policies)                       # fail early on a bad name
    args_dict = {k: v for k, v in vars(args).items() if k != "func"}
    points: list[dict] = []
    if args.ray:
        try:
            import ray
        except ImportError:
            raise SystemExit("--ray: Ray is not installed (pip install ray)") from None
        ray.init(ignore_reinit_error=True)
        remote = ray.remote(sweep_point)
        points = ray.get([remote.remote(args_dict, args.param, v) for v in values])
    elif args.jobs > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(min(args.jobs, len(values))) as pool:
            points = pool.starmap(sweep_point, [(args_dict, args.param, v) for v in values])
    else:
        from tqdm import tqdm
        for v in tqdm(values, desc=f"sweep {args.param}", unit="point"):
            points.append(sweep_point(args_dict, args.param, v))
    write_json(args.out, {"param": args.param, "values": values, "points": points})
    return 0


def main(argv=None) -> int:
    """Stand-alone entry: `python -m shadowprefill.sim.cli simulate ...`."""
    parser = argparse.ArgumentParser(prog="shadowprefill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
