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

`--by-model` adds a table per model over the measured window (issue 25: why some targets' shadows cover more
of a switch prefix): T, t̂(B) / T, the branch shares, the room b − t̂(B) the SLO branch left, the cached
context of the first runnable job with t̂ of an n_min chunk there, how often that chunk fit the room, how
often the iteration took chunks, and the shadow tokens each instance computed per second; and over the whole
run, from the engines' own counters, the shadow tokens computed and used (hit by a routed call) and the share
of shadow pages lost (evicted and dropped before any routed hit).
`--block-steps` prints, per model of the workload's pairs, how far the FA3 model's whole-query-block rounding
puts a chunk's cost above a straight line in its size (t̂'s chunk term); `--attn-block-rows 1` runs without
that rounding (a diagnostic).

    python bench/budget_check.py --pair L3.1-8B/L3.1-70B --seed 2 --window median --paper-length --by-model

The classification wraps `engine.shadow_work.take` (the scheduler's shadow phase calls it to admit shadow chunks)
and `LLMEngine.schedule_step` for the run (a diagnostic; the
engine's behaviour is unchanged).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shadowprefill.engine.llm_engine as llm_engine  # noqa: E402
import shadowprefill.engine.shadow_work as shadow_work  # noqa: E402
from shadowprefill.cluster.call_stats import percentile  # noqa: E402
from shadowprefill.sim import experiment  # noqa: E402
from shadowprefill.sim.args import check_pair  # noqa: E402
from shadowprefill.sim.capacity import normal_rates  # noqa: E402
from shadowprefill.sim.study import PAPER_DURATION_S  # noqa: E402


def _quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    return (f"p25 {percentile(values, 25):.3f}  median {percentile(values, 50):.3f}  "
            f"p90 {percentile(values, 90):.3f}  max {max(values):.3f}  (n {len(values)})")


def run(workload: str, window: str, duration: float, policy: str, admission: str = "fcfs", seed: int = 0,
        capacity: dict | None = None, warmup: float = 120.0, instances: int = 4,
        session_rate: float | None = None, models: tuple[str, str] = ("Qwen2.5-7B", "Llama-3.1-70B")) -> dict:
    """Simulate one window; return {"reasons", "branches", "iteration_over_T", "filled_over_b",
    "filled_over_b_by_model", "by_model", "shadow_tokens_window", "wall_s"} ("by_model": see `by_model_rows`;
    "shadow_tokens_window": the engines' own count of shadow tokens computed in the measured window)."""
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

    # per model, over the measured window: (branch, b, t̂(B) or None, first job's context, t̂ of its n_min chunk,
    # tokens taken) per iteration with a runnable job; the engines and T seen
    end = warmup + duration
    fit: dict[str, list[tuple]] = collections.defaultdict(list)
    engines: dict[str, dict] = collections.defaultdict(dict)   # model -> {id: engine}
    tpot: dict[str, float] = {}

    def classify(queue, budget, kv, now, **options):       # take's keywords (overlap, probe) pass through
        front = next(queue.runnable(budget.n_min), None) if len(queue) and warmup <= now < end else None
        if front is not None:                               # read before take moves them (t̂(B) is cached
            base = budget.used_s if budget.branch == "slo" and budget.seconds > 0.0 else None   # as take reads it)
            ctx = front.num_cached
            chunk_s = budget.predictor.chunk_time(budget.n_min, ctx)
        chunks = take(queue, budget, kv, now, **options)
        if front is not None:
            fit[kv.model_id or "model"].append((budget.branch, budget.seconds, base, ctx, chunk_s,
                                                sum(n for _, n in chunks)))
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
        model = engine.kv.model_id or "model"
        engines[model][id(engine)] = engine
        tpot[model] = engine.controller.tpot_slo
        it = schedule_step(engine)
        if it is not None:
            over_t[model].append(it.duration / engine.controller.tpot_slo)
            if it.budget_s > 0.0:
                over_b[model].append(it.duration / it.budget_s)
        return it

    shadow_work.take, llm_engine.LLMEngine.schedule_step = classify, timed_step
    try:
        result = experiment.run_policy(exp, policy, sessions, rates)
    finally:
        shadow_work.take, llm_engine.LLMEngine.schedule_step = take, schedule_step
    return {"reasons": reasons, "branches": collections.Counter(result.extra["budget_branches"]),
            "iteration_over_T": over_t, "filled_over_b": [r for rs in over_b.values() for r in rs],
            "filled_over_b_by_model": over_b,
            "by_model": by_model_rows(fit, tpot, {m: list(e.values()) for m, e in engines.items()}, duration),
            "shadow_tokens_window": result.shadow_tokens_window,
            "wall_s": result.extra["wall_s"]}


def by_model_rows(fit: dict, tpot: dict, engines: dict, duration: float) -> list[dict]:
    """Per model, over the iterations of the measured window that had a runnable shadow job: T (ms), t̂(B) / T
    on the SLO branch, branch shares, the SLO branch's room b − t̂(B) (ms), the first job's cached context and
    t̂ of an n_min chunk there (ms), how often that chunk fit the room, how often chunks were taken, and the
    shadow tokens per second per instance; and over the whole run, from the model's engines' own counters, the
    shadow tokens computed and those a routed call hit (promoted pages), the shadow pages allocated, and the
    share of them lost (evicted and dropped without a routed hit)."""
    rows = []
    instances = {m: len(e) for m, e in engines.items()}
    for model, its in sorted(fit.items()):
        computed = sum(e.stats.shadow_tokens for e in engines.get(model, ()))
        kvs = [e.kv_stats for e in engines.get(model, ())]
        allocated = sum(k.shadow_blocks_allocated for k in kvs)
        T = tpot[model]
        slo = [r for r in its if r[2] is not None]
        branches = collections.Counter(r[0] for r in its)
        rows.append({
            "model": model, "instances": instances.get(model, 0), "tpot_slo_ms": 1e3 * T,
            "iterations_with_work": len(its),
            "branch_share": {k: v / len(its) for k, v in sorted(branches.items())},
            "slo_base_over_T_median": statistics.median(r[2] / T for r in slo) if slo else None,
            "slo_room_ms_median": 1e3 * statistics.median(r[1] - r[2] for r in slo) if slo else None,
            "front_context_median": statistics.median(r[3] for r in its),
            "front_chunk_ms_median": 1e3 * statistics.median(r[4] for r in its),
            "slo_front_chunk_fits": sum(r[1] - r[2] >= r[4] for r in slo) / len(slo) if slo else None,
            "took_chunks": sum(r[5] > 0 for r in its) / len(its),
            "shadow_tok_per_s_per_instance": sum(r[5] for r in its) / duration / max(instances.get(model, 1), 1),
            "run_shadow_tokens": computed, "run_shadow_tokens_used": sum(k.shadow_tokens_used for k in kvs),
            "run_shadow_pages": allocated,
            "run_shadow_pages_lost": sum(k.shadow_blocks_wasted for k in kvs) / allocated if allocated else None,
        })
    return rows


def by_model_table(rows: list[dict]) -> str:
    head = ("| model | T (ms) | iterations with a runnable job | branch blocked / credit / slo | t̂(B) / T (slo) | "
            "room b − t̂(B) (slo, ms) | first job's context | t̂ of an n_min chunk there (ms) | "
            "it fits the room (slo) | took chunks | shadow tokens / s / instance | run: shadow tokens computed / "
            "used | shadow pages lost |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        b = r["branch_share"]
        dash = "–"
        out.append(f"| {r['model']} | {r['tpot_slo_ms']:.1f} | {r['iterations_with_work']:,} | "
                   f"{100 * b.get('blocked', 0):.0f} / {100 * b.get('credit', 0):.0f} / {100 * b.get('slo', 0):.0f}% | "
                   + (f"{r['slo_base_over_T_median']:.2f} | {r['slo_room_ms_median']:.1f} | "
                      if r["slo_room_ms_median"] is not None else f"{dash} | {dash} | ")
                   + f"{r['front_context_median'] / 1e3:.1f}K | {r['front_chunk_ms_median']:.1f} | "
                   + (f"{100 * r['slo_front_chunk_fits']:.0f}%" if r["slo_front_chunk_fits"] is not None else dash)
                   + f" | {100 * r['took_chunks']:.1f}% | {r['shadow_tok_per_s_per_instance']:.0f} | "
                   f"{r['run_shadow_tokens']:,} / {r['run_shadow_tokens_used']:,} | "
                   + (f"{100 * r['run_shadow_pages_lost']:.0f}% |" if r["run_shadow_pages_lost"] is not None else "– |"))
    return "\n".join(out)


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


def block_steps(workload: str = "ghcp-coding", contexts=(16384, 40960), n_min: int = 256, decodes: int = 64,
                decode_context: int = 2048) -> dict:
    """{model: (query rows per token, {context: (chunk, iteration)})} for every model of the workload's Table 3
    pairs: the FA3 model charges a partial 128-row query block as a whole one and packs a GQA group's heads into
    the rows, so a chunk's cost is a staircase in its size with steps of 128 / rows tokens, where t̂'s chunk
    term is a straight line. `chunk`: the largest ratio, over page-aligned chunks of n_min to 2 n_min tokens at
    the cached context, of the chunk's added time to the straight line through its two block-aligned ends;
    `iteration`: the same for the whole iteration (beside `decodes` decodes at `decode_context`)."""
    from shadowprefill.model.catalog import PAIRS
    from shadowprefill.model.latency import LatencyModel
    models = sorted({m for pair in PAIRS[workload].values() for m in pair})
    out = {}
    for model in models:
        lm = LatencyModel(model, "h100")
        dec = [decode_context] * decodes
        base = lm.iteration_time([], dec)
        by_ctx = {}
        for ctx in contexts:
            added = {n: lm.iteration_time([(n, ctx)], dec) - base for n in range(n_min, 2 * n_min + 1, 16)}
            line = {n: added[n_min] + (added[2 * n_min] - added[n_min]) * (n - n_min) / n_min for n in added}
            by_ctx[ctx] = (max(added[n] / line[n] for n in added), max((base + added[n]) / (base + line[n]) for n in added))
        out[model] = (lm.shape.heads // lm.shape.kv_heads, by_ctx)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="ghcp-coding")
    p.add_argument("--window", default="peak", choices=sorted(experiment.WINDOW_LOAD))
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--paper-length", action="store_true", help="the paper's run length for the workload (--duration ignored)")
    p.add_argument("--policy", default="harvest-slo+host")
    p.add_argument("--admission", default="fcfs", choices=("fcfs", "routed-first"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pair", default="Q2.5-7B/L3.1-70B",
                   help="the two models, catalog names or the paper's short labels (default: %(default)s)")
    p.add_argument("--chunk-table", action="store_true",
                   help="only print the chunk-cost table (n_min 64/256/512/1,024 tokens at 0-64K cached) under the "
                        "flat 0.5-of-peak, FA2 and FA3 attention models; no simulation")
    p.add_argument("--block-steps", action="store_true",
                   help="only print, per model of the workload's pairs, how far the FA3 model's whole-query-block "
                        "rounding puts a chunk's cost above a straight line in its size; no simulation")
    p.add_argument("--attn-block-rows", type=int, default=None,
                   help="diagnostic: run with the FA3 model's query block of this many rows instead of 128 "
                        "(1: no whole-block rounding); capacities are not recalibrated")
    p.add_argument("--by-model", action="store_true", help="also print the per-model table (see the module docstring)")
    p.add_argument("--json", help="write the per-model rows here")
    args = p.parse_args()
    if args.paper_length:
        args.duration = PAPER_DURATION_S[args.workload]
    if args.block_steps:
        from shadowprefill.model.latency import ATTN_BLOCK_M
        print("a chunk's added time over the straight line between its block-aligned sizes (256..512 tokens, "
              "beside 64 decodes at 2K), max over page-aligned sizes: chunk / iteration")
        for model, (rows, by_ctx) in block_steps(args.workload).items():
            print(f"  {model:18s} {rows:2d} query rows per token (steps of {ATTN_BLOCK_M // rows:3d} tokens): "
                  + ", ".join(f"{ctx // 1024}K {c:.3f} / {i:.3f}" for ctx, (c, i) in by_ctx.items()))
        return
    if args.attn_block_rows is not None:
        if args.attn_block_rows < 1:
            p.error("--attn-block-rows: expected an int >= 1")
        import shadowprefill.model.latency as latency
        latency.ATTN_BLOCK_M = args.attn_block_rows      # read by LatencyModel.attention_s at each call
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
    if args.by_model:
        print(f"per model, iterations of the measured window with a runnable shadow job (seed {args.seed}):")
        print(by_model_table(out["by_model"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out["by_model"], f, indent=1)


if __name__ == "__main__":
    main()
