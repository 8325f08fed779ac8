"""The iteration latency predictor t̂: seed fit, online refit, closed-form max chunk."""
import itertools
import random

import numpy as np
import pytest

from shadowprefill.model.latency import LatencyModel
from shadowprefill.shadow.controller import ShadowController
from shadowprefill.shadow.predictor import IterationPredictor, batch_features, nnls_normal
from shadowprefill.shadow.view import IterationView


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


@pytest.mark.parametrize("truth", [(4e-3, 3e-5, 5e-9, 3e-4, 2e-8),      # ~3x slower, not uniformly
                                   (3e-3, 3e-5, 3e-9, 3e-4, 3e-8)])     # uniformly 3x slower
def test_online_refit_tracks_a_different_machine(truth):
    seed = Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8))
    truth = Linear(truth)
    pred = IterationPredictor(seed)                       # default memory (λ = 0.995) and seed weight
    rng = random.Random(2)
    for _ in range(1500):
        prefill, decodes = random_batch(rng)
        pred.observe(prefill, decodes, truth.iteration_time(prefill, decodes))
    assert pred.num_observations == 1500
    errs = []
    for _ in range(100):
        prefill, decodes = random_batch(rng)
        t = truth.iteration_time(prefill, decodes)
        errs.append(abs(pred.predict(prefill, decodes) - t) / t)
    assert max(errs) < 0.02


def test_refit_does_not_wind_up_on_decode_heavy_traffic():
    """A serving instance runs long stretches of decode-heavy iterations with short prefills; the machine here
    is the seed's own roofline. t̂ of a shadow-like chunk (256 tokens on 0-32K cached, beside 40 decodes) must
    stay near the roofline all along: recent iterations carry no information about long contexts, so the
    refit must keep what the seed knew there (plain forgetting let t̂ of such chunks swing 0.6-12x)."""
    lm = LatencyModel("Qwen2.5-7B")
    pred = IterationPredictor(lm)
    probes = [([(256, c)], [2000] * 40) for c in (0, 8192, 32768)]
    truth = [lm.iteration_time(*p) for p in probes]
    rng = random.Random(0)
    ratios = []
    for _ in range(2000):
        decodes = [rng.randrange(200, 4000) for _ in range(rng.randrange(20, 90))]
        prefill = [(rng.randrange(16, 2048), 0)] if rng.random() < 0.15 else []
        pred.observe(prefill, decodes, lm.iteration_time(prefill, decodes))
        ratios += [pred.predict(*p) / t for p, t in zip(probes, truth)]
    assert 0.9 < min(ratios) and max(ratios) < 1.15


def brute_nnls(a, b):
    """argmin_{θ>=0} θᵀaθ - 2bᵀθ by trying every set of free coefficients (reference for nnls_normal)."""
    n, best, best_f = len(b), np.zeros(len(b)), 0.0
    for k in range(1, n + 1):
        for idx in itertools.combinations(range(n), k):
            idx = list(idx)
            theta = np.zeros(n)
            theta[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            f = theta @ a @ theta - 2 * b @ theta
            if (theta >= 0).all() and f < best_f:
                best, best_f = theta, f
    return best


def test_nnls_normal_matches_brute_force():
    rng = np.random.default_rng(4)
    clamped = 0
    for _ in range(200):
        x = rng.normal(size=(12, 5)) * rng.uniform(0.1, 10.0, size=5)
        y = rng.normal(size=12)
        a, b = x.T @ x, x.T @ y
        got, want = nnls_normal(a, b), brute_nnls(a, b)
        assert (got >= 0).all()
        assert np.allclose(got, want, rtol=1e-7, atol=1e-9)
        clamped += bool((want == 0).any())
    assert clamped > 50                                   # the active-set path ran, not only the solve


def test_nnls_normal_definite_path_matches_checked_solve():
    """definite=True (t̂'s refit) calls LAPACK's gufunc directly: the same θ, bit for bit, as the checked
    np.linalg.solve path, clamped or not; a singular `a` passed as definite still gets the checked answer."""
    rng = np.random.default_rng(7)
    clamped = 0
    for _ in range(200):
        x = rng.normal(size=(12, 5)) * rng.uniform(0.1, 10.0, size=5)
        a, b = x.T @ x, x.T @ rng.normal(size=12)
        got, want = nnls_normal(a, b, definite=True), nnls_normal(a, b)
        assert got.tolist() == want.tolist()
        clamped += bool((want == 0).any())
    assert 50 < clamped < 200                             # both the plain solve and the active set were compared
    singular = np.outer(np.arange(1.0, 6.0), np.arange(1.0, 6.0))            # rank 1
    b = singular @ np.full(5, 0.5)
    with np.errstate(invalid="ignore"):
        got = nnls_normal(singular, b, definite=True)
    assert np.isfinite(got).all() and (got >= 0).all()
    assert got.tolist() == nnls_normal(singular, b).tolist()


def test_bad_observations_are_ignored():
    pred = IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)))
    before = pred.coefficients
    for d in (0.0, -1.0, float("nan"), float("inf")):
        pred.observe([(10, 0)], [], d)
    assert pred.coefficients == before and pred.num_observations == 0


@pytest.mark.parametrize("w", [(1e-3, 2e-5, 1e-9, 0, 0), (1e-3, 2e-5, 0.0, 0, 0), (0, 0, 3e-9, 0, 0)])
def test_max_chunk_equals_brute_force(w):
    pred = IterationPredictor(Linear(w), warm_steps=0, growth=None)      # the closed form alone
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
        assert fits(k) and not fits(k + 1)


# ------------------------------------------------------------------------------ guardrails (issue 21)
def test_zero_per_token_cost_means_a_probe_never_unbounded():
    pred = IterationPredictor(Linear((5e-3, 0.0, 0.0, 1e-4, 0.0)), probe_tokens=32, warm_steps=0, growth=None)
    assert pred.w1 == pred.w2 == 0.0
    for budget in (5e-3, 0.015, 10.0):
        assert pred.max_chunk(5e-3, 0, budget) == 32
        assert pred.max_chunk(5e-3, 4096, budget) == 32
    assert pred.max_chunk(6e-3, 0, 5e-3) == 0                       # over b already: nothing


def test_cold_until_the_stated_number_of_prefill_steps():
    w = (1e-3, 2e-5, 1e-9, 1e-4, 1e-8)
    pred = IterationPredictor(Linear(w), probe_tokens=64, warm_steps=3)
    big = pred.max_chunk(0.0, 0, 1.0)
    assert big == 64 and not pred.warm
    for _ in range(50):                                            # decode-only steps do not warm t̂
        pred.observe([], [100, 200], Linear(w).iteration_time([], [100, 200]))
    assert not pred.warm and pred.max_chunk(0.0, 0, 1.0) == 64
    for i in range(3):
        assert not pred.warm
        pred.observe([(100, 0)], [100], Linear(w).iteration_time([(100, 0)], [100]))
    assert pred.warm and pred.prefill_steps == 3
    assert pred.max_chunk(0.0, 0, 1.0) == 200                      # 2x the largest measured prefill step


def test_a_chunk_grows_at_most_twice_the_largest_measured_step():
    w = (1e-3, 2e-5, 1e-9, 1e-4, 1e-8)
    truth = Linear(w)
    pred = IterationPredictor(truth, probe_tokens=32, warm_steps=1)
    rng = random.Random(5)
    largest = 0
    for _ in range(60):
        budget = rng.uniform(0.01, 1.0)
        k = pred.max_chunk(0.0, 0, budget)
        assert k <= max(32, 2 * largest)
        if k:
            pred.observe([(k, 0)], [], truth.iteration_time([(k, 0)], []))
            largest = max(largest, k)
    assert largest > 1000                                           # it did grow, doubling at most


def test_an_overrun_shrinks_the_next_budget_and_relaxes_back():
    lm = Linear((1e-3, 2e-5, 0.0, 1e-4, 0.0))
    pred = IterationPredictor(lm, warm_steps=0, growth=None)
    ctl = ShadowController("harvest-slo", pred, tpot_slo=0.03)
    assert ctl.plan(idle_view()).seconds == pytest.approx(0.015)
    pred.observe([(2044, 0)], [], 0.0225, bound_s=0.015)          # 1.5 b: not an overrun
    assert pred.budget_scale == 1.0 and pred.overruns == 0
    pred.observe([(2044, 0)], [], 0.101, bound_s=0.015)           # the reproduction's 101 ms step
    assert pred.overruns == 1 and pred.budget_scale == pytest.approx(0.015 / 0.101)
    b = ctl.plan(idle_view()).seconds
    assert b == pytest.approx(0.015 * 0.015 / 0.101)
    for _ in range(200):                                  # decode-only steps say nothing of chunk cost
        pred.observe([], [100], lm.iteration_time([], [100]))
    assert ctl.plan(idle_view()).seconds == pytest.approx(b)
    for _ in range(200):                                  # prefill steps within bounds: back to b = βT
        pred.observe([(256, 0)], [100], lm.iteration_time([(256, 0)], [100]))
    assert ctl.plan(idle_view()).seconds == pytest.approx(0.015)


@pytest.mark.parametrize("feedback", [True, False])
def test_the_controller_reports_an_overrun_iteration_to_t_hat(feedback):
    """The engine's path: plan -> chunks taken -> end_iteration(measured) feeds the overrun back, unless the host
    reports steps itself (feedback=False, the vLLM plugin); a plan without chunks reports nothing."""
    pred = IterationPredictor(Linear((1e-3, 2e-5, 0.0, 1e-4, 0.0)), warm_steps=0, growth=None)
    ctl = ShadowController("harvest-slo", pred, tpot_slo=0.03, feedback=feedback)
    ctl.plan(idle_view())
    ctl.end_iteration(0.101, busy=False, decode_only=False)                 # no chunk taken: nothing to report
    assert pred.budget_scale == 1.0
    budget = ctl.plan(idle_view())
    budget.take(budget.max_tokens(0), 0)
    ctl.end_iteration(0.101, busy=False, decode_only=False)
    assert pred.budget_scale == (pytest.approx(0.015 / 0.101) if feedback else 1.0)


def idle_view():
    return IterationView(0.0, [], [], False, free_shadow_tokens=1 << 20)


def test_prefill_and_decode_time():
    w = (1e-3, 2e-5, 1e-9, 1e-4, 1e-8)
    pred = IterationPredictor(Linear(w))
    want = sum(w[0] + w[1] * n + w[2] * n * (c + n) for n, c in [(100, 50), (100, 150), (30, 250)])
    assert pred.prefill_time(230, 50, 100) == pytest.approx(want)
    assert pred.prefill_time(0, 50, 100) == 0.0
    assert pred.decode_time(1000, batch=4) == pytest.approx(w[0] + 4 * w[3] + 4 * 1000 * w[4])
    assert batch_features([(10, 5), (3, 0)], [7, 9]) == (13, 10 * 15 + 9, 2, 16)


def test_batched_refit_equals_a_refit_per_observation():
    """Folding k observations in at once (refit_every=k) gives the information, and so the fit, of k
    one-observation updates (refit_every=1), on a machine 2x slower than the seed; between refits t̂ stays."""
    seed = Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8))
    truth = Linear((2e-3, 2e-5, 2e-9, 2e-4, 2e-8))
    each, batched = IterationPredictor(seed, refit_every=1), IterationPredictor(seed, refit_every=8)
    rng = random.Random(4)
    for i in range(1, 161):
        prefill, decodes = random_batch(rng)
        t = truth.iteration_time(prefill, decodes)
        before = batched.coefficients
        each.observe(prefill, decodes, t)
        batched.observe(prefill, decodes, t)
        if i % 8:
            assert batched.coefficients == before               # folded in only at the refit
        else:
            np.testing.assert_allclose(batched._info, each._info, rtol=1e-9)
            np.testing.assert_allclose(batched.coefficients, each.coefficients, rtol=1e-7, atol=1e-15)
    assert each.num_observations == batched.num_observations == 160
    assert batched.speed_ratio == pytest.approx(2.0, rel=0.05)


def test_validation():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="refit_every"):
            IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)), refit_every=bad)
    with pytest.raises(TypeError, match="latency_model"):
        IterationPredictor(object())
    with pytest.raises(ValueError, match="forgetting"):
        IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)), forgetting=2.0)
    for bad in (0.0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="prior_weight"):
            IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)), prior_weight=bad)
    with pytest.raises(TypeError, match="latency_model"):
        IterationPredictor(None)
    for name, bad in (("probe_tokens", 0), ("probe_tokens", 1.5), ("warm_steps", -1), ("growth", 0.5),
                      ("growth", float("inf"))):
        with pytest.raises(ValueError, match=name):
            IterationPredictor(Linear((1e-3, 1e-5, 1e-9, 1e-4, 1e-8)), **{name: bad})
