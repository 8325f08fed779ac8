"""Per-instance prefill fit (NNLS, Table III form) learned from observed calls."""
import random

import pytest

from shadowprefill.gateway.control_plane import AnalyticCostModel, Candidate, ControlPlane, GatewayRequest
from shadowprefill.gateway.prefill_fit import FittedPrefillModel


def truth(n, m, a=2e-4, b=3e-8, tau=0.02):
    return a * (n - m) + b * (n * n - m * m) + tau


def test_fit_recovers_the_instance_and_replaces_table_iii():
    rng = random.Random(0)
    fit = FittedPrefillModel(min_samples=4)
    analytic = AnalyticCostModel()
    assert fit.prefill_time_at("x", "m", 1000, 0) == analytic.prefill_time_s("m", 1000, 0)
    for _ in range(40):
        n = rng.randrange(64, 4000)
        m = rng.randrange(0, n)
        fit.observe("x", n, m, truth(n, m) * (1 + rng.uniform(-0.01, 0.01)))
    assert fit.fitted("x") and not fit.fitted("y")
    for n, m in ((500, 0), (3000, 1000), (4000, 3968)):
        assert fit.prefill_time_at("x", "m", n, m) == pytest.approx(truth(n, m), rel=0.05)
    c = fit.coefficients("x")
    assert c["a_s_per_token"] == pytest.approx(2e-4, rel=0.1) and c["tau_s"] == pytest.approx(0.02, rel=0.1)
    assert fit.prefill_time_at("y", "m", 500, 0) == analytic.prefill_time_s("m", 500, 0)
    # the plane's latency for a site is the fitted one
    d = ControlPlane(estimator=fit, overhead_s=0.0).decide(GatewayRequest("t", list(range(10, 510))),
                                                          [Candidate("m", "x")])
    assert d.chosen.latency_s == pytest.approx(truth(500, 0), rel=0.05)


def test_bad_observations_are_rejected():
    fit = FittedPrefillModel()
    for args in ((10, 11, 1.0), (10, 0, -1.0), (10, 0, float("nan"))):
        with pytest.raises(ValueError):
            fit.observe("x", *args)
