"""Which other models get a routed call's shadow (paper §3.1, §5 "Predictive", appendix E).

For a call routed to model A, every other model is a candidate target, with its probability of serving
the session's next call from the next-model prior (`cluster.prior`; without one, `default_switch_prob`
split evenly). Candidates are ranked by that probability (ties in deployment order). `mode`:

- "all": shadow to every other model, most likely first (the engines run jobs by switch probability);
- "top1": only the most likely one (appendix E: with N > 2 models, spend shadow capacity on the most
  likely target).

`min_switch_prob` is the Predictive gate: a candidate whose probability is below it gets no shadow (the
session's shadow there, if any, is cancelled). 0 disables it; the Predictive policy uses 0.25.
"""
from __future__ import annotations

import math

TARGET_MODES = ("all", "top1")


class ShadowTargets:
    """Shadow-target selection: `mode` ("all" | "top1") and the Predictive gate `min_switch_prob`."""

    def __init__(self, mode: str = "all", min_switch_prob: float = 0.0, default_switch_prob: float = 0.5) -> None:
        if mode not in TARGET_MODES:
            raise ValueError(f"shadow_targets must be 'all' or 'top1', got {mode!r}")
        for name, v in (("min_switch_prob", min_switch_prob), ("default_switch_prob", default_switch_prob)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        self.mode = mode
        self.min_switch_prob = float(min_switch_prob)
        self.default_switch_prob = float(default_switch_prob)

    def choose(self, prior, task: str, current: str, models: list[str]) -> list[tuple[str, float]]:
        """The targets of a call routed to `current`, most likely first, as (model, probability)."""
        others = [m for m in models if m != current]
        if not others:
            return []
        if prior is not None:
            probs = prior.probabilities(task, current, others)
        else:
            share = self.default_switch_prob / len(others)
            probs = {m: share for m in others}
        ranked = sorted(others, key=lambda m: (-probs.get(m, 0.0), models.index(m)))
        if self.mode == "top1":
            ranked = ranked[:1]
        out = [(m, min(1.0, max(0.0, float(probs.get(m, 0.0))))) for m in ranked]
        return [(m, p) for m, p in out if p >= self.min_switch_prob]
