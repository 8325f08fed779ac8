"""The headline study: mean ± SE aggregation against a hand computation, the paper-side columns, windows
scaling the normal load, and one tiny end-to-end study (two processes, fixed capacities, no calibration)."""
import json
import math
import random
import statistics

import pytest

from shadowprefill.sim.experiment import WINDOW_LOAD, Experiment
from shadowprefill.sim.study import METRICS, StudySpec, aggregate, mean_se, study_table

PAIR = ("Qwen2.5-7B", "Llama-3.1-70B")


def test_mean_se_matches_statistics_module():
    rng = random.Random(3)
    xs = [rng.uniform(-20, 40) for _ in range(9)]
    m, se = mean_se(xs + [math.nan, None])
    assert m == pytest.approx(statistics.fmean(xs))
    assert se == pytest.approx(statistics.stdev(xs) / math.sqrt(len(xs)))
    assert mean_se([2.5]) == (2.5, 0.0)
    assert all(math.isnan(v) for v in mean_se([]))


def _fake_runs(rng, n):
    runs = []
    for i in range(n):
        summaries = {}
        for p in ("no-shadow", "harvest-slo+host", "oracle+host"):
            summaries[p] = {k: rng.uniform(0, 30) for k, _ in METRICS}
            summaries[p].update(num_switch_calls=rng.randint(5, 40), num_calls=rng.randint(50, 200))
        runs.append(({"workload": "fusionbench" if i % 2 else "ghcp-coding"}, summaries))
    return runs


def test_aggregate_groups_by_workload_and_policy():
    rng = random.Random(7)
    runs = _fake_runs(rng, 8)
    agg = aggregate(runs)
    assert set(agg) == {"fusionbench", "ghcp-coding"}
    for w in agg:
        mine = [s for c, s in runs if c["workload"] == w]
        for p in ("no-shadow", "harvest-slo+host", "oracle+host"):
            for key, _ in METRICS:
                xs = [s[p][key] for s in mine]
                m, se, n = agg[w][p][key]
                assert n == 4 and m == pytest.approx(statistics.fmean(xs))
                assert se == pytest.approx(statistics.stdev(xs) / 2)
        key = "switch_call_latency_mean_s_reduction_pct"
        assert agg[w]["share_of_oracle_gain"] == pytest.approx(
            statistics.fmean(s["harvest-slo+host"][key] for s in mine) / statistics.fmean(s["oracle+host"][key]
                                                                                            for s in mine))


def test_windows_scale_normal_load():
    assert WINDOW_LOAD["peak"] == 1.0 and WINDOW_LOAD["trough"] < WINDOW_LOAD["median"] < 1.0
    with pytest.raises(ValueError, match="window"):
        Experiment(models=PAIR, window="noon")
    with pytest.raises(ValueError, match="windows"):
        StudySpec(windows=("noon",))
    with pytest.raises(ValueError, match="no-shadow"):
        StudySpec(policies=("harvest-slo+host", "oracle+host"))


def test_tiny_study_end_to_end(tmp_path, capsys):
    """`demo` end to end on a tiny study (two processes, fixed capacities): study.json's aggregate is the
    mean ± SE of its own per-run summaries, the baseline's reductions are exactly 0, the call counts are
    those of the generated sessions, and the printed table shows the JSON's numbers. Seed 2: its sessions end within a minute."""
    from shadowprefill.cli import main
    from shadowprefill.cluster.workloads import generate_sessions

    rc = main(["demo", "--workloads", "fusionbench", "--seeds", "2", "--windows", "peak,trough", "--duration", "15",
               "--warmup", "5", "--capacity", "Qwen2.5-7B=12.8,Llama-3.1-70B=3.8", "--session-rate", "0.6",
               "--jobs", "2", "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    study = json.loads((tmp_path / "study.json").read_text())
    assert (tmp_path / "study_reductions.png").stat().st_size > 0
    runs = study["runs"]
    assert [c["window"] for c, _ in runs] == ["peak", "trough"]            # experiment order
    assert [c["rho"] * WINDOW_LOAD[c["window"]] for c, _ in runs] == [0.7, 0.7 * WINDOW_LOAD["trough"]]
    # the generated sessions: both windows replay the same ones (same seed), all of them complete
    sessions = generate_sessions("fusionbench", PAIR, duration_s=20.0, seed=2, session_rate=0.6)
    measured = [s for s in sessions if 5.0 <= s.arrival_s < 20.0]
    calls = sum(len(s.calls) for s in measured)
    switches = sum(1 for s in measured for k in range(1, len(s.calls)) if s.calls[k].model != s.calls[k - 1].model)
    assert switches > 0
    policies = study["spec"]["policies"]
    for _, summaries in runs:
        assert list(summaries) == policies
        for p in policies:
            assert summaries[p]["num_calls"] == calls and summaries[p]["num_switch_calls"] == switches
    agg = study["aggregate"]["fusionbench"]
    for p in policies:
        for key, _ in METRICS:
            xs = [s[p][key] for _, s in runs]
            m, se, n = agg[p][key]
            assert n == 2 and m == pytest.approx(statistics.fmean(xs))
            assert se == pytest.approx(statistics.stdev(xs) / math.sqrt(2))
    for key in ("switch_call_latency_mean_s_reduction_pct", "switch_call_ttft_mean_s_reduction_pct",
                "llm_call_latency_mean_s_reduction_pct", "token_cost_reduction_pct"):
        assert agg["no-shadow"][key] == [0.0, 0.0, 2]
    key = "switch_call_latency_mean_s_reduction_pct"
    if agg["oracle+host"][key][0] > 0:
        assert agg["share_of_oracle_gain"] == pytest.approx(agg["harvest-slo+host"][key][0] / agg["oracle+host"][key][0])
    # the printed table is the JSON's aggregate
    for p in policies[1:]:
        block = printed.split(f"\n  {p}\n", 1)[1]
        for key, label in METRICS:
            line = next(ln for ln in block.splitlines() if ln.strip().startswith(label))
            scale = 100.0 if key.endswith("hit_rate") else 1.0
            m, se, _ = agg[p][key]
            assert f"{m * scale:7.1f} ± {se * scale:4.1f}" in line, (p, key, line)
    assert study_table(study) in printed


def test_all_policies_spec_and_figure4(tmp_path):
    """`demo --all-policies` takes the ten policies of Table 2 in the paper's order; the Figure 4 chart
    draws one bar per policy and panel, with the paper's markers, from a study's aggregate."""
    import argparse

    import matplotlib
    matplotlib.use("Agg")
    from shadowprefill.sim.policies import POLICY_ORDER
    from shadowprefill.sim.study import plot_policies, register, spec_from_args

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["demo", "--all-policies", "--policies", "no-shadow,oracle"])
    spec = spec_from_args(args)
    assert spec.policies == POLICY_ORDER and len(spec.policies) == 10
    rng = random.Random(11)
    runs = []
    for i in range(4):
        summaries = {p: {k: rng.uniform(-10, 40) for k, _ in METRICS} for p in POLICY_ORDER}
        for s in summaries.values():
            s.update(num_switch_calls=rng.randint(5, 40), num_calls=rng.randint(50, 200))
        runs.append(({"workload": "ghcp-coding" if i % 2 else "fusionbench"}, summaries))
    study = {"spec": {"policies": list(POLICY_ORDER), "seeds": [0, 1], "windows": ["peak"], "pair": "Q/L"},
             "aggregate": aggregate(runs)}
    import matplotlib.pyplot as plt
    drawn = []
    real_savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        drawn.append(fig)
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = keep
    try:
        path = plot_policies(study, tmp_path)
    finally:
        plt.Figure.savefig = real_savefig
    assert path.stat().st_size > 0 and len(drawn) == 1
    axes = drawn[0].axes
    assert len(axes) == 4                                           # 2 workloads x (all calls, switch calls)
    for ax in axes:
        bars = [p for p in ax.patches]
        assert len(bars) == 10
        workload = "fusionbench" if ax in axes[:2] else "ghcp-coding"
        key = ("llm_call_latency_mean_s_reduction_pct" if ax in (axes[0], axes[2])
               else "switch_call_latency_mean_s_reduction_pct")
        want = [study["aggregate"][workload][p][key][0] for p in POLICY_ORDER]
        assert [b.get_height() for b in bars] == pytest.approx(want)
        markers = [ln for ln in ax.lines if ln.get_marker() == "D"]
        assert len(markers) == 2                                   # Harvest-SLO+Host's and Oracle+Host's


def test_admission_reaches_every_engine():
    """`--admission` (demo and simulate) sets the engines' admission order; FCFS is the default."""
    import argparse

    from shadowprefill.sim.cli import experiment_from_args, register as register_sim
    from shadowprefill.sim.experiment import sim_config
    from shadowprefill.sim.study import register, spec_from_args

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    register_sim(sub)
    for argv, want in ((["demo"], "fcfs"), (["demo", "--admission", "routed-first"], "routed-first")):
        spec = spec_from_args(parser.parse_args(argv))
        assert {sim_config(e).engine.admission for e in spec.experiments()} == {want}
    args = parser.parse_args(["simulate", "--pair", "Q2.5-7B/L3.1-70B", "--out", "x.json",
                              "--admission", "routed-first"])
    assert sim_config(experiment_from_args(args, args.policies)).engine.admission == "routed-first"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--admission", "lifo"])


def test_demo_session_rate_default_and_paper_length():
    """The short default study runs at DEMO_SESSION_RATE; --paper-length keeps each workload's rate."""
    import argparse

    from shadowprefill.sim.study import DEMO_SESSION_RATE, register, spec_from_args

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert spec_from_args(parser.parse_args(["demo"])).session_rate == DEMO_SESSION_RATE
    assert spec_from_args(parser.parse_args(["demo", "--session-rate", "0.3"])).session_rate == 0.3
    paper = spec_from_args(parser.parse_args(["demo", "--paper-length"]))
    assert paper.session_rate is None and all(e.session_rate is None for e in paper.experiments())
