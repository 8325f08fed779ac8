"""`shadowprefill simulate`, `shadowprefill sweep` and `shadowprefill calibrate-capacity`.

    shadowprefill simulate --workload ghcp-coding --pair Q2.5-7B/L3.1-70B \\
        --policies no-shadow,harvest-slo+host,oracle+host --duration 600 --warmup 120 --out run.json --plot figs/
    shadowprefill sweep --param beta --workload fusionbench --pair Q2.5-7B/L3.1-70B --duration 300 --out beta.json
    shadowprefill calibrate-capacity --write          # regenerate the shipped capacities (sim/data/capacity.json)

`simulate` writes {"config": {...}, "policies": {name: {metrics...}}} (and with `--records FILE` one JSON
line per completed call per policy); `sweep` writes {"param": NAME, "values": [...], "points": [{"value": v,
"config": ..., "policies": ...}, ...]}, running the points in parallel processes (`--jobs`), or as Ray tasks
with `--ray` on whatever cluster `ray.init()` finds (`--ray-address` / RAY_ADDRESS), with the same result.
Arguments and input files are checked before anything runs (`shadowprefill.usage`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from shadowprefill.sim.policies import POLICIES, parse_policies
from shadowprefill.usage import (
    UsageError,
    comma_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    user_input,
)

if TYPE_CHECKING:
    from shadowprefill.sim.experiment import Experiment

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
    p.add_argument("--pair", help="SMALL/LARGE as in the paper's figures (e.g. Q2.5-7B/L3.1-70B), "
                   "or A/B/C for N models")
    p.add_argument("--duration", type=positive_float, default=600.0, help="measured simulated seconds (default 600)")
    p.add_argument("--warmup", type=nonneg_float, default=120.0, help="simulated warm-up seconds (default 120)")
    p.add_argument("--rho", type=nonneg_float, default=0.7,
                   help="normal load as a fraction of capacity (default 0.7)")
    p.add_argument("--window", default="peak", choices=("peak", "median", "trough"),
                   help="measurement window: normal load x 1, 0.5 or 0.25 of the peak hour (default peak)")
    p.add_argument("--instances", type=positive_int, default=4, help="instances per model (default 4)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--trace", help="Azure LLM trace CSV to replay as normal traffic")
    p.add_argument("--sessions", help="JSONL file of agent sessions (see shadowprefill.cluster.traces)")
    p.add_argument("--lengths", default="conv", choices=("conv", "code"), help="normal-traffic lengths")
    p.add_argument("--session-rate", type=positive_float, help="sessions per second (default: the workload's)")
    p.add_argument("--capacity", help="per-instance capacity override, MODEL=REQ_S[,MODEL=REQ_S] (skips "
                   "calibration)")
    p.add_argument("--shadow-targets", choices=("all", "top1"), default="all")
    p.add_argument("--max-drain", type=nonneg_float, default=3600.0,
                   help="simulated seconds to drain after the window")
    p.add_argument("--pd-prefill", type=positive_int, help="P/D-disaggregated cluster: prefill instances per model "
                   "(the rest decode); default colocated")
    p.add_argument("--link-gbps", type=positive_float, default=50.0, help="P/D KV link GB/s per GPU (default 50)")
    p.add_argument("--jobs", type=positive_int, default=1, help="parallel processes")
    add_admission_argument(p)
    p.add_argument("--router", default="replay", choices=ROUTERS,
                   help="replay|fixed: recorded routes; markov|random: re-route sessions up front (appendix C); "
                        "sticky|cache-aware: price each call at issue time by its warm prefix (issue #7)")
    p.add_argument("--router-knob", type=nonneg_float, help="sticky / cache-aware lam: a downgrade below the "
                   "recorded model must save more than this fraction of the call's price (default 1.0: never)")


def add_admission_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admission", choices=("fcfs", "routed-first"), default="fcfs",
                   help="engines' admission order: fcfs (the paper's vLLM: routed and normal requests in one "
                        "queue by arrival; the default) or routed-first (routed calls before normal traffic)")


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


def register(subparsers) -> None:
    """Add `simulate`, `sweep` and `calibrate-capacity` to a `shadowprefill` argparse sub-command set."""
    sim = subparsers.add_parser("simulate", help="simulate Table 2 policies on a routed agent workload",
                                description="Discrete-event simulation of a routed cluster (paper §5).")
    _add_common(sim)
    sim.add_argument("--policies", default="no-shadow,harvest-slo+host,oracle+host",
                     help=f"comma-separated, or 'all' ({', '.join(POLICIES)})")
    sim.add_argument("--pairs", help="'paper': every Table 3 pair of --workload, one experiment each (instead "
                                     "of --pair); or comma-separated pair labels")
    sim.add_argument("--out", required=True, help="output JSON file")
    sim.add_argument("--records", help="also write every completed call of every policy here (JSON lines: "
                                       "policy + the call's record, see sim/metrics.py CallRecord)")
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
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    add_ray_arguments(sw)
    sw.set_defaults(func=cmd_sweep)

    cal = subparsers.add_parser("calibrate-capacity", help="recalibrate per-instance capacities (and with --write "
                                "regenerate the ones shipped in the package)",
                                description="Recalibrate the normal-traffic capacity of one instance per model "
                                            "(shadowprefill/sim/capacity.py).")
    cal.add_argument("--models", help="comma-separated models or pairs (SMALL/LARGE); default: the models of "
                                      "the default study and the paper's protocol")
    cal.add_argument("--lengths", default="conv", choices=("conv", "code"), help="normal-traffic lengths")
    cal.add_argument("--gpu", default="h100")
    cal.add_argument("--write", action="store_true", help="also store the results in the package's "
                     "sim/data/capacity.json, what ships (entries of a changed latency model are dropped)")
    cal.add_argument("--check", action="store_true", help="calibrate nothing: exit 1 unless the package ships a "
                     "current capacity for each model")
    cal.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, help="parallel processes")
    cal.set_defaults(func=cmd_calibrate)


def _capacity(text: str | None) -> dict:
    """`MODEL=REQ_S[,MODEL=REQ_S]` -> {catalog name: rate} (ValueError naming a bad item)."""
    if not text:
        return {}
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


def _routers(args) -> dict:
    """--router / --router-knob -> Experiment fields (up-front re-routing or a per-call router)."""
    name = getattr(args, "router", "replay") or "replay"
    knob = getattr(args, "router_knob", None)
    if knob is not None and name not in ("sticky", "cache-aware"):
        raise ValueError(f"--router-knob needs --router sticky or cache-aware, got --router {name}")
    if name in ("markov", "random"):
        return {"router": name}
    if name in ("sticky", "cache-aware"):
        return {"call_router": name, "router_knob": knob}
    return {}


def experiment_from_args(args, policies: str) -> "Experiment":
    from shadowprefill.sim.experiment import Experiment, parse_models
    if not args.pair:
        raise ValueError("--pair is required (SMALL/LARGE, e.g. Q2.5-7B/L3.1-70B)")
    return Experiment(**_routers(args), workload=args.workload, models=parse_models(args.pair, args.workload),
                      policies=[p.name for p in parse_policies(policies)], duration_s=args.duration,
                      warmup_s=args.warmup, rho=args.rho, window=args.window, instances=args.instances, seed=args.seed,
                      lengths=args.lengths, trace=args.trace, sessions_file=args.sessions,
                      session_rate=args.session_rate, capacity=_capacity(args.capacity),
                      sim={"shadow_targets": args.shadow_targets, "max_drain_s": args.max_drain,
                           "pd_prefill": args.pd_prefill, "link_bw_per_gpu": args.link_gbps * 1e9,
                           "admission": args.admission})


def check_experiment(exp) -> None:
    """Everything about `exp` that can be checked before it runs: the cluster and engine config (durations,
    instances, P/D split, controller parameters), the workload or sessions file, the trace file.
    ValueError / OSError name the bad input."""
    from shadowprefill.cluster.traces import load_azure_trace
    from shadowprefill.cluster.workloads import get_workload
    from shadowprefill.sim.experiment import build_sessions, sim_config
    cfg = sim_config(exp)                   # includes every engine's EngineConfig checks
    for name, least in (("host_gb_per_gpu", 0.0), ("pcie_bw", None), ("link_bw_per_gpu", None)):
        value = getattr(cfg, name, None)
        if value is not None and not (value >= least if least is not None else value > 0):
            raise ValueError(f"{name} must be {'>= 0' if least is not None else '> 0'}, got {value}")
    if exp.sessions_file:
        build_sessions(exp)
    else:
        get_workload(exp.workload)
    if exp.trace:
        load_azure_trace(exp.trace)


def check_output_file(path: str, what: str) -> None:
    if Path(path).is_dir():
        raise ValueError(f"{what} {path}: is a directory, not a file")


def check_plot_dir(path: str, what: str = "--plot") -> None:
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{what} {path}: exists and is not a directory")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{what} needs matplotlib (pip install matplotlib)")


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


def write_records(path: str, runs: dict) -> int:
    """One JSON line per completed call per policy: {"policy": name, **CallRecord fields}; returns the count."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w") as f:
        for name, run in runs.items():
            for call in run.calls:
                f.write(json.dumps(_json_safe({"policy": name, **asdict(call)})) + "\n")
                n += 1
    return n


def cmd_simulate(args) -> int:
    from shadowprefill.sim.experiment import run_experiment
    from shadowprefill.sim.report import format_table, write_figures
    if getattr(args, "pairs", None):
        return _simulate_pairs(args)
    with user_input():
        exp = experiment_from_args(args, args.policies)
        check_experiment(exp)
        check_output_file(args.out, "--out")
        if args.records:
            check_output_file(args.records, "--records")
        if args.plot:
            check_plot_dir(args.plot)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    result = run_experiment(exp, progress=not args.quiet, jobs=args.jobs, log=log)
    runs = result.pop("runs")
    write_json(args.out, result)
    if args.records:
        write_records(args.records, runs)
    if not args.quiet:
        print(format_table(result), file=sys.stderr)
    if args.plot:
        for path in write_figures(result, runs, args.plot):
            if not args.quiet:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _simulate_pairs(args) -> int:
    """`simulate --pairs paper|A/B,C/D`: one experiment per pair; --out gets {"pairs": {label: result}}."""
    from shadowprefill.model.catalog import PAIRS
    from shadowprefill.sim.experiment import run_experiment
    from shadowprefill.sim.report import format_table
    with user_input():
        if args.pairs == "paper":
            if args.workload not in PAIRS:
                raise ValueError(f"--pairs paper: workload {args.workload!r} has no Table 3 pairs")
            labels = list(PAIRS[args.workload])
        else:
            labels = [x.strip() for x in args.pairs.split(",") if x.strip()]
        exps = {label: experiment_from_args(argparse.Namespace(**{**vars(args), "pair": label}), args.policies)
                for label in labels}
        for exp in exps.values():
            check_experiment(exp)
        check_output_file(args.out, "--out")
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    results = {}
    for label, exp in exps.items():
        result = run_experiment(exp, progress=not args.quiet, jobs=args.jobs, log=log)
        result.pop("runs")
        results[label] = result
        if not args.quiet:
            print(f"== {label}\n{format_table(result)}", file=sys.stderr)
    write_json(args.out, {"pairs": results})
    return 0


def point_experiment(args_dict: dict, param: str, value) -> "Experiment":
    """The experiment of one sweep point: the command's experiment with `param` set to `value`."""
    from shadowprefill.model.latency import LatencyModel
    from shadowprefill.sim.experiment import candidate_models
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
    return dataclasses.replace(exp)             # re-runs the Experiment's checks on the changed fields


def sweep_point(args_dict: dict, param: str, value) -> dict:
    """Run one sweep point (a plain function so multiprocessing / Ray can ship it)."""
    from shadowprefill.sim.experiment import run_experiment
    result = run_experiment(point_experiment(args_dict, param, value))
    result.pop("runs")
    return {"value": value, **result}


def _sweep_job(item: tuple) -> dict:
    return sweep_point(*item)


def _parse_values(param: str, text: str | None) -> list:
    defaults = SWEEPS[param][0]
    if not text:
        return list(defaults)
    kind = type(defaults[0])
    values = comma_list(text, kind, f"--values {kind.__name__}")
    if not values:
        raise ValueError(f"--values: no value in {text!r}")
    return values


def cmd_sweep(args) -> int:
    from shadowprefill.sim.runner import map_jobs
    use_ray = check_ray(args)
    args_dict = {k: v for k, v in vars(args).items() if k != "func"}
    with user_input():
        values = _parse_values(args.param, args.values)
        parse_policies(args.policies)
        for v in values:                                  # every point's config, before any point runs
            with user_input(f"--param {args.param} value {v!r}"):
                check_experiment(point_experiment(args_dict, args.param, v))
        check_output_file(args.out, "--out")
    points = map_jobs(_sweep_job, [(args_dict, args.param, v) for v in values], jobs=args.jobs, ray=use_ray,
                      ray_address=args.ray_address, desc=f"sweep {args.param}", progress=not args.quiet)
    write_json(args.out, {"param": args.param, "values": values, "points": points})
    return 0


def cmd_calibrate(args) -> int:
    from shadowprefill.sim import capacity
    from shadowprefill.sim.study import default_study_models
    with user_input():
        queries = capacity_queries(args, default_study_models())
    if args.check:
        missing = 0
        for q in queries:
            cap = capacity.shipped_capacity(q)
            missing += cap is None
            print(f"{q.model:16s} {q.lengths:5s} " + (f"{cap:.3f} req/s (shipped, current)" if cap is not None else
                                                        f"no current shipped value: run `{capacity.REGENERATE}`"))
        return 1 if missing else 0
    results = capacity.recalibrate(queries, jobs=args.jobs, write=args.write)
    for query, cap, probes in results:
        print(f"{query.model:16s} {query.lengths:5s} {cap:.3f} req/s per instance after {len(probes)} probes "
              f"(fingerprint {query.fingerprint()})")
    if args.write:
        print(f"wrote {capacity.SHIPPED_PATH}")
    return 0


def capacity_queries(args, default_models) -> list:
    """Validated `CapacityQuery`s of `calibrate-capacity`'s arguments (ValueError naming a bad one)."""
    from shadowprefill.model.catalog import resolve_name
    from shadowprefill.model.gpus import get_gpu
    from shadowprefill.sim.capacity import CapacityQuery
    from shadowprefill.sim.deployment import SimConfig
    get_gpu(args.gpu)
    names = tuple(default_models)
    if args.models:
        names = tuple(resolve_name(m) for m in comma_list(args.models.replace("/", ",")))
        if not names:
            raise ValueError("--models: no model named")
    if args.write and args.check:
        raise ValueError("--write and --check exclude each other")
    out = []
    for m in dict.fromkeys(names):
        q = CapacityQuery.of(m, SimConfig(models=(m,), gpu=args.gpu), lengths=args.lengths)
        q.fingerprint()                          # the latency model takes this model on this GPU
        out.append(q)
    return out


def main(argv=None) -> int:
    """Stand-alone entry: `python -m shadowprefill.sim.cli simulate ...`."""
    from shadowprefill.usage import Parser, run_cli
    parser = Parser(prog="shadowprefill")
    register(parser.add_subparsers(dest="command", required=True))
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
