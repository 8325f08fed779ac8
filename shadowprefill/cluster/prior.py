"""The next-model prior (paper §3.1 "Ordering by switch likelihood", appendix E "More than two models").

The orchestration core orders and picks shadow targets by P(next call's model | task, current model). Any
object with the two methods of `NextModelPrior` will do; `SwitchPredictor` is the one the project uses: it
learns online from the routes of finished sessions, for the simulator and the HTTP front end alike (the
front end ends a session after it has been idle for a while).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Protocol, Sequence


class NextModelPrior(Protocol):
    """What the orchestration core needs from a next-model predictor."""

    def probabilities(self, task: str, current_model: str, candidates: Sequence[str]) -> dict[str, float]:
        """P(next call goes to m | task, current model) for each candidate m != current model."""

    def observe_session(self, task: str, models: Sequence[str]) -> None:
        """Learn from the route of a finished session."""


class SwitchPredictor:
    """P(next call's model | task, current model), learned online from finished sessions (paper §3.1).

    Estimates back off from (task, current) counts to per-current-model counts over all tasks, then to a
    prior that switches with probability `prior_switch`, spread evenly over the other candidates; each
    level adds `pseudo_count` pseudo-transitions of the level below (Dirichlet smoothing).
    """

    def __init__(self, prior_switch: float = 0.25, pseudo_count: float = 2.0) -> None:
        if not 0.0 <= prior_switch <= 1.0:
            raise ValueError(f"prior_switch must be in [0, 1], got {prior_switch}")
        if not pseudo_count > 0:
            raise ValueError(f"pseudo_count must be > 0, got {pseudo_count}")
        self.prior_switch = prior_switch
        self.pseudo_count = pseudo_count
        self.num_sessions = 0
        self.models: set[str] = set()
        self._by_task: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._by_model: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def observe_session(self, task: str, models: Sequence[str]) -> None:
        """Record the model sequence a finished session of `task` used."""
        if not isinstance(task, str):
            raise TypeError(f"task must be a str, got {type(task).__name__}")
        models = list(models)
        self.models.update(models)
        for current, nxt in zip(models, models[1:]):
            self._by_task[(task, current)][nxt] += 1
            self._by_model[current][nxt] += 1
        self.num_sessions += 1

    def next_model_distribution(self, task: str, current: str, candidates: Sequence[str] | None = None) -> dict[str, float]:
        """Probability of each candidate (default: every model seen, plus `current`) serving the next call."""
        names = sorted(set(candidates if candidates is not None else self.models) | {current})
        if len(names) == 1:
            return {current: 1.0}
        switch_each = self.prior_switch / (len(names) - 1)
        probs = {m: (1.0 - self.prior_switch if m == current else switch_each) for m in names}
        for counts in (self._by_model.get(current), self._by_task.get((task, current))):
            if counts:
                total = sum(counts.get(m, 0) for m in names)
                probs = {m: (counts.get(m, 0) + self.pseudo_count * probs[m]) / (total + self.pseudo_count)
                         for m in names}
        return probs

    def switch_probability(self, task: str, current: str, target: str) -> float:
        """Probability that a session of `task` now on `current` sends its next call to `target` (for
        target == current: the probability of staying), over every model seen so far."""
        return self.next_model_distribution(task, current, sorted(self.models | {target}))[target]

    def probabilities(self, task: str, current_model: str, candidates: Sequence[str]) -> dict[str, float]:
        """P(next call goes to m | task, current model) for each candidate m != current model
        (`NextModelPrior`)."""
        probs = self.next_model_distribution(task, current_model, candidates)
        return {m: p for m, p in probs.items() if m != current_model}
