"""Where Algorithm 1's budget goes in one simulated run: why shadow chunks do (not) join iterations.

    python bench/budget_check.py --workload ghcp-coding --window peak --duration 300
    python bench/budget_check.py --workload fusionbench --policy harvest-slo --admission routed-first
    python bench/budget_check.py --pair G-7B/Mx-8x7B --window trough    # another Table 3 pair

One window of one pair (the paper's headline Q2.5-7B/L3.1-70B unless `--pair`; 4 instances per model, ρ = 0.7, the workload's own session rate, seed 0)
under one shadow policy. Every iteration that had shadow work queued is classified by what stopped line 10-12
for the first runnable job (in queue order):

- `b <= 0 (branch)`: lines 1-9 gave no budget (blocked: waiting queue or admission blocked; slo: a request
  in the batch has no slack left; credit: none accrued);
- `kv room`: line 11, no free or cold shadow pages;
- `time, ctx NK`: line 10, no n_min-token chunk fits b at that job's cached context (N rounded down to 8K);
- `took chunks`: it ran shadow work.

It also prints the branch counts, the iteration time as a fraction of the TPOT SLO T (the paper's Figure 3b
reads a median of about 0.25 at the peak hour), and for iterations given shadow chunks under a whole-iteration
budget (SLO-slack or idle branch) their executed duration / b: above 1 the controller overspent its slack
(engine stats `shadow_over_budget`, `shadow_budget_ratio_max`).

The classification wraps `engine.shadow_work.take` (the scheduler's shadow phase calls it to admit shadow chunks)
and `LLMEngine.schedule_step` for the run (a diagnostic; the
engine's behaviour is unchanged).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shadowprefill.engine.llm_engine as llm_engine  # noqa: E402
import shadowprefill.engine.shadow_work as shadow_work  # noqa: E402
from shadowprefill.cluster.call_stats import percentile  # noqa: E402
from shadowprefill.sim import experiment  # noqa: E402
from shadowprefill.sim.args import check_pair  # noqa: E402
from shadowprefill.sim.capacity import normal_rates  # noqa: E402


def _quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    return (f"p25 {percentile(values, 25):.3f}  median {percentile(values, 50):.3f}  "
            f"p90 {percentile(values, 90):.3f}  max {max(values):.3f}  (n {len(values)})")


def run(workload: str, window: str, duration: float, policy: str, admission: str = "fcfs", seed: int = 0,
        capacity: dict | None = None, warmup: float = 120.0, instances: int = 4,
        session_rate: float | None = None, models: tuple[str, str] = ("Qwen2.5-7B", "Llama-3.1-70B")) -> dict:
    """Simulate one window; return {"reasons", "branches", "iteration_over_T", "filled_over_b",
    "filled_over_b_by_model", "wall_s"}."""
    exp = experiment.Experiment(workload=workload, models=tuple(models),
                                policies=["no-shadow", policy], duration_s=duration, warmup_s=warmup, seed=seed,
                                window=window, capacity=dict(capacity or {}), sim={"admission": admission},
                                instances=instances, session_rate=session_rate)
    rates, _ = normal_rates(exp.models, experiment.sim_config(exp), exp.rho * experiment.WINDOW_LOAD[window],
                            lengths=exp.lengths, capacity=exp.capacity)
    sessions = experiment.build_sessions(exp)
    reasons: collections.Counter = collections.Counter()
    over_t: dict[str, list[float]] = collections.defaultdict(list)
    over_b: dict[str, list[float]] = collections.defaultdict(list)
    take, schedule_step = shadow_work.take, llm_engine.LLMEngine.schedule_step

    def classify(queue, budget, kv, now, **options):       # take's keywords (overlap, probe) pass through
        chunks = take(queue, budget, kv, now, **options)
        if len(queue) == 0:
            return chunks
        if chunks:
            reasons["took chunks"] += 1
        elif budget.seconds <= 0.0:
            reasons[f"b <= 0 ({budget.branch})"] += 1
        else:
            job = next(queue.runnable(budget.n_min), None)
            if job is None:
                reasons["no job with n_min pending tokens"] += 1
            elif budget.read_kv_room(queue.block_size) < budget.n_min:
                reasons["kv room"] += 1
            elif budget.room() < budget.n_min:
                reasons["token or sequence room"] += 1
            else:
                reasons[f"time, ctx {min(job.num_cached // 8192 * 8, 64)}K"] += 1
        return chunks

    def timed_step(engine):
        it = schedule_step(engine)
        if it is not None:
            over_t[engine.kv.model_id or "model"].append(it.duration / engine.controller.tpot_slo)
            if it.budget_s > 0.0:
                over_b[engine.kv.model_id or "model"].append(it.duration / it.budget_s)
        return it

    shadow_work.take, llm_engine.LLMEngine.schedule_step = classify, timed_step
    try:
        result = experiment.run_policy(exp, policy, sessions, rates)
    finally:
        shadow_work.take, llm_engine.LLMEngine.schedule_step = take, schedule_step
    return {"reasons": reasons, "branches": collections.Counter(result.extra["budget_branches"]),
            "iteration_over_T": over_t, "filled_over_b": [r for rs in over_b.values() for r in rs],
            "filled_over_b_by_model": over_b,
            "wall_s": result.extra["wall_s"]}


def chunk_costs(models=("Qwen2.5-7B", "Llama-3.1-70B"), n_min: int = 256, decodes: int = 64,
                decode_context: int = 2048, attn_model: str | None = None) -> dict:
    """{model: {cached context: ms}}: what one n_min-token shadow chunk adds to an iteration of `decodes`
    decodes at `decode_context` tokens, by the chunk's cached context (the simulator's H100 latency model;
    `attn_model`: "fa3" (default), "fa2" or "flat", the earlier 0.5-of-peak attention)."""
    import dataclasses

    from shadowprefill.model.latency import H100, LatencyModel
    cal = H100 if attn_model is None else dataclasses.replace(H100, attn_model=attn_model)
    out = {}
    for model in models:
        lm = LatencyModel(model, "h100", cal=cal)
        base = lm.iteration_time([], [decode_context] * decodes)
        out[model] = {ctx: 1e3 * (lm.iteration_time([(n_min, ctx)], [decode_context] * decodes) - base)
                      for ctx in (0, 8192, 16384, 40960, 65536)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="ghcp-coding")
    p.add_argument("--window", default="peak", choices=sorted(experiment.WINDOW_LOAD))
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--policy", default="harvest-slo+host")
    p.add_argument("--admission", default="fcfs", choices=("fcfs", "routed-first"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pair", default="Q2.5-7B/L3.1-70B",
                   help="the two models, catalog names or the paper's short labels (default: %(default)s)")
    p.add_argument("--chunk-table", action="store_true",
                   help="only print the chunk-cost table (n_min 64/256/512/1,024 tokens at 0-64K cached) under the "
                        "flat 0.5-of-peak, FA2 and FA3 attention models; no simulation")
    args = p.parse_args()
    if args.chunk_table:
        for n_min in (64, 256, 512, 1024):
            print(f"a {n_min}-token chunk beside 64 decodes at 2K adds (ms), by cached context 0 / 8K / 16K / 40K / 64K:")
            for attn in ("flat", "fa2", "fa3"):
                for model, costs in chunk_costs(n_min=n_min, attn_model=attn).items():
                    print(f"  {attn:5s} {model:14s}" + "".join(f"{ms:8.2f}" for ms in costs.values()))
        return
    try:
        models = experiment.parse_models(args.pair, args.workload)
        check_pair(models, args.pair)
    except ValueError as e:
        p.error(f"--pair: {e}")
    out = run(args.workload, args.window, args.duration, args.policy, args.admission, args.seed, models=models)
    total = sum(out["reasons"].values())
    print(f"{args.workload} {'/'.join(models)} {args.window}, {args.policy}, {args.duration:.0f} s after 120 s "
          f"({out['wall_s']:.0f} s wall)")
    print("iterations with shadow work queued, by what stopped Algorithm 1 lines 10-12:")
    for reason, n in out["reasons"].most_common():
        print(f"  {reason:34s} {n:8d}  {100 * n / total:5.1f}%")
    print("budget branches (all iterations):", dict(out["branches"]))
    for model, values in out["iteration_over_T"].items():
        print(f"iteration / T, {model}: {_quantiles(values)}")
    print(f"filled iterations (SLO-slack, idle), duration / b: {_quantiles(out['filled_over_b'])}")
    for model, values in out["filled_over_b_by_model"].items():
        print(f"  {model}: {_quantiles(values)}; past b: {100 * sum(v > 1.0 for v in values) / len(values):.1f}%")
    for model, costs in chunk_costs(models).items():
        print(f"a 256-token chunk beside 64 decodes adds, {model}: "
              + ", ".join(f"{ms:.1f} ms at {ctx // 1024}K" for ctx, ms in costs.items()))


if __name__ == "__main__":
    main()
