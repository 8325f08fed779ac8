"""Where No Shadow's switch-call prefix hits go: first visits, eviction, placement (issue 25).

    python bench/switch_hits.py --workload ghcp-coding --window peak
    python bench/switch_hits.py --workload ghcp-coding --window peak --capacity paper

One run of the paper's pair (4 instances per model, ρ = 0.7, seed 0, 300 s after 60 s, 0.1 sessions/s: the
short default of docs/paper-comparison.md) under one policy. When a switch call of a session measured in the
window is placed, the wrapper peeks (`Instance.cached_prefix_tokens`, nothing changes) at what every instance
of the target model holds of its prompt. Token-weighted over those calls it prints:

- the unbounded-cache bound (`session_stats`' rule: the prefix the session left on that model last time);
- how much of the prompt is a first visit to the model (bound 0: nothing any cache could hit);
- lost to eviction: the bound minus the best instance's cached prefix (no instance holds it any more);
- lost to placement: the best instance's prefix minus the chosen instance's (§3.1: the lowest estimated
  prefill completion time may pick a colder, idler instance);
- the hit rate the run measured at admission (`cached_tokens`; below the chosen instance's prefix only if the
  prefix was evicted while the call queued);
- for returning calls, how long the session had been away from the model (since its last call there),
  split by whether the call got at least half of its bound;
- the normal traffic per instance and how long it takes to write a pool's worth of KV
  (pool tokens / (rate × mean Azure prompt + output)), the pool's turnover time.

The wrapper is around `ClusterManager.submit_call` for the run only (a diagnostic; the run is unchanged).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shadowprefill.cluster import manager as manager_mod  # noqa: E402
from shadowprefill.cluster.traces import sample_lengths  # noqa: E402
from shadowprefill.model.latency import LatencyModel  # noqa: E402
from shadowprefill.sim import experiment, simulator  # noqa: E402
from shadowprefill.sim.capacity import normal_rates  # noqa: E402
from shadowprefill.sim.paper_point import PAPER_TESTBED_CAPACITY  # noqa: E402


def unbounded_hit(session, k: int, model: str) -> int:
    """Tokens of call k's prompt an unbounded per-model cache holds (`session_stats`' rule)."""
    j = next((i for i in range(k - 1, -1, -1) if session.calls[i].model == model), None)
    if j is None:
        return 0
    cached = session.prompt_len(j) + session.calls[j].output_tokens
    for i in range(j + 1, k + 1):
        cached = min(cached, session.kept_prefix(i))
    return min(cached, session.prompt_len(k) - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="ghcp-coding")
    ap.add_argument("--pair", default="Q2.5-7B/L3.1-70B")
    ap.add_argument("--window", default="peak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--session-rate", type=float, default=0.1)
    ap.add_argument("--capacity", choices=("ours", "paper"), default="ours",
                    help="ours: calibrated (sim/data/capacity.json); paper: the testbed's (appendix D.1)")
    ap.add_argument("--policy", default="no-shadow")
    args = ap.parse_args(argv)
    if not (args.duration > 0 and args.warmup >= 0 and args.session_rate > 0):
        raise ValueError("--duration and --session-rate must be > 0, --warmup >= 0")

    models = experiment.parse_models(args.pair)
    if args.capacity == "paper" and not set(models) <= set(PAPER_TESTBED_CAPACITY):
        raise ValueError(f"--capacity paper: the testbed's capacities cover {sorted(PAPER_TESTBED_CAPACITY)}, "
                         f"not all of --pair {args.pair}")
    capacity = {m: PAPER_TESTBED_CAPACITY[m] for m in models} if args.capacity == "paper" else {}
    exp = experiment.Experiment(workload=args.workload, models=models, policies=[args.policy],
                                duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                                window=args.window, capacity=capacity, session_rate=args.session_rate,
                                sim={"max_drain_s": 900.0})
    sessions = experiment.build_sessions(exp)
    by_id = {s.session_id: s for s in sessions}
    cfg = experiment.sim_config(exp)
    rates, caps = normal_rates(exp.models, cfg, exp.rho * experiment.WINDOW_LOAD[exp.window],
                               lengths=exp.lengths, capacity=exp.capacity)

    records, last_on, clocks = [], {}, []
    submit, init = manager_mod.ClusterManager.submit_call, simulator.Simulator.__init__

    def traced_init(self, *a, **kw):
        init(self, *a, **kw)
        clocks.append(self.clock)

    def traced_submit(self, session_id, call_index, model, prompt, *a, tenant="", **kw):
        state = self.sessions.get((tenant, session_id)) if session_id is not None else None
        now = clocks[-1].now()
        rec = None
        if state is not None and state.current_model not in (None, model):
            held = {inst.name: sum(inst.cached_prefix_tokens(prompt, tenant)) for inst in self.instances[model]}
            rec = dict(sid=session_id, k=call_index, prompt=len(prompt), held=held, now=now,
                       bound=unbounded_hit(by_id[session_id], call_index, model),
                       away=None if (session_id, model) not in last_on else now - last_on[(session_id, model)])
        last_on[(session_id, model)] = now
        ticket = submit(self, session_id, call_index, model, prompt, *a, tenant=tenant, **kw)
        if rec is not None:
            rec["chosen"] = ticket.instance.name
            records.append(rec)
        return ticket

    manager_mod.ClusterManager.submit_call, simulator.Simulator.__init__ = traced_submit, traced_init
    try:
        run = experiment.run_policy(exp, args.policy, sessions, rates)
    finally:
        manager_mod.ClusterManager.submit_call, simulator.Simulator.__init__ = submit, init

    w0, w1 = args.warmup, args.warmup + args.duration
    meas = [r for r in records if w0 <= by_id[r["sid"]].arrival_s < w1]
    if not meas:
        print("no measured switch calls")
        return 0
    total = sum(r["prompt"] for r in meas)

    def share(f) -> float:
        return sum(f(r) for r in meas) / total

    done = {(c.session_id, c.call_index): c for c in run.calls}
    admitted = sum((done[(r["sid"], r["k"])].cached_tokens or 0) for r in meas if (r["sid"], r["k"]) in done)
    print(f"{args.workload} {args.pair} seed {args.seed} {args.window}, capacity {args.capacity}, {args.policy}: "
          f"{len(meas)} measured switch calls, {total} prompt tokens")
    first = [r for r in meas if r["bound"] == 0]
    print(f"  unbounded-cache bound          {share(lambda r: r['bound']):.3f}")
    print(f"  first visits (bound 0)         {len(first)} calls, {sum(r['prompt'] for r in first) / total:.3f} of tokens")
    print(f"  lost to eviction               {share(lambda r: r['bound'] - max(r['held'].values())):.3f}")
    print(f"  lost to placement              {share(lambda r: max(r['held'].values()) - r['held'][r['chosen']]):.3f}")
    print(f"  chosen instance at placement   {share(lambda r: r['held'][r['chosen']]):.3f}")
    print(f"  hit rate at admission (run)    {admitted / total:.3f}")
    ret = [r for r in meas if r["bound"] > 0 and r["away"] is not None]
    for label, hit in (("returns that hit (>= half the bound)", True), ("returns that missed", False)):
        away = [r["away"] for r in ret if (r["held"][r["chosen"]] >= 0.5 * r["bound"]) == hit]
        if away:
            print(f"  {label}: {len(away)} calls, away from the model median {statistics.median(away):.0f} s "
                  f"({min(away):.0f}-{max(away):.0f} s)")
    prompt, output = sample_lengths(100_000, np.random.default_rng(0), exp.lengths)
    per_request = float(np.mean(prompt + output))
    for m in exp.models:
        pool = LatencyModel(m, cfg.gpu, tp=cfg.tp.get(m)).max_kv_tokens(cfg.hbm_fraction)
        rate = rates[m]
        print(f"  {m}: capacity {caps[m]:.2f} req/s, normal {rate:.2f} req/s per instance x {per_request:.0f} "
              f"tokens; pool {pool} tokens, turnover {pool / (rate * per_request):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
