"""Metrics on hand-built records, against independent numpy computations."""
import math

import numpy as np
import pytest

from shadowprefill.model.catalog import get_model
from shadowprefill.sim.metrics import CallRecord, NormalRecord, RunResult, common_call_keys, compare, summarize

MODELS = ("Qwen2.5-7B", "Llama-3.1-70B")


def random_run(seed, policy, n_sessions=5, calls=4, drop=()):
    rng = np.random.default_rng(seed)
    run = RunResult(policy=policy, window_s=100.0, energy_j=5e5 + 1e4 * seed, gpus=5, prefill_tokens=12345,
                    shadow_tokens=1000 * seed, shadow_tokens_used=300 * seed, shadow_tokens_window=500 * seed)
    for s in range(n_sessions):
        prev = None
        for k in range(calls):
            if (s, k) in drop:
                continue
            model = MODELS[int(rng.integers(2))]
            arrival = float(rng.uniform(0, 50))
            ttft = float(rng.uniform(0.05, 2.0))
            prompt = int(rng.integers(100, 5000))
            run.calls.append(CallRecord(f"s{s}", k, "task", model, "i0", prev is not None and prev != model,
                                        arrival, arrival + ttft, arrival + ttft + float(rng.uniform(0.1, 3)),
                                        prompt, int(rng.integers(0, prompt)), 0, int(rng.integers(1, 300)),
                                        ttft_slo=1.0, tpot_slo=0.05))
            prev = model
    for i in range(20):
        a = float(rng.uniform(0, 100))
        done = i % 7 != 3
        run.normal.append(NormalRecord(f"n{i}", MODELS[0], "i0", a, 500, 50, 1.0, 0.03,
                                       a + rng.uniform(0.1, 1.5) if done else None,
                                       a + 2.0 + rng.uniform(0, 1.0) if done else None))
    return run


def reference_summary(run, keys):
    calls = [c for c in run.calls if c.key in keys]
    sw = [c for c in calls if c.is_switch]
    lat = np.array([c.finish - c.arrival for c in sw], dtype=np.float64)
    ttft = np.array([c.first_token - c.arrival for c in sw], dtype=np.float64)
    hit = np.sum([c.cached_tokens for c in calls]) / np.sum([c.prompt_tokens for c in calls])
    cost = 0.0
    for c in calls:
        m = get_model(c.model)
        cost += ((c.prompt_tokens - c.cached_tokens) * m.price_input + 0.1 * c.cached_tokens * m.price_input
                 + c.output_tokens * m.price_output) / 1e6
    ok = 0
    for r in run.normal:
        if r.finish is not None:
            tpot = (r.finish - r.first_token) / (r.output_tokens - 1)
            ok += (r.first_token - r.arrival <= r.ttft_slo) and tpot <= r.tpot_slo
    good = ok + sum(1 for c in run.calls if c.ttft <= 1.0 and c.tpot <= 0.05)
    return dict(lat=lat.mean(), ttft=ttft.mean(), hit=hit, cost=cost, slo=ok / len(run.normal),
                energy=run.energy_j / good)


def test_summarize_matches_reference():
    run = random_run(1, "x")
    keys = {c.key for c in run.calls}
    s = summarize(run)
    ref = reference_summary(run, keys)
    assert s["switch_call_latency_mean_s"] == pytest.approx(ref["lat"])
    assert s["switch_call_ttft_mean_s"] == pytest.approx(ref["ttft"])
    assert s["hit_rate"] == pytest.approx(ref["hit"])
    assert s["token_cost"] == pytest.approx(ref["cost"])
    assert s["normal_slo_attainment"] == pytest.approx(ref["slo"])
    assert s["energy_per_good_request_j"] == pytest.approx(ref["energy"])
    assert s["shadow_tokens_unused"] == 700
    assert s["prefill_throughput_tok_s"] == pytest.approx((12345 + 500) / 100.0)
    assert s["num_calls"] == len(run.calls)


def test_compare_uses_common_calls_and_reductions():
    base = random_run(2, "no-shadow")
    other = random_run(3, "harvest-slo", drop={(0, 1), (2, 3)})
    oracle = random_run(4, "oracle+host", drop={(1, 0)})
    runs = {"no-shadow": base, "harvest-slo": other, "oracle+host": oracle}
    keys = common_call_keys(runs.values())
    assert keys == {(f"s{s}", k) for s in range(5) for k in range(4)} - {("s0", 1), ("s2", 3), ("s1", 0)}
    res = compare(runs)
    for name, run in runs.items():
        ref = reference_summary(run, keys)
        assert res[name]["switch_call_latency_mean_s"] == pytest.approx(ref["lat"])
        assert res[name]["num_calls"] == len(keys)
    b, h, o = (reference_summary(r, keys) for r in (base, other, oracle))
    red_h = 100 * (b["lat"] - h["lat"]) / b["lat"]
    red_o = 100 * (b["lat"] - o["lat"]) / b["lat"]
    assert res["harvest-slo"]["switch_call_latency_mean_s_reduction_pct"] == pytest.approx(red_h)
    assert res["harvest-slo"]["token_cost_reduction_pct"] == pytest.approx(100 * (b["cost"] - h["cost"]) / b["cost"])
    assert res["harvest-slo"]["switch_latency_gain_vs_oracle"] == pytest.approx(red_h / red_o)
    assert res["harvest-slo"]["normal_slo_attainment_change_pp"] == pytest.approx(100 * (h["slo"] - b["slo"]))
    assert res["harvest-slo"]["energy_per_good_request_increase_pct"] == pytest.approx(
        100 * (h["energy"] - b["energy"]) / b["energy"])
    assert res["no-shadow"]["switch_call_latency_mean_s_reduction_pct"] == 0.0


def test_empty_and_untracked():
    run = RunResult(policy="eager", window_s=10.0, shadow_tokens=50, extra={"shadow_use_tracked": False})
    s = summarize(run)
    assert s["num_calls"] == 0 and s["switch_call_latency_mean_s"] is None and s["hit_rate"] is None
    assert s["shadow_tokens_unused"] is None and s["normal_slo_attainment"] is None
    assert math.isclose(s["prefill_throughput_tok_s"], 0.0)
    with pytest.raises(ValueError, match="runs"):
        compare({})
