"""Iteration latency predictor t̂ (paper §3.2, Algorithm 1 line 10).

A linear model over five features of a batch,

    t̂ = w0 + w1·P + w2·Σ n·(c+n) + w3·D + w4·Σ ctx

with P the prefill-chunk tokens (n new tokens on top of c cached ones each, shadow chunks included),
D the decodes and ctx their context lengths. It is seeded by least squares on synthetic batches timed
by a latency model (so the first iterations are sane), then refitted online from observed iteration
times by recursive least squares with forgetting, in relative error so short decode iterations count
as much as long prefills. Predictions use non-negative coefficients, which keeps t̂ monotone in the
number of shadow tokens, so "the largest n with t̂(B + n) <= b" is a closed-form root.

The seed is any object with `iteration_time(prefill, decode_contexts)`: the project's roofline
(`model.latency.LatencyModel`), or the measured step times of another engine. The predictor is engine-free
(the vLLM plugin times vLLM's steps with it).
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import numpy as np

# Feature scales: keep the RLS well conditioned (tokens ~1e3, tokens x context ~1e6, ...).
_SCALE = np.array([1.0, 1e-3, 1e-6, 1e-2, 1e-5])
_SCALE_LIST = _SCALE.tolist()


class LatencyModel(Protocol):
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


class IterationPredictor:
    """t̂: linear iteration-time model, seeded from a latency model, refitted online (RLS)."""

    def __init__(self, latency_model: LatencyModel, *, forgetting: float = 0.995, max_context: int = 32768) -> None:
        if not callable(getattr(latency_model, "iteration_time", None)):
            raise TypeError("latency_model must have an iteration_time(prefill, decode_contexts) method, got "
                            f"{type(latency_model).__name__}")
        self.latency_model = latency_model
        if not 0.5 <= forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.5, 1], got {forgetting}")
        self.forgetting = forgetting
        self.num_observations = 0
        self._theta = self._seed_fit(max_context)
        self._P = np.eye(5) * 1.0
        self._set_weights()

    # --------------------------------------------------------------------------------------- fitting
    def _seed_fit(self, max_context: int) -> np.ndarray:
        rows, ys = [], []
        for prefill, decodes in _seed_batches(max_context):
            y = float(self.latency_model.iteration_time(prefill, decodes))
            if y > 0 and math.isfinite(y):
                rows.append((1.0,) + batch_features(prefill, decodes))
                ys.append(y)
        if not rows:
            raise ValueError("latency_model returned no positive finite iteration times")
        x = np.asarray(rows, dtype=np.float64) * _SCALE
        y = np.asarray(ys)
        x, y = x / y[:, None], np.ones_like(y)          # relative error
        active = np.ones(5, dtype=bool)                 # non-negative least squares by elimination
        theta = np.zeros(5)
        for _ in range(5):
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            theta[:] = 0.0
            theta[active] = sol
            if (theta >= 0).all():
                break
            active &= theta > 0
        return np.maximum(theta, 0.0)

    def _set_weights(self) -> None:
        w = np.maximum(self._theta, 0.0) * _SCALE
        self.w0, self.w1, self.w2, self.w3, self.w4 = w.tolist()

    def observe(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int],
                duration: float) -> None:
        """Refit with one observed iteration."""
        self.observe_features(batch_features(prefill, decode_contexts), duration)

    def observe_features(self, features: tuple, duration: float) -> None:
        """RLS update (forgetting factor λ) on one observation, weighted by 1/duration."""
        if not duration > 0 or not math.isfinite(duration):
            return
        # elementwise (f * scale) / duration in float64, as numpy computes it, without temporaries
        x = np.array([1.0 / duration] + [float(f) * s / duration for f, s in zip(features, _SCALE_LIST[1:])])
        lam = self.forgetting
        px = self._P @ x
        gain = px / (lam + float(x @ px))                # (scalars as Python floats: the same float64 ops)
        self._theta = self._theta + gain * (1.0 - float(x @ self._theta))
        self._P = (self._P - gain[:, None] * px) / lam  # outer product
        trace = self._P.trace()
        if trace > 1e6:                                  # no wind-up in unexcited directions
            self._P *= 1e6 / trace
        self.num_observations += 1
        self._set_weights()

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
        """Largest k >= 0 with base_time + chunk_time(k, cached) <= budget (Alg. 1 line 10).

        Returns a large sentinel (2**62) when the budget does not bound k (zero slopes).
        """
        room = budget - base_time
        if not room >= 0:
            return 0
        a, b = self.w2, self.w1 + self.w2 * cached
        if a <= 0.0:
            k = 2 ** 62 if b <= 0.0 else int(room / b)
        else:
            k = int((-b + math.sqrt(b * b + 4.0 * a * room)) / (2.0 * a))
        k = min(max(k, 0), 2 ** 62)
        while k > 0 and base_time + self.chunk_time(k, cached) > budget:   # float rounding
            k -= 1
        while k < 2 ** 62 and base_time + self.chunk_time(k + 1, cached) <= budget:
            k += 1
        return k
