"""Capacity calibration: SLO attainment of one instance falls with load; the search brackets and bisects
the 90% point; results are looked up by a fingerprint of what they depend on, shipped for the default study
and cached for anything else."""
import dataclasses
import json

import pytest

from shadowprefill.model import latency
from shadowprefill.sim import capacity
from shadowprefill.sim.capacity import (
    CapacityProbe,
    CapacityQuery,
    attainment,
    calibrate_capacity,
    normal_rates,
)
from shadowprefill.sim.simulator import SimConfig
from shadowprefill.sim.study import StudySpec, default_study_models

MODEL = "Qwen2.5-7B"


def test_attainment_falls_with_load():
    base = SimConfig(models=(MODEL,), seed=1)
    light = attainment(MODEL, 0.5, base, duration_s=15.0, warmup_s=2.0, seed=1)
    heavy = attainment(MODEL, 80.0, base, duration_s=8.0, warmup_s=1.0)
    assert light.requests > 0 and light.attainment == 1.0
    assert heavy.requests > 300 and heavy.attainment < 0.5


@pytest.fixture
def fake_search(tmp_path, monkeypatch):
    """A step-function attainment (>= 90% up to 7.3 req/s), an empty shipped file and cache dir."""
    monkeypatch.setenv("SHADOWPREFILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(capacity, "SHIPPED_PATH", tmp_path / "shipped.json")
    calls = []

    def fake(model, rate, base, **kw):
        calls.append(rate)
        return CapacityProbe(rate, 0.95 if rate <= 7.3 else 0.5, 100)

    monkeypatch.setattr(capacity, "attainment", fake)
    return calls


def test_search_and_cache(fake_search, tmp_path):
    calls = fake_search
    base = SimConfig(models=(MODEL,))
    got = calibrate_capacity(MODEL, base, start_rate=1.0, steps=6)
    assert got <= 7.3 and got >= 7.3 * 2 ** (-1 / 2 ** 6) * 0.999
    assert calls[:4] == [1.0, 2.0, 4.0, 8.0]                     # doubling until it fails
    assert len(calls) == 4 + 6
    n = len(calls)
    assert calibrate_capacity(MODEL, base, start_rate=1.0, steps=6) == got    # from the cache file
    assert len(calls) == n and (tmp_path / "cache" / "capacity.json").is_file()
    calibrate_capacity(MODEL, base, start_rate=1.0, steps=5)     # another search setting: another entry
    assert len(calls) == n + 4 + 5
    assert calibrate_capacity(MODEL, base, start_rate=1.0, steps=6, use_cache=False) == got
    assert len(calls) == n + 9 + 10                               # use_cache=False always searches
    rates, caps = normal_rates([MODEL, "Llama-3.1-8B"], base, 0.7, capacity={"Llama-3.1-8B": 10.0})
    assert caps["Llama-3.1-8B"] == 10.0
    assert rates == {MODEL: pytest.approx(0.7 * caps[MODEL]), "Llama-3.1-8B": pytest.approx(7.0)}
    with pytest.raises(ValueError, match="target"):
        calibrate_capacity(MODEL, base, target=1.5)
    with pytest.raises(ValueError, match="rho"):
        normal_rates([MODEL], base, -1.0)


def test_fingerprint_follows_what_the_capacity_depends_on(monkeypatch):
    q = CapacityQuery.of(MODEL, SimConfig(models=(MODEL,)))
    fp = q.fingerprint()
    assert fp == CapacityQuery(MODEL).fingerprint()              # defaults are the SimConfig's
    # what a No Shadow probe does not use leaves it alone: the experiment's seed, controller parameters
    assert fp == CapacityQuery.of(MODEL, SimConfig.make(models=(MODEL,), seed=7, beta=1.0, n_min=64,
                                                        shadow_mode="none")).fingerprint()
    engine = q.engine
    changed = [CapacityQuery("Qwen2.5-72B"), CapacityQuery(MODEL, gpu="h200"), CapacityQuery(MODEL, tp=2),
               CapacityQuery(MODEL, hbm_fraction=0.8), CapacityQuery(MODEL, engine={**engine, "token_budget": 1024}),
               CapacityQuery(MODEL, engine={**engine, "admission": "routed-first"}),
               CapacityQuery(MODEL, engine={**engine, "slo_factor": 4.0}), CapacityQuery(MODEL, lengths="code"),
               CapacityQuery(MODEL, steps=6), CapacityQuery(MODEL, duration_s=60.0)]
    assert CapacityQuery.of(MODEL, SimConfig.make(models=(MODEL,), token_budget=1024)).fingerprint() == \
        changed[4].fingerprint()
    assert len({fp, *(c.fingerprint() for c in changed)}) == 1 + len(changed)
    # the latency model's calibration constants are part of it
    slower = dataclasses.replace(latency.H100, gemm_flops_eff=latency.H100.gemm_flops_eff * 0.9)

    class Recalibrated(latency.LatencyModel):
        def __init__(self, arch, gpu="h100", tp=None):
            super().__init__(arch, gpu, tp, cal=slower)

    monkeypatch.setattr(capacity, "LatencyModel", Recalibrated)
    assert q.fingerprint() != fp
    monkeypatch.undo()
    assert q.fingerprint() == fp


def test_a_stale_entry_is_not_used_and_is_pruned(fake_search, tmp_path):
    calls = fake_search
    base = SimConfig(models=(MODEL,))
    q = CapacityQuery.of(MODEL, base)
    stale = dict(capacity.entry_of(q, 99.0, []), query={**dataclasses.asdict(q), "steps": 3})
    capacity.write_table(capacity.SHIPPED_PATH, {"0123456789abcdef0123": stale,
                                                  q.fingerprint(): capacity.entry_of(q, 5.5, [])})
    assert calibrate_capacity(MODEL, base) == 5.5 and calls == []          # the shipped, current value
    capacity.store(capacity.SHIPPED_PATH, [], prune=True)
    assert set(capacity.read_table(capacity.SHIPPED_PATH)) == {q.fingerprint()}


def test_calibrate_capacity_command_writes_the_shipped_file(fake_search, tmp_path, capsys):
    from shadowprefill.cli import main
    assert main(["calibrate-capacity", "--check"]) == 1
    assert "no current shipped value" in capsys.readouterr().out
    assert main(["calibrate-capacity", "--models", f"{MODEL}/Llama-3.1-70B", "--write", "--jobs", "1"]) == 0
    shipped = json.loads(capacity.SHIPPED_PATH.read_text())["entries"]
    assert {e["query"]["model"] for e in shipped.values()} == {MODEL, "Llama-3.1-70B"}
    for fp, e in shipped.items():
        query = CapacityQuery(**e["query"])
        assert query.fingerprint() == fp and e["probes"]
        # the capacity is the highest probed rate that met the target, and the search's last good rate
        good = [rate for rate, att, _ in e["probes"] if att >= 0.9]
        assert e["capacity"] == max(good) and e["capacity"] <= 7.3
    assert main(["calibrate-capacity", "--check"]) == 0
    n = len(fake_search)
    assert calibrate_capacity(MODEL, SimConfig(models=(MODEL,))) <= 7.3 and len(fake_search) == n


def test_the_package_ships_current_capacities_for_the_default_study():
    """The default study and the paper's protocol (`demo`, `demo --paper-length`) never calibrate: their
    models' capacities ship under the current fingerprint. Fails after a latency-model change: rerun
    `shadowprefill calibrate-capacity --write`."""
    spec = StudySpec()
    assert set(default_study_models()) == {m for e in spec.experiments() for m in e.models}
    from shadowprefill.sim.experiment import sim_config
    for exp in spec.experiments():
        for m in exp.models:
            q = CapacityQuery.of(m, sim_config(exp), lengths=exp.lengths)
            cap = capacity.shipped_capacity(q)
            assert cap is not None, f"no current shipped capacity for {m}: run `{capacity.REGENERATE}`"
            assert 0.1 < cap < 1000
