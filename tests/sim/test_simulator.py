"""Discrete-event simulator: determinism, conservation, the direction of the paper's effects on a small
constructed workload, and an end-to-end `simulate` CLI run. Tiny durations (a few simulated seconds)."""
import json

import pytest

from shadowprefill.cluster.workloads import Call, Session
from shadowprefill.sim.cli import main as cli_main
from shadowprefill.sim.metrics import compare, summarize
from shadowprefill.sim.simulator import SimConfig, Simulator

SMALL, LARGE = "Qwen2.5-7B", "Llama-3.1-8B"
_CACHE: dict = {}


def constructed_sessions(n=6, calls=6, first=3000):
    """n sessions arriving 2.5 s apart; the route switches model every second call (calls 2, 4, ...)."""
    out = []
    for i in range(n):
        cs = [Call((SMALL, LARGE)[(k // 2 + i) % 2], first if k == 0 else 400 + 37 * k, 40 + 5 * k,
                   gap_s=0.0 if k == 0 else 1.0) for k in range(calls)]
        out.append(Session(f"s{i}", f"tenant{i % 2}", f"task{i % 3}", 2.5 * i, cs))
    return out


def config(**kw):
    base = dict(models=(SMALL, LARGE), instances=1, normal_rate={SMALL: 1.0, LARGE: 1.0}, duration_s=15.0,
                warmup_s=0.0, max_drain_s=600.0, seed=3)
    base.update(kw)
    return SimConfig(**base)


def run(policy, sessions=None, **kw):
    sessions = constructed_sessions() if sessions is None else sessions
    return Simulator(config(**kw), policy, sessions, latency_cache=_CACHE).run()


@pytest.fixture(scope="module")
def runs():
    return {p: run(p) for p in ("no-shadow", "harvest-slo", "oracle")}


def test_deterministic_for_a_seed(runs):
    again = run("harvest-slo")
    first = runs["harvest-slo"]
    assert [(c.key, c.arrival, c.first_token, c.finish, c.cached_tokens) for c in again.calls] == \
           [(c.key, c.arrival, c.first_token, c.finish, c.cached_tokens) for c in first.calls]
    assert [(r.request_id, r.finish) for r in again.normal] == [(r.request_id, r.finish) for r in first.normal]
    assert again.shadow_tokens == first.shadow_tokens > 0
    other_seed = run("harvest-slo", seed=4)
    assert [r.arrival for r in other_seed.normal] != [r.arrival for r in first.normal]


def test_every_call_completes_and_tokens_add_up(runs):
    sessions = {s.session_id: s for s in constructed_sessions()}
    for name, r in runs.items():
        assert r.sessions_unfinished == 0
        assert sorted(c.key for c in r.calls) == sorted((s, k) for s in sessions for k in range(6))
        for c in r.calls:
            s = sessions[c.session_id]
            assert c.prompt_tokens == s.prompt_len(c.call_index)
            assert c.output_tokens == s.calls[c.call_index].output_tokens
            assert 0 <= c.cached_tokens < c.prompt_tokens
            assert c.arrival < c.first_token <= c.finish
            assert c.is_switch == (c.call_index > 0 and s.calls[c.call_index].model
                                   != s.calls[c.call_index - 1].model)
            if c.call_index:                      # issued after the previous call completed + the tool gap
                prev = next(p for p in r.calls if p.key == (c.session_id, c.call_index - 1))
                assert c.arrival == pytest.approx(prev.finish + s.calls[c.call_index].gap_s)
        assert r.normal and all(n.finish is not None for n in r.normal)
    # prefill work of routed calls = their uncached prompt tokens (no preemption at this load)
    sim = Simulator(config(), "harvest-slo", constructed_sessions(), latency_cache=_CACHE)
    r = sim.run()
    engines = [i.engine for i in sim.instances]
    assert sum(e.stats.preemptions for e in engines) == 0
    assert sum(e.stats.prefill_tokens_routed for e in engines) == sum(c.prompt_tokens - c.cached_tokens
                                                                      for c in r.calls)
    assert r.shadow_tokens == sum(e.stats.shadow_tokens for e in engines) > 0
    assert 0 <= r.shadow_tokens_used <= r.shadow_tokens


def test_harvest_raises_switch_hits_and_keeps_normal_slo(runs):
    res = compare(runs)
    base, harvest = res["no-shadow"], res["harvest-slo"]
    assert base["num_switch_calls"] == harvest["num_switch_calls"] == 6 * 2
    assert harvest["switch_hit_rate"] > base["switch_hit_rate"] + 0.2
    assert harvest["switch_call_ttft_mean_s"] < base["switch_call_ttft_mean_s"]
    assert harvest["token_cost"] < base["token_cost"]
    assert harvest["normal_slo_attainment"] >= base["normal_slo_attainment"] - 0.01
    assert base["shadow_tokens"] == 0


def test_oracle_bounds_harvest(runs):
    res = compare(runs)
    oracle, harvest = res["oracle"], res["harvest-slo"]
    assert oracle["switch_hit_rate"] >= harvest["switch_hit_rate"]
    assert oracle["switch_call_ttft_mean_s"] <= harvest["switch_call_ttft_mean_s"] * 1.02
    # Oracle's switch calls find at least the whole pages of the history their prompt keeps
    sessions = {s.session_id: s for s in constructed_sessions()}
    for c in runs["oracle"].calls:
        if c.is_switch:
            kept = sessions[c.session_id].kept_prefix(c.call_index)
            assert c.cached_tokens >= kept // 16 * 16
    assert res["oracle"]["switch_latency_gain_vs_oracle"] is None     # no Oracle+Host in this comparison


def test_measurement_window_and_drain():
    sessions = constructed_sessions()
    r = run("no-shadow", sessions, warmup_s=5.0, duration_s=6.0)
    measured = {s.session_id for s in sessions if 5.0 <= s.arrival_s < 11.0}
    assert {c.session_id for c in r.calls if c.measured} == measured
    assert r.sessions_measured == len(measured) and r.sessions_unfinished == 0
    assert all(5.0 <= n.arrival < 11.0 for n in r.normal)
    assert {c.session_id for c in r.calls} == {s.session_id for s in sessions if s.arrival_s < 11.0}
    s = summarize(r)
    assert s["num_calls"] == 6 * len(measured)


def test_bad_config():
    with pytest.raises(ValueError, match="models"):
        SimConfig(models=(SMALL, SMALL))
    with pytest.raises(ValueError, match="instances"):
        SimConfig(models=(SMALL,), instances=0)
    with pytest.raises(ValueError, match="duration_s"):
        SimConfig(models=(SMALL,), duration_s=0)
    with pytest.raises(TypeError, match="config"):
        Simulator({"models": (SMALL,)}, "no-shadow", [])
    with pytest.raises(ValueError, match="not among models"):
        Simulator(SimConfig(models=(SMALL,)), "no-shadow", constructed_sessions(n=1))


def test_simulate_cli_writes_the_json_keys(tmp_path):
    """`simulate` end to end: the JSON's keys, and its numbers against an independent recomputation from the
    per-call records it writes (`--records`) and from the sessions the workload generator makes."""
    from shadowprefill.cluster.workloads import generate_sessions
    from shadowprefill.model.catalog import MODELS
    from shadowprefill.sim.metrics import REDUCTION_METRICS

    out, figs, rec = tmp_path / "run.json", tmp_path / "figs", tmp_path / "calls.jsonl"
    rc = cli_main(["simulate", "--workload", "fusionbench", "--pair", f"{SMALL}/{LARGE}", "--policies",
                   "no-shadow,harvest-slo+host,oracle+host", "--duration", "20", "--warmup", "2", "--instances",
                   "1", "--session-rate", "0.3", "--capacity", f"{SMALL}=2,{LARGE}=2", "--rho", "0.5",
                   "--seed", "1", "--out", str(out), "--records", str(rec), "--plot", str(figs), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) == {"config", "policies"}
    assert data["config"]["normal_rate_per_instance"] == {SMALL: 1.0, LARGE: 1.0}
    assert list(data["policies"]) == ["no-shadow", "harvest-slo+host", "oracle+host"]
    for p in data["policies"].values():
        for key in ("switch_call_latency_mean_s", "switch_call_ttft_mean_s", "llm_call_latency_mean_s",
                    "switch_hit_rate", "hit_rate", "token_cost", "normal_slo_attainment",
                    "energy_per_good_request_j", "shadow_tokens", "shadow_tokens_unused", "num_switch_calls",
                    "num_calls"):
            assert key in p
    base = data["policies"]["no-shadow"]
    assert all(base[f"{m}_reduction_pct"] == 0.0 for m in REDUCTION_METRICS)     # the baseline vs itself
    assert base["shadow_tokens"] == 0
    assert data["policies"]["oracle+host"]["switch_latency_gain_vs_oracle"] == pytest.approx(1.0)

    # the sessions the generator makes for this seed: every measured one completes under every policy
    sessions = {s.session_id: s for s in generate_sessions("fusionbench", (SMALL, LARGE), duration_s=22.0, seed=1,
                                                           session_rate=0.3)}
    assert data["config"]["sessions"] == len(sessions)
    assert data["config"]["calls"] == sum(len(s.calls) for s in sessions.values())
    measured = {sid for sid, s in sessions.items() if 2.0 <= s.arrival_s < 22.0}
    assert len(measured) >= 3
    want_calls = sum(len(sessions[sid].calls) for sid in measured)
    want_switch = sum(1 for sid in measured for k, c in enumerate(sessions[sid].calls)
                      if k and c.model != sessions[sid].calls[k - 1].model)
    assert want_switch > 0
    records: dict[str, list[dict]] = {}
    for line in rec.read_text().splitlines():
        r = json.loads(line)
        records.setdefault(r["policy"], []).append(r)
    assert set(records) == set(data["policies"])
    for name, rs in records.items():
        summary = data["policies"][name]
        mine = [r for r in rs if r["measured"]]
        assert {r["session_id"] for r in mine} == measured
        assert summary["num_calls"] == len(mine) == want_calls
        assert summary["num_switch_calls"] == want_switch
        for r in rs:                                    # each record is the generated call it claims to be
            s, k = sessions[r["session_id"]], r["call_index"]
            assert r["model"] == s.calls[k].model and r["prompt_tokens"] == s.prompt_len(k)
            assert r["is_switch"] == (k > 0 and s.calls[k].model != s.calls[k - 1].model)
            assert r["arrival"] <= r["first_token"] <= r["finish"] and 0 <= r["cached_tokens"] <= r["prompt_tokens"]

    def recompute(rs):
        mine = [r for r in rs if r["measured"]]
        switch = [r for r in mine if r["is_switch"]]
        price = {m: (MODELS[m].price_input, MODELS[m].price_output) for m in (SMALL, LARGE)}
        cost = sum(((r["prompt_tokens"] - r["cached_tokens"]) + 0.1 * r["cached_tokens"]) * price[r["model"]][0]
                   + r["output_tokens"] * price[r["model"]][1] for r in mine) / 1e6        # §5.1: cached at 10%
        return {"switch_call_latency_mean_s": sum(r["finish"] - r["arrival"] for r in switch) / len(switch),
                "switch_call_ttft_mean_s": sum(r["first_token"] - r["arrival"] for r in switch) / len(switch),
                "llm_call_latency_mean_s": sum(r["finish"] - r["arrival"] for r in mine) / len(mine),
                "hit_rate": sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine),
                "switch_hit_rate": (sum(r["cached_tokens"] for r in switch)
                                    / sum(r["prompt_tokens"] for r in switch)),
                "token_cost": cost}

    ours = {name: recompute(rs) for name, rs in records.items()}
    for name, values in ours.items():
        for key, value in values.items():
            assert data["policies"][name][key] == pytest.approx(value, rel=1e-9), (name, key)
        for key in ("switch_call_latency_mean_s", "switch_call_ttft_mean_s", "llm_call_latency_mean_s",
                    "token_cost"):
            want = 100.0 * (ours["no-shadow"][key] - values[key]) / ours["no-shadow"][key]
            assert data["policies"][name][f"{key}_reduction_pct"] == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert sorted(f.name for f in figs.iterdir()) == ["hit_rates.png", "reductions.png", "switch_cdfs.png"]


def test_sweep_cli_runs_points_in_processes(tmp_path):
    out = tmp_path / "sweep.json"
    rc = cli_main(["sweep", "--param", "beta", "--values", "0.25,1.0", "--workload", "fusionbench", "--pair",
                   f"{SMALL}/{LARGE}", "--policies", "no-shadow,harvest-slo", "--duration", "8", "--warmup", "1",
                   "--instances", "1", "--session-rate", "0.5", "--capacity", f"{SMALL}=2,{LARGE}=2",
                   "--jobs", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["param"] == "beta" and data["values"] == [0.25, 1.0]
    assert [p["value"] for p in data["points"]] == [0.25, 1.0]
    for point in data["points"]:
        assert point["config"]["sim"]["beta"] == point["value"]
        assert set(point["policies"]) == {"no-shadow", "harvest-slo"}
        assert point["policies"]["harvest-slo"]["num_calls"] > 0


def test_normal_sources_are_deterministic_and_scaled():
    import itertools

    import numpy as np

    from shadowprefill.cluster.traces import TraceRecord
    from shadowprefill.sim.deployment import azure_normal_source

    src = azure_normal_source()
    a = list(itertools.islice(src(SMALL, 0, 5.0, 1), 2000))
    assert a == list(itertools.islice(src(SMALL, 0, 5.0, 1), 2000))
    assert a != list(itertools.islice(src(SMALL, 1, 5.0, 1), 2000))      # each instance its own stream
    times = np.array([x[0] for x in a])
    assert np.all(np.diff(times) >= 0) and len(a) / times[-1] == pytest.approx(5.0, rel=0.1)
    assert all(1 <= x[1] <= 8192 and 1 <= x[2] <= 1024 for x in a)
    rng = np.random.default_rng(0)
    records = [TraceRecord(float(t), int(p), int(o)) for t, p, o in
               zip(np.sort(rng.uniform(0, 100, 300)), rng.integers(10, 5000, 300), rng.integers(1, 500, 300))]
    replay = list(itertools.islice(azure_normal_source(records=records)(SMALL, 0, 6.0, 0), 1500))
    t = np.array([x[0] for x in replay])
    assert np.all(np.diff(t) >= 0) and len(replay) / t[-1] == pytest.approx(6.0, rel=0.1)   # looped, rescaled
    assert sorted({(x[1], x[2]) for x in replay}) == sorted({(r.prompt_tokens, r.output_tokens) for r in records})
