"""The paper's operating point (sim/paper_point.py) and the pooling of demo outputs in
bench/paper_comparison.py (one invocation per seed or window, merged)."""
import math
import pathlib
import random
import statistics
import sys

import pytest

from shadowprefill.model.catalog import resolve_name
from shadowprefill.sim.args import parse_capacity
from shadowprefill.sim.paper_point import PAPER_OBSERVABLES, PAPER_TESTBED_CAPACITY, paper_group
from shadowprefill.sim.study import METRICS, aggregate_pairs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))


def test_capacity_paper_is_the_testbed_table_by_catalog_name():
    caps = parse_capacity("paper")
    assert caps == {"Qwen2.5-7B": 12.8, "Llama-3.1-8B": 11.0, "Llama-3.1-70B": 3.8}
    assert caps is not PAPER_TESTBED_CAPACITY                    # a copy: callers may edit theirs
    assert all(resolve_name(m) == m for m in caps)
    assert parse_capacity("Q2.5-7B=3.5") == {"Qwen2.5-7B": 3.5}
    with pytest.raises(ValueError, match="--capacity"):
        parse_capacity("papers")


def test_paper_groups_and_observables():
    assert paper_group("ghcp-coding") == "ghcp" and paper_group("fusionbench") == "benchmarks"
    assert set(PAPER_OBSERVABLES["ghcp"]) == set(PAPER_OBSERVABLES["benchmarks"])
    assert PAPER_OBSERVABLES["ghcp"]["eager_llm"] < 0 and PAPER_OBSERVABLES["benchmarks"]["eager_llm"] < 0


def _study(rng, seeds, windows, duration=600.0, pairs=(("Qwen2.5-7B", "Llama-3.1-70B"),)):
    runs = []
    for models in pairs:
        for s in seeds:
            for w in windows:
                summaries = {}
                for p in ("no-shadow", "harvest-slo+host", "oracle+host"):
                    summaries[p] = {k: rng.uniform(-5, 30) for k, _ in METRICS}
                    summaries[p].update(num_switch_calls=rng.randint(5, 40), sessions_unfinished=0)
                runs.append(({"workload": "fusionbench", "models": list(models), "seed": s, "window": w,
                              "duration_s": duration}, summaries))
    spec = {"seeds": list(seeds), "windows": list(windows), "warmup_s": 120.0, "session_rate": None, "rho": 0.7,
            "admission": "fcfs", "duration_s": {"fusionbench": duration},
            "policies": ["no-shadow", "harvest-slo+host", "oracle+host"]}
    return {"spec": spec, "runs": runs, "wall_s": 1.0}


def test_merge_pools_seeds_as_one_study_would():
    from paper_comparison import merge
    rng = random.Random(25)
    parts = [_study(rng, [s], ["peak", "median", "trough"]) for s in (0, 1, 2)]
    merged = merge(parts)
    assert merged["spec"]["seeds"] == [0, 1, 2] and len(merged["runs"]) == 9
    key = "switch_call_latency_mean_s_reduction_pct"
    xs = [s["harvest-slo+host"][key] for part in parts for _, s in part["runs"]]
    m, se, n = merged["per_pair"]["fusionbench"]["Q2.5-7B/L3.1-70B"]["harvest-slo+host"][key]
    assert n == 9 and m == pytest.approx(statistics.fmean(xs))
    assert se == pytest.approx(statistics.stdev(xs) / math.sqrt(9))
    assert merged["aggregate"] == aggregate_pairs(merged["runs"])["means"]


def test_merge_refuses_a_run_twice_or_mixed_lengths():
    from paper_comparison import merge
    rng = random.Random(3)
    with pytest.raises(ValueError, match="twice"):
        merge([_study(rng, [0], ["peak"]), _study(rng, [0], ["peak"])])
    with pytest.raises(ValueError, match="durations"):
        merge([_study(rng, [0], ["peak"]), _study(rng, [1], ["peak"], duration=300.0)])
    other = _study(rng, [1], ["peak"])
    other["spec"]["warmup_s"] = 60.0
    with pytest.raises(ValueError, match="warmup_s"):
        merge([_study(rng, [0], ["peak"]), other])


def test_merge_cli_draws_the_pairs_chart(tmp_path, monkeypatch, capsys):
    import json
    import paper_comparison
    rng = random.Random(7)
    pairs = (("Qwen2.5-7B", "Llama-3.1-70B"), ("Llama-3.1-8B", "Llama-3.1-70B"))
    paths = []
    for s in (0, 1):
        path = tmp_path / f"s{s}.json"
        path.write_text(json.dumps(_study(rng, [s], ["peak"], pairs=pairs)))
        paths.append(str(path))
    monkeypatch.setattr(sys, "argv", ["paper_comparison.py", "--merge", "--plot", str(tmp_path / "img"), *paths])
    paper_comparison.main()
    out = capsys.readouterr().out
    chart = tmp_path / "img" / "pairs_switch_latency.png"
    assert chart.stat().st_size > 1000 and str(chart) in out
    assert "| Q2.5-7B/L3.1-70B | harvest-slo+host |" in out and "| L3.1-8B/L3.1-70B | oracle+host |" in out
    monkeypatch.setattr(sys, "argv", ["paper_comparison.py", "--plot", str(tmp_path / "img"), *paths])
    with pytest.raises(SystemExit):                 # a chart of one pooled study only
        paper_comparison.main()
    assert "--plot needs --merge" in capsys.readouterr().err


def test_by_target_model_sums_the_runs_bins_per_model():
    """Figure 9a split by the model switched to: a size bin that names one model of the pair is that model's
    (summed over runs); a pair with both models in one bin is left out; the share of the hit gap closed is
    (H - NS) / (O - NS) of the token-weighted hit rates."""
    from paper_comparison import by_target_model
    rng = random.Random(9)
    runs, want = [], {}
    for models in (("Qwen2.5-7B", "Llama-3.1-70B"), ("Qwen2.5-7B", "Llama-3.1-70B"), ("Llama-3.1-8B", "Mistral-Nemo-12B")):
        summaries = {}
        for p in ("no-shadow", "harvest-slo+host", "oracle+host"):
            lat = {b: rng.uniform(10, 100) for b in ("<15B", ">50B")}
            n = {b: rng.randint(1, 9) for b in lat}
            prompt = {b: rng.randint(10_000, 90_000) for b in lat}
            cached = {b: rng.randint(0, prompt[b]) for b in lat}
            summaries[p] = {"switch_breakdown": {"by_target": {"<15B": [lat["<15B"], n["<15B"]], "15-50B": [0.0, 0],
                                                               ">50B": [lat[">50B"], n[">50B"]]}},
                            "switch_hits": {"by_target": {b: [prompt[b], cached[b]] for b in lat}}}
            if models[1] == "Llama-3.1-70B":
                for b, m in (("<15B", "Qwen2.5-7B"), (">50B", "Llama-3.1-70B")):
                    acc = want.setdefault(m, {}).setdefault(p, [0.0, 0, 0, 0])
                    for i, v in enumerate((lat[b], n[b], prompt[b], cached[b])):
                        acc[i] += v
        runs.append(({"workload": "ghcp-coding", "models": list(models)}, summaries))
    rows = by_target_model({"spec": {"policies": ["no-shadow", "harvest-slo+host", "oracle+host"]}, "runs": runs})
    table = {r.split(" | ")[0].lstrip("| "): r for r in rows if r.startswith("| ") and "|---" not in r}
    assert set(table) == {"target", "Qwen2.5-7B", "Llama-3.1-70B"}     # the 8B/12B pair shares a bin: left out
    for m, by in want.items():
        base, h, o = by["no-shadow"], by["harvest-slo+host"], by["oracle+host"]
        cells = table[m].strip("| ").split(" | ")
        assert int(cells[3]) == base[1] and float(cells[4]) == pytest.approx(base[0] / base[1], abs=0.006)
        assert float(cells[5]) == pytest.approx(100 * (1 - h[0] / base[0]), abs=0.06)
        assert float(cells[6]) == pytest.approx(100 * (1 - o[0] / base[0]), abs=0.06)
        hit = [v[3] / v[2] for v in (base, h, o)]
        assert [float(x) for x in cells[7].split(" / ")] == pytest.approx([100 * x for x in hit], abs=0.06)
        if hit[2] > hit[0]:
            assert float(cells[8]) == pytest.approx((hit[1] - hit[0]) / (hit[2] - hit[0]), abs=0.006)
        else:
            assert cells[8] == "–"
