"""Per-instance prefill time learned online (paper 003 §III-A's latency estimate, from what happened).

Each site (an upstream server) gets T(n, m) = a·(n−m) + b·(n²−m²) + τ — the Table III form — fitted with
non-negative coefficients by the project's NNLS solver (`shadow.predictor.nnls_normal`) on the normal
equations accumulated from observed (prompt tokens n, cached tokens m, seconds to first token). Until a
site has `min_samples` observations over at least two prompt lengths, Table III's analytic constants
answer (`AnalyticCostModel`). `ControlPlane` uses `prefill_time_at(site, ...)` when present.
"""
from __future__ import annotations

import numpy as np

from shadowprefill.shadow.predictor import nnls_normal

from .control_plane import AnalyticCostModel

_SCALE = np.array([1e-3, 1e-6, 1.0])     # features in K tokens / M tokens² for conditioning


def _features(n: int, m: int) -> np.ndarray:
    return np.array([n - m, n * n - m * m, 1.0]) * _SCALE


class FittedPrefillModel:
    """Online NNLS fit of prefill seconds per site; the analytic model until a site has enough samples."""

    def __init__(self, fallback: AnalyticCostModel | None = None, min_samples: int = 4, ridge: float = 1e-9):
        self.fallback = fallback if fallback is not None else AnalyticCostModel()
        self.min_samples, self.ridge = min_samples, ridge
        self._a: dict[str, np.ndarray] = {}
        self._b: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}
        self._lengths: dict[str, set] = {}
        self._theta: dict[str, np.ndarray] = {}

    def observe(self, site: str, tokens: int, cached_tokens: int, seconds: float) -> None:
        """One prefill: `tokens` prompt tokens, `cached_tokens` of them cached, took `seconds`."""
        if not 0 <= cached_tokens <= tokens or not seconds >= 0 or seconds != seconds:
            raise ValueError(f"need 0 <= cached_tokens <= tokens and seconds >= 0, got "
                             f"{cached_tokens!r}, {tokens!r}, {seconds!r}")
        x = _features(tokens, cached_tokens)
        self._a[site] = self._a.get(site, np.zeros((3, 3))) + np.outer(x, x)
        self._b[site] = self._b.get(site, np.zeros(3)) + x * seconds
        self._count[site] = self._count.get(site, 0) + 1
        self._lengths.setdefault(site, set()).add(tokens - cached_tokens)
        if self.fitted(site):
            self._theta[site] = nnls_normal(self._a[site] + self.ridge * np.eye(3), self._b[site])

    def fitted(self, site: str) -> bool:
        return self._count.get(site, 0) >= self.min_samples and len(self._lengths.get(site, ())) >= 2

    def coefficients(self, site: str) -> dict | None:
        """{a_s_per_token, b_s_per_token2, tau_s} of a fitted site (None before)."""
        theta = self._theta.get(site)
        if theta is None:
            return None
        a, b, tau = theta * _SCALE
        return {"a_s_per_token": float(a), "b_s_per_token2": float(b), "tau_s": float(tau)}

    def prefill_time_at(self, site: str, model: str, tokens: int, cached_tokens: int = 0) -> float:
        theta = self._theta.get(site)
        if theta is None:
            return self.fallback.prefill_time_s(model, tokens, cached_tokens)
        return float(theta @ _features(tokens, cached_tokens))

    def prefill_time_s(self, model: str, tokens: int, cached_tokens: int = 0) -> float:
        return self.fallback.prefill_time_s(model, tokens, cached_tokens)
