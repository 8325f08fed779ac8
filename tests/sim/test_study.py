"""The headline study: mean ± SE aggregation against a hand computation, the paper-side columns, windows
scaling the normal load, and one tiny end-to-end study (two processes, fixed capacities, no calibration)."""
import math
import random
import statistics

import pytest

from shadowprefill.sim.experiment import WINDOW_LOAD, Experiment
from shadowprefill.sim.study import (
    METRICS,
    StudySpec,
    aggregate,
    mean_se,
    plot_study,
    run_study,
    study_table,
)

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


def test_tiny_study_end_to_end(tmp_path):
    spec = StudySpec(workloads=("fusionbench",), seeds=(0,), windows=("peak", "trough"),
                     duration_s={"fusionbench": 20.0}, warmup_s=5.0, max_drain_s=60.0,
                     capacity={"Qwen2.5-7B": 12.8, "Llama-3.1-70B": 3.8}, session_rate=0.6, jobs=2)
    study = run_study(spec)
    assert len(study["runs"]) == 2
    loads = sorted(c["window"] for c, _ in study["runs"])
    assert loads == ["peak", "trough"]
    agg = study["aggregate"]["fusionbench"]
    assert agg["no-shadow"]["num_switch_calls"][0] > 0
    for p in spec.policies:
        for key, _ in METRICS:
            m, se, n = agg[p][key]
            assert n == 2 and math.isfinite(m) and se >= 0, (p, key, m)
    assert agg["no-shadow"]["switch_call_latency_mean_s_reduction_pct"][0] == 0.0
    table = study_table(study)
    assert "harvest-slo+host" in table and "share of Oracle+Host" in table
    assert plot_study(study, tmp_path).stat().st_size > 0
