"""The control plane's shadow dispatch (paper 003 §III-A "shadow-warm"; paper 001 §3.1 shadow targets).

After a call completes, `ControlPlane.plan_shadows` decides the shadow dispatch (where and whether to
warm the likely next models with the call's history); the manager dispatches exactly what it chose. Per
target instance e of model j:

    benefit = p_j · (min_e' T_e'(n, m_e') − T_e(n, w)) − κ · (1 + q_e) · (T_e(w, m_e) − T_e(w, w))

with n the history's tokens, m_e the whole-block prefix e already holds (registry), the min over the
model's available instances e' (where the switch call would prefill without this shadow), w = n's whole
blocks (what the shadow makes e hold), T_e e's (fitted) prefill time, p_j the switch probability, q_e the
requests waiting at e and κ the price of a second of shadow-token compute relative to a second of switch
prefill saved (the shadow's fixed overhead T_e(w, w) runs in harvested capacity and is not charged).
Each model gets its best positive instance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True)
class ShadowCandidate:
    """One instance that may take a shadow of the session's history."""

    model_id: str
    site: str
    switch_prob: float  # P(the session's next call goes to model_id)
    history: Sequence[int] | int  # the history's token ids in model_id's tokenizer, or only its length
    block_size: int = 1  # the engine's page size (whole pages are what it caches)
    waiting: float = 0.0  # requests waiting at the site (its /metrics)
    cached_tokens: int | None = None  # held prefix when the registry does not know the site (no KV events)
    unavailable: str = ""  # why the site cannot take a shadow now (down, stale stream, no queue metric)

    def __post_init__(self):
        if not 0.0 <= self.switch_prob <= 1.0:
            raise ValueError(f"switch_prob must be in [0, 1], got {self.switch_prob!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not self.waiting >= 0:
            raise ValueError(f"waiting must be >= 0, got {self.waiting!r}")


@dataclass(frozen=True)
class ShadowChoice:
    """The plane's verdict on one ShadowCandidate: chosen, or rejected with the reason."""

    model_id: str
    site: str
    switch_prob: float
    tokens: int  # n
    cached_tokens: int  # m
    warm_tokens: int  # w
    saved_s: float
    cost_s: float
    benefit_s: float
    chosen: bool = False
    reason: str = ""


def plan_shadows(plane, tenant: str, candidates: Sequence[ShadowCandidate], cost_ratio: float = 0.1,
                 now: float | None = None) -> list[ShadowChoice]:
    """Where and whether to shadow a session's history: one verdict per candidate (same order); per
    model at most one is chosen, the instance with the largest positive benefit (module docstring).

    Rejections, first match wins: the candidate's ``unavailable`` reason; a history shorter than one
    block; the site already holds every whole block (KV events, or ``cached_tokens``); benefit <= 0;
    another instance of the model with a larger benefit.
    """
    if not cost_ratio >= 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio!r}")
    rows = []
    for c in candidates:
        if not isinstance(c, ShadowCandidate):
            raise TypeError(f"candidates must be ShadowCandidate, got {type(c).__name__}")
        ids = None if isinstance(c.history, int) else c.history
        n = c.history if ids is None else len(ids)
        if c.cached_tokens is not None or ids is None or plane.registry is None:
            m = min(int(c.cached_tokens or 0), n)
        else:
            hits = plane.registry.hits(tenant, c.model_id, ids, now)
            m = max((h.matched_tokens for h in hits if h.entry.location.site == c.site), default=0)
        rows.append((c, n, min(m, n // c.block_size * c.block_size)))
    base: dict[str, float] = {}  # the switch call's prefill without a shadow: the model's best instance
    for c, n, m in rows:
        if not c.unavailable:
            t = plane._prefill_at(c.model_id, c.site, n, m)
            base[c.model_id] = min(base.get(c.model_id, math.inf), t)
    out: list[ShadowChoice] = []
    for c, n, m in rows:
        w = n // c.block_size * c.block_size
        saved = cost = benefit = 0.0
        if c.unavailable:
            why = c.unavailable
        elif w == 0:
            why = f"history of {n} tokens is shorter than one block of {c.block_size}"
        elif m >= w:
            why = f"held: the site already holds all {w // c.block_size} whole blocks"
        else:
            saved = c.switch_prob * (base[c.model_id] - plane._prefill_at(c.model_id, c.site, n, w))
            cost = cost_ratio * (1.0 + c.waiting) * (plane._prefill_at(c.model_id, c.site, w, m)
                                                     - plane._prefill_at(c.model_id, c.site, w, w))
            benefit = saved - cost
            why = "" if benefit > 0 else f"expected benefit {benefit:.4g}s <= 0"
        out.append(ShadowChoice(c.model_id, c.site, c.switch_prob, n, m, w, saved, cost, benefit, False, why))
    best: dict[str, int] = {}
    for i, v in enumerate(out):
        if not v.reason and (v.model_id not in best or v.benefit_s > out[best[v.model_id]].benefit_s):
            best[v.model_id] = i
    for i, v in enumerate(out):
        if not v.reason:
            out[i] = replace(v, chosen=True) if best[v.model_id] == i else \
                replace(v, reason=f"{out[best[v.model_id]].site} has the larger benefit")
    return out
