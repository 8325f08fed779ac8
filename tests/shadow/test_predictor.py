"""The iteration latency predictor t̂: seed fit, online refit, closed-form max chunk."""
import random

import numpy as np
import pytest

from shadowprefill.model.latency import LatencyModel
from shadowprefill.shadow.predictor import IterationPredictor, batch_features


class Linear:
    def __init__(self, w):
        self.w = w

    def iteration_time(self, prefill, decode_contexts):
        w = self.w
        return (w[0] + w[1] * sum(n for n, _ in prefill) + w[2] * sum(n * (c + n) for n, c in prefill)
                + w[3] * len(decode_contexts) + w[4] * sum(decode_contexts))


def random_batch(rng):
    prefill = [(rng.randrange(1, 2048), rng.randrange(0, 8192)) for _ in range(rng.randrange(0, 3))]
    decodes = [rng.randrange(1, 8192) for _ in range(rng.randrange(0, 200))]
    if not prefill and not decodes:
        decodes = [100]
    return prefill, decodes


def test_seed_fit_recovers_linear_latency_model():
    w = (3e-3, 4e-5, 2e-9, 5e-5, 3e-8)
    pred = IterationPredictor(Linear(w))
    assert np.allclose(pred.coefficients, w, rtol=1e-6, atol=1e-15)
    rng = random.Random(0)
    for _ in range(50):
        prefill, decodes = random_batch(rng)
        assert pred.predict(prefill, decodes) == pytest.approx(Linear(w).iteration_time(prefill, decodes), rel=1e-6)


def test_seed_from_roofline_is_sane():
    lm = LatencyModel("Llama-3.1-8B")
    pred = IterationPredictor(lm)
    rng = random.Random(1)
    errors = []
    for _ in range(200):
        prefill, decodes = random_batch(rng)
        t = lm.iteration_time(prefill, decodes)
        errors.append(abs(pred.predict(prefill, decodes) - t) / t)
    assert np.median(errors) < 0.25
    assert all(c >= 0 for c in pred.coefficients)


def test_online_refit_tracks_a_different_machine():
    seed = Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8))
    truth = Linear((4e-3, 3e-5, 5e-9, 3e-4, 2e-8))          # the real machine is ~3x slower
    pred = IterationPredictor(seed, forgetting=0.98)
    rng = random.Random(2)
    for _ in range(400):
        prefill, decodes = random_batch(rng)
        pred.observe(prefill, decodes, truth.iteration_time(prefill, decodes))
    assert pred.num_observations == 400
    errs = []
    for _ in range(100):
        prefill, decodes = random_batch(rng)
        t = truth.iteration_time(prefill, decodes)
        errs.append(abs(pred.predict(prefill, decodes) - t) / t)
    assert max(errs) < 0.02


def test_bad_observations_are_ignored():
    pred = IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)))
    before = pred.coefficients
    for d in (0.0, -1.0, float("nan"), float("inf")):
        pred.observe([(10, 0)], [], d)
    assert pred.coefficients == before and pred.num_observations == 0


@pytest.mark.parametrize("w", [(1e-3, 2e-5, 1e-9, 0, 0), (1e-3, 2e-5, 0.0, 0, 0), (0, 0, 3e-9, 0, 0)])
def test_max_chunk_equals_brute_force(w):
    pred = IterationPredictor(Linear(w))
    rng = random.Random(3)
    for _ in range(200):
        base = rng.uniform(0, 0.01)
        cached = rng.randrange(0, 20000)
        budget = rng.uniform(0, 0.05)
        k = pred.max_chunk(base, cached, budget)
        if base > budget:
            assert k == 0
            continue
        fits = lambda n: base + pred.chunk_time(n, cached) <= budget   # noqa: E731
        if k < 2 ** 62:
            assert fits(k) and not fits(k + 1)


def test_prefill_and_decode_time():
    w = (1e-3, 2e-5, 1e-9, 1e-4, 1e-8)
    pred = IterationPredictor(Linear(w))
    want = sum(w[0] + w[1] * n + w[2] * n * (c + n) for n, c in [(100, 50), (100, 150), (30, 250)])
    assert pred.prefill_time(230, 50, 100) == pytest.approx(want)
    assert pred.prefill_time(0, 50, 100) == 0.0
    assert pred.decode_time(1000, batch=4) == pytest.approx(w[0] + 4 * w[3] + 4 * 1000 * w[4])
    assert batch_features([(10, 5), (3, 0)], [7, 9]) == (13, 10 * 15 + 9, 2, 16)


def test_validation():
    with pytest.raises(TypeError, match="latency_model"):
        IterationPredictor(object())
    with pytest.raises(ValueError, match="forgetting"):
        IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)), forgetting=2.0)
    with pytest.raises(TypeError, match="latency_model"):
        IterationPredictor(None)
