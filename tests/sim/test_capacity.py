"""Capacity calibration: SLO attainment of one instance falls with load; the search brackets and bisects
the 90% point and caches it."""
import pytest

from shadowprefill.sim import capacity
from shadowprefill.sim.capacity import CapacityProbe, attainment, calibrate_capacity, normal_rates
from shadowprefill.sim.simulator import SimConfig

MODEL = "Qwen2.5-7B"


def test_attainment_falls_with_load():
    base = SimConfig(models=(MODEL,), seed=1)
    light = attainment(MODEL, 0.5, base, duration_s=15.0, warmup_s=2.0, seed=1)
    heavy = attainment(MODEL, 80.0, base, duration_s=8.0, warmup_s=1.0)
    assert light.requests > 0 and light.attainment == 1.0
    assert heavy.requests > 300 and heavy.attainment < 0.5


def test_search_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_CACHE_DIR", str(tmp_path))
    true_capacity = 7.3
    calls = []

    def fake(model, rate, base, **kw):
        calls.append(rate)
        return CapacityProbe(rate, 0.95 if rate <= true_capacity else 0.5, 100)

    monkeypatch.setattr(capacity, "attainment", fake)
    base = SimConfig(models=(MODEL,))
    got = calibrate_capacity(MODEL, base, start_rate=1.0, steps=6)
    assert got <= true_capacity and got >= true_capacity * 2 ** (-1 / 2 ** 6) * 0.999
    assert calls[:4] == [1.0, 2.0, 4.0, 8.0]                     # doubling until it fails
    n = len(calls)
    assert calibrate_capacity(MODEL, base, start_rate=1.0, steps=6) == got    # from the cache file
    assert len(calls) == n and (tmp_path / "capacity.json").is_file()
    rates, caps = normal_rates([MODEL, "Llama-3.1-8B"], base, 0.7, capacity={"Llama-3.1-8B": 10.0})
    assert caps == {MODEL: got, "Llama-3.1-8B": 10.0}
    assert rates == {MODEL: pytest.approx(0.7 * got), "Llama-3.1-8B": pytest.approx(7.0)}
    with pytest.raises(ValueError, match="target"):
        calibrate_capacity(MODEL, base, target=1.5)
    with pytest.raises(ValueError, match="rho"):
        normal_rates([MODEL], base, -1.0)
