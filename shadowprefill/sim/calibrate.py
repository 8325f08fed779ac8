"""Fit the latency model's constants to measured H100 operator profiles (Vidur CSVs) and report errors.

    python -m shadowprefill.sim.calibrate --vidur-dir ../shared/data/vidur-h100

reads `Llama-2-7b-hf.mlp.csv`, `Llama-2-70b-hf.mlp.csv` (per-operator times in ms by token count and TP
degree) and `h100_dgx.all_reduce.csv`, then prints

1. cross-validation: the five linear operators (QKV, output projection, MLP up/gate, activation, down)
   fitted on one model and evaluated on the other (median / p90 relative error of their per-layer sum,
   which is `latency.linear_ops_ms`), both ways;
2. the constants fitted on both models (the values written into `latency.H100`) and their errors per
   model and TP degree; elementwise norm/RoPE/add ops; all-reduce by worker count.

The fit minimises the mean absolute log error of every operator time with Nelder-Mead over log-scaled
parameters (numpy only). The project never needs these files at run time: the fitted numbers live in code.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path

import numpy as np

from shadowprefill.model.gpus import GPUS
from shadowprefill.model.latency import H100, Calibration, allreduce_s, linear_ops_breakdown_s, norm_ops_s

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj")
NORM_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "add", "add")   # add: twice per layer
PROFILE_FILES = {"Llama-2-7B": "Llama-2-7b-hf.mlp.csv", "Llama-2-70B": "Llama-2-70b-hf.mlp.csv"}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens", "num_tensor_parallel_workers")


def load_profile(path: "str | Path") -> dict[str, np.ndarray]:
    """Columns of a Vidur `*.mlp.csv`: shapes, and every op's median time converted to seconds."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile not found: {path}")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    out = {k: np.array([float(r[k]) for r in rows]) for k in SHAPE_COLUMNS}
    out["use_gated_mlp"] = np.array([r["use_gated_mlp"].strip().lower() == "true" for r in rows])
    for op in set(LINEAR_OPS + NORM_OPS):
        out[op] = np.array([float(r[f"time_stats.{op}.median"]) for r in rows]) * 1e-3
    return out


def load_allreduce(path: "str | Path") -> dict[str, np.ndarray]:
    """Vidur all-reduce profile: workers, size (bytes) and median time (s)."""
    with Path(path).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["collective"] == "all_reduce"]
    return {"workers": np.array([int(r["num_workers"]) for r in rows]),
            "size": np.array([float(r["size"]) for r in rows]),
            "time": np.array([float(r["time_stats.all_reduce.median"]) for r in rows]) * 1e-3}


def concat(*profiles: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in profiles]) for k in profiles[0]}


def nelder_mead(f, x0, iters: int = 1500, step: float = 0.1):
    """Minimise f from x0 (plain Nelder-Mead; adequate for the handful of parameters here)."""
    x0 = np.asarray(x0, dtype=float)
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = np.mean(simplex[:-1], axis=0)
        reflected = centre + (centre - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centre + 2.0 * (centre - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centre + 0.5 * (simplex[-1] - centre)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    best = int(np.argmin(values))
    return simplex[best], values[best]


def _linear_cal(theta, base: Calibration) -> Calibration:
    fe, be, c0, p, ae, ac = np.exp(theta)
    return dataclasses.replace(base, gemm_flops_eff=fe, gemm_bw_eff=be, gemm_overhead_s=c0, gemm_softmax_p=1.0 + p,
                               act_bw_eff=ae, act_overhead_s=ac)


def predict_linear_ops(profile: dict[str, np.ndarray], cal: Calibration) -> dict[str, np.ndarray]:
    """Model times (s) of the five linear ops for every profile row."""
    return linear_ops_breakdown_s(profile["n_embd"], profile["n_expanded_embd"], profile["n_head"],
                                  profile["n_kv_head"], profile["num_tokens"],
                                  profile["num_tensor_parallel_workers"], GPUS["h100"],
                                  gated_mlp=bool(profile["use_gated_mlp"].all()), cal=cal)


def linear_ops_errors(profile: dict[str, np.ndarray], cal: Calibration = H100) -> np.ndarray:
    """Signed relative error of the per-layer sum of the five linear ops, one entry per profile row."""
    pred = predict_linear_ops(profile, cal)
    measured = sum(profile[op] for op in LINEAR_OPS)
    return sum(pred[op] for op in LINEAR_OPS) / measured - 1.0


def fit_linear_ops(profile: dict[str, np.ndarray], base: Calibration = H100, iters: int = 1500) -> Calibration:
    """Fit GEMM and activation constants to the five linear ops of `profile`."""
    def loss(theta):
        pred = predict_linear_ops(profile, _linear_cal(theta, base))
        return float(np.mean([np.mean(np.abs(np.log(pred[op] / profile[op]))) for op in LINEAR_OPS]))
    x0 = np.log([0.75, 0.95, 5e-6, 0.4, 0.6, 2e-6])
    theta, _ = nelder_mead(loss, x0, iters)
    return _linear_cal(theta, base)


def _norm_measured(profile):
    return sum(profile[op] for op in NORM_OPS)


def _norm_pred(profile, cal):
    h, heads, kv, tp = profile["n_embd"], profile["n_head"], profile["n_kv_head"], profile["num_tensor_parallel_workers"]
    d = h / heads
    return norm_ops_s(profile["num_tokens"], h, heads * d / tp, np.maximum(kv / tp, 1) * d, GPUS["h100"], cal)


def fit_norms(profile: dict[str, np.ndarray], base: Calibration = H100) -> Calibration:
    """Fit the elementwise (2 RMSNorm + RoPE + 2 add) bandwidth efficiency and per-kernel cost."""
    def loss(theta):
        cal = dataclasses.replace(base, norm_bw_eff=np.exp(theta[0]), norm_overhead_s=np.exp(theta[1]))
        return float(np.mean(np.abs(np.log(_norm_pred(profile, cal) / _norm_measured(profile)))))
    theta, _ = nelder_mead(loss, np.log([0.5, 3e-6]), 400)
    return dataclasses.replace(base, norm_bw_eff=float(np.exp(theta[0])), norm_overhead_s=float(np.exp(theta[1])))


def fit_allreduce(ar: dict[str, np.ndarray], base: Calibration = H100) -> Calibration:
    """Fit one fixed latency per worker count and one NVLink bus-bandwidth efficiency."""
    workers = sorted(set(ar["workers"].tolist()))

    def cal_of(theta):
        lat = tuple((w, float(np.exp(t))) for w, t in zip(workers, theta[:-1]))
        return dataclasses.replace(base, allreduce_latency_s=lat, allreduce_bw_eff=float(np.exp(theta[-1])))

    def loss(theta):
        cal = cal_of(theta)
        pred = np.concatenate([allreduce_s(ar["size"][ar["workers"] == w], w, GPUS["h100"], cal) for w in workers])
        meas = np.concatenate([ar["time"][ar["workers"] == w] for w in workers])
        return float(np.mean(np.abs(np.log(pred / meas))))
    theta, _ = nelder_mead(loss, np.log([2e-5] * len(workers) + [0.7]), 1500)
    return cal_of(theta)


def allreduce_errors(ar: dict[str, np.ndarray], cal: Calibration = H100) -> dict[int, np.ndarray]:
    return {w: allreduce_s(ar["size"][ar["workers"] == w], w, GPUS["h100"], cal) / ar["time"][ar["workers"] == w] - 1
            for w in sorted(set(ar["workers"].tolist()))}


def calibrate(vidur_dir: "str | Path") -> Calibration:
    """All fitted constants from a directory holding the Vidur H100 CSVs (both models)."""
    vidur_dir = Path(vidur_dir)
    both = concat(*(load_profile(vidur_dir / f) for f in PROFILE_FILES.values()))
    cal = fit_linear_ops(both)
    cal = fit_norms(both, cal)
    return fit_allreduce(load_allreduce(vidur_dir / "h100_dgx.all_reduce.csv"), cal)


def _summary(err: np.ndarray) -> str:
    a = np.abs(err)
    return f"median {100 * np.median(a):5.2f}%  p90 {100 * np.percentile(a, 90):5.2f}%  max {100 * a.max():5.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur-dir", default="../shared/data/vidur-h100",
                        help="directory with Llama-2-{7b,70b}-hf.mlp.csv and h100_dgx.all_reduce.csv")
    args = parser.parse_args(argv)
    vidur_dir = Path(args.vidur_dir)
    if not vidur_dir.is_dir():
        print(f"error: --vidur-dir {vidur_dir} is not a directory", file=sys.stderr)
        return 2
    profiles = {name: load_profile(vidur_dir / f) for name, f in PROFILE_FILES.items()}
    print("1) cross-validation of linear_ops (sum of the five linear ops per layer), all TP degrees:")
    names = list(profiles)
    for train, test in ((names[0], names[1]), (names[1], names[0])):
        cal = fit_linear_ops(profiles[train])
        print(f"   fit on {train:12s} -> {test:12s}: {_summary(linear_ops_errors(profiles[test], cal))}"
              f"   (in-sample {_summary(linear_ops_errors(profiles[train], cal))})")
    cal = calibrate(vidur_dir)
    print("\n2) constants fitted on both models (paste into latency.H100):")
    for f in ("gemm_flops_eff", "gemm_bw_eff", "gemm_overhead_s", "gemm_softmax_p", "act_bw_eff", "act_overhead_s",
              "norm_bw_eff", "norm_overhead_s", "allreduce_bw_eff"):
        print(f"   {f} = {getattr(cal, f):.4g}")
    print("   allreduce_latency_s = (" + ", ".join(f"({w}, {t:.3g})" for w, t in cal.allreduce_latency_s) + ")")
    for name, prof in profiles.items():
        err = linear_ops_errors(prof, cal)
        print(f"   {name:12s} linear ops: {_summary(err)}")
        for tp in (1, 2, 4, 8):
            sel = prof["num_tensor_parallel_workers"] == tp
            print(f"      tp={tp}: {_summary(err[sel])}")
        norm_err = _norm_pred(prof, cal) / _norm_measured(prof) - 1
        print(f"   {name:12s} norm/rope/add ops: {_summary(norm_err)}")
    print("   shipped latency.H100 linear ops: " + ", ".join(
        f"{n} {_summary(linear_ops_errors(p, H100))}" for n, p in profiles.items()))
    for w, err in allreduce_errors(load_allreduce(vidur_dir / "h100_dgx.all_reduce.csv"), cal).items():
        print(f"   all-reduce {w} GPUs: {_summary(err)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
