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


def test_paper_pairs_spec_expands_table3():
    """`--pairs paper` runs each workload's Table 3 pairs (six GHCP-coding, five FusionBench), every pair on
    every seed and window; a workload without Table 3 pairs is a ValueError naming `pairs`."""
    from shadowprefill.model.catalog import PAIRS
    spec = StudySpec(workloads=("ghcp-coding", "fusionbench"), pairs=("paper",), seeds=(0, 1), windows=("peak",))
    assert spec.pairs_of("ghcp-coding") == list(PAIRS["ghcp-coding"]) and len(PAIRS["ghcp-coding"]) == 6
    assert len(spec.pairs_of("fusionbench")) == 5
    exps = spec.experiments()
    assert len(exps) == (6 + 5) * 2
    assert {e.models for e in exps if e.workload == "fusionbench"} == set(PAIRS["fusionbench"].values())
    bad = StudySpec(workloads=("fusionbench",), pairs=("paper",))
    bad.workloads = ("nope",)
    with pytest.raises(ValueError, match="pairs"):
        bad.pairs_of("nope")


def test_aggregate_pairs_is_the_mean_over_pair_means():
    from shadowprefill.sim.study import aggregate_pairs
    rng = random.Random(11)
    runs = []
    pairs = {("Qwen2.5-7B", "Llama-3.1-70B"): "Q2.5-7B/L3.1-70B", ("Llama-3.1-8B", "Llama-3.1-70B"): "L3.1-8B/L3.1-70B",
             ("Mistral-7B", "Mixtral-8x22B"): "M-7B/Mx-8x22B"}
    for models in pairs:
        for _ in range(3):
            (config, summaries), = _fake_runs(rng, 1)
            config.update(workload="fusionbench", models=list(models))
            runs.append((config, summaries))
    out = aggregate_pairs(runs)
    assert set(out["per_pair"]["fusionbench"]) == set(pairs.values())
    key = "switch_call_latency_mean_s_reduction_pct"
    per_pair = [statistics.fmean(s["harvest-slo+host"][key] for c, s in runs if tuple(c["models"]) == m)
                for m in pairs]
    m, se, n = out["means"]["fusionbench"]["harvest-slo+host"][key]
    assert n == 3 and m == pytest.approx(statistics.fmean(per_pair))
    assert se == pytest.approx(statistics.stdev(per_pair) / math.sqrt(3))
    oracle = statistics.fmean(statistics.fmean(s["oracle+host"][key] for c, s in runs if tuple(c["models"]) == mm)
                              for mm in pairs)
    assert out["means"]["fusionbench"]["share_of_oracle_gain"] == pytest.approx(m / oracle)


def test_switch_breakdown_bins_against_a_hand_count():
    """Figure 9a/9c: switch calls binned by prompt tokens and by the target's total parameters; the study's
    reduction per bin is 1 - summed latency / No Shadow's summed latency (call-weighted)."""
    from types import SimpleNamespace
    from shadowprefill.sim.metrics import switch_breakdown, switch_hits
    from shadowprefill.sim.study import breakdown, breakdown_table
    rng = random.Random(5)
    models = ("Qwen2.5-7B", "Mistral-Nemo-12B", "Granite-34B-Code", "Llama-3.1-70B")
    size = {"Qwen2.5-7B": "<15B", "Mistral-Nemo-12B": "<15B", "Granite-34B-Code": "15-50B", "Llama-3.1-70B": ">50B"}
    calls = [SimpleNamespace(is_switch=rng.random() < 0.5, prompt_tokens=rng.choice([100, 3000, 70000, 20000]),
                             model=rng.choice(models), latency=rng.uniform(0.5, 20)) for _ in range(200)]
    for c in calls:
        c.cached_tokens = rng.randrange(c.prompt_tokens + 1)
    got = switch_breakdown(calls)
    hits = switch_hits(calls)
    ctx = {100: "<2K", 3000: "2-4K", 20000: "16-32K", 70000: ">64K"}
    for b in ("<2K", "2-4K", "16-32K", ">64K", "4-8K"):
        mine = [c.latency for c in calls if c.is_switch and ctx[c.prompt_tokens] == b]
        assert got["by_context"][b][1] == len(mine) and got["by_context"][b][0] == pytest.approx(sum(mine))
    for b in ("<15B", "15-50B", ">50B"):
        mine = [c.latency for c in calls if c.is_switch and size[c.model] == b]
        assert got["by_target"][b][1] == len(mine) and got["by_target"][b][0] == pytest.approx(sum(mine))
        mine = [c for c in calls if c.is_switch and size[c.model] == b]
        assert hits["by_target"][b] == [sum(c.prompt_tokens for c in mine), sum(c.cached_tokens for c in mine)]
    faster = [SimpleNamespace(**{**vars(c), "latency": c.latency * 0.8, "cached_tokens": c.prompt_tokens})
              for c in calls]
    runs = [({"workload": "ghcp-coding"}, {"no-shadow": {"switch_breakdown": got, "switch_hits": hits},
                                           "harvest-slo+host": {"switch_breakdown": switch_breakdown(faster),
                                                                "switch_hits": switch_hits(faster)}})] * 2
    agg = breakdown(runs)["ghcp-coding"]
    assert agg["by_context"]["harvest-slo+host"][">64K"][0] == pytest.approx(20.0)
    assert agg["by_target"]["harvest-slo+host"][">50B"][1] == 2 * got["by_target"][">50B"][1]
    big = [c for c in calls if c.is_switch and size[c.model] == ">50B"]     # token-weighted, both runs
    assert agg["by_target"]["no-shadow"][">50B"][2] == pytest.approx(
        sum(c.cached_tokens for c in big) / sum(c.prompt_tokens for c in big))
    assert agg["by_target"]["harvest-slo+host"][">50B"][2] == 1.0
    old_study = [({"workload": "ghcp-coding"}, {"no-shadow": {"switch_breakdown": got}})]   # before switch_hits
    assert math.isnan(breakdown(old_study)["ghcp-coding"]["by_target"]["no-shadow"][">50B"][2])
    assert "20.5" in breakdown_table({"breakdown": breakdown(runs)})


def test_demo_pairs_end_to_end(tmp_path, capsys):
    """`demo --pairs A,B`: per-pair aggregates, the mean over pairs as the aggregate, the per-pair table and
    the Figure 9 breakdown printed, the per-pair chart written (tiny runs, fixed capacities)."""
    from shadowprefill.cli import main
    rc = main(["demo", "--workloads", "fusionbench", "--pairs", "Q2.5-7B/L3.1-70B,L3.1-8B/L3.1-70B", "--seeds", "2",
               "--windows", "peak", "--duration", "10", "--warmup", "5", "--session-rate", "0.6", "--jobs", "1",
               "--capacity", "Qwen2.5-7B=12.8,Llama-3.1-70B=3.8,Llama-3.1-8B=11.0", "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    study = json.loads((tmp_path / "study.json").read_text())
    per_pair = study["per_pair"]["fusionbench"]
    assert set(per_pair) == {"Q2.5-7B/L3.1-70B", "L3.1-8B/L3.1-70B"}
    key = "llm_call_latency_mean_s_reduction_pct"
    ms = [per_pair[p]["harvest-slo+host"][key][0] for p in per_pair]
    assert study["aggregate"]["fusionbench"]["harvest-slo+host"][key][0] == pytest.approx(statistics.fmean(ms))
    assert "mean over pairs" in printed and "Figure 9c" in printed and "Figure 9a" in printed
    assert (tmp_path / "pairs_switch_latency.png").stat().st_size > 0
    n_switch = sum(s["no-shadow"]["num_switch_calls"] for _, s in study["runs"])
    by_context = study["breakdown"]["fusionbench"]["by_context"]["no-shadow"]
    assert sum(n for _, n, _ in by_context.values()) == n_switch
    assert all(0.0 <= hit <= 1.0 for _, n, hit in by_context.values() if n)    # runs now carry switch_hits


def test_session_window_fits_the_smallest_kv_pool():
    """GHCP-like contexts reach 131K tokens; Gemma-7B's pool on one H100 holds ~115K, so the pair's sessions
    compact earlier and every call (prompt + output) fits; pairs with big pools keep the workload's spec."""
    from shadowprefill.cluster.workloads import get_workload
    from shadowprefill.model.latency import LatencyModel
    from shadowprefill.sim.experiment import build_sessions, session_workload
    big = Experiment(workload="ghcp-coding", models=PAIR)
    assert session_workload(big) is get_workload("ghcp-coding")
    exp = Experiment(workload="ghcp-coding", models=("Gemma-7B", "Mixtral-8x7B"), duration_s=600, warmup_s=60,
                     session_rate=0.2, seed=1)
    pool = LatencyModel("Gemma-7B").max_kv_tokens(0.9) // 16 * 16
    assert session_workload(exp).context_window < pool < get_workload("ghcp-coding").context_window
    longest = max(s.prompt_len(k) + c.output_tokens for s in build_sessions(exp) for k, c in enumerate(s.calls))
    assert longest <= pool
