"""Per-step routers and the next-model predictor (paper §2.1, §3.1, appendix C "Router switch rate").

Every router answers `route(session, call_index, history) -> model name`, where `history` lists the models
that served calls 0..call_index-1 of the session. `session` is taken as it is: a recorded
`workloads.Session`, or a live `cluster.session.SessionState` (the HTTP front end's); the Markov and
random routers read only its `session_id` and `task`, the replay and callable routers need the recorded
calls. Randomised routers draw from a generator seeded by (seed, session id, call index), so a decision
never depends on the order in which the simulator asks: the same seed routes identically under every
policy.

- `ReplayRouter`: the session's recorded route (LLMRouter decisions replayed exactly, paper §4).
- `MarkovRouter`: an N-state Markov chain that switches model with probability p at each step (the
  appendix C sensitivity study uses two states, p in [0.05, 0.5]).
- `RandomRouter`: an independent draw per call.
- `CallableRouter`: wraps a learned router, e.g. `CallableRouter(lambda ctx: my_router.route(ctx.prompt_ids()))`.

The next-model prior (`SwitchPredictor`) lives in `cluster.prior`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from shadowprefill.cluster.prior import SwitchPredictor  # noqa: F401  (re-exported: cluster.router's API)
from shadowprefill.cluster.workloads import Session


class Router(Protocol):
    """The one router interface: the per-step routers here, the cost/quality call routers
    (cache_aware_router.py) and whatever a user plugs into the simulator."""

    def route(self, session, call_index: int, history: Sequence[str], warm=None) -> str:
        """Model for call `call_index` of `session`, given the models of its earlier calls and, where the
        caller has one, `warm`: a read-only view of what each model caches of the call's prompt
        (cluster.warm_view.WarmView; routers that do not price the cache ignore it)."""


def _check_call(session, call_index: int, history: Sequence[str], recorded: bool = True) -> None:
    """`recorded`: the router needs a `workloads.Session` (its recorded calls); else any session with a
    `session_id` and a `task` will do, and `call_index` is bounded only by the recorded calls if it has any."""
    if recorded and not isinstance(session, Session):
        raise TypeError(f"session must be a Session, got {type(session).__name__}")
    if not isinstance(getattr(session, "session_id", None), str) or not isinstance(getattr(session, "task", None), str):
        raise TypeError(f"session must have a str session_id and task, got {type(session).__name__}")
    calls = getattr(session, "calls", None)
    bound = len(calls) if calls is not None else None
    if isinstance(call_index, bool) or not isinstance(call_index, int) or call_index < 0 or \
            (bound is not None and call_index >= bound):
        raise ValueError(f"call_index must be in [0, {bound if bound is not None else 'inf'}), got {call_index!r}")
    if len(history) != call_index:
        raise ValueError(f"history must list the {call_index} earlier calls' models, got {len(history)}")


def _models(models: Sequence[str]) -> list[str]:
    models = list(models)
    if not models or not all(isinstance(m, str) and m for m in models) or len(set(models)) != len(models):
        raise ValueError(f"models must be distinct non-empty names, got {models!r}")
    return models


def _weights(weights: Mapping[str, float] | None, names: Sequence[str], what: str) -> list[float]:
    if weights is None:
        return [1.0] * len(names)
    unknown = set(weights) - set(names)
    if unknown:
        raise ValueError(f"{what} names unknown model(s) {sorted(unknown)}")
    w = [float(weights.get(n, 0.0)) for n in names]
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"{what} must be non-negative with a positive sum, got {dict(weights)}")
    return w


def _call_rng(seed: int, session, call_index: int) -> random.Random:
    return random.Random(f"{seed}/{session.session_id}/{call_index}")


class ReplayRouter:
    """The recorded model of each call, optionally renamed through `model_map` (e.g. onto another pair)."""

    def __init__(self, model_map: Mapping[str, str] | None = None) -> None:
        self.model_map = dict(model_map or {})

    def route(self, session: Session, call_index: int, history: Sequence[str], warm=None) -> str:
        _check_call(session, call_index, history)
        recorded = session.calls[call_index].model
        return self.model_map.get(recorded, recorded)


class MarkovRouter:
    """Stay on the current model with probability 1 - p, else switch to another one (chosen by
    `targets[current]` weights, default uniform). The first call draws from `initial` (default uniform).
    `p_by_task` overrides p per task."""

    def __init__(self, models: Sequence[str], p: float, seed: int = 0, initial: Mapping[str, float] | None = None,
                 targets: Mapping[str, Mapping[str, float]] | None = None,
                 p_by_task: Mapping[str, float] | None = None) -> None:
        self.models = _models(models)
        for name, value in [("p", p)] + [(f"p_by_task[{t!r}]", v) for t, v in (p_by_task or {}).items()]:
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        self.p = float(p)
        self.p_by_task = dict(p_by_task or {})
        self.seed = seed
        self.initial = _weights(initial, self.models, "initial")
        self.targets: dict[str, tuple[list[str], list[float]]] = {}
        for m in self.models:
            others = [o for o in self.models if o != m]
            self.targets[m] = (others, _weights((targets or {}).get(m), others, f"targets[{m!r}]") if others else [])

    def route(self, session, call_index: int, history: Sequence[str], warm=None) -> str:
        _check_call(session, call_index, history, recorded=False)
        rng = _call_rng(self.seed, session, call_index)
        if call_index == 0:
            return rng.choices(self.models, self.initial)[0]
        current = history[-1]
        if current not in self.targets:
            raise ValueError(f"history[-1]={current!r} is not one of the router's models {self.models}")
        others, weights = self.targets[current]
        if others and rng.random() < self.p_by_task.get(session.task, self.p):
            return rng.choices(others, weights)[0]
        return current


class RandomRouter:
    """An independent draw per call from `models` (weights default uniform)."""

    def __init__(self, models: Sequence[str], weights: Mapping[str, float] | None = None, seed: int = 0) -> None:
        self.models = _models(models)
        self.weights = _weights(weights, self.models, "weights")
        self.seed = seed

    def route(self, session, call_index: int, history: Sequence[str], warm=None) -> str:
        _check_call(session, call_index, history, recorded=False)
        return _call_rng(self.seed, session, call_index).choices(self.models, self.weights)[0]


@dataclass(frozen=True)
class CallContext:
    """What a learned router sees of one call."""

    session: Session
    call_index: int
    history: tuple[str, ...]

    @property
    def task(self) -> str:
        return self.session.task

    @property
    def tenant(self) -> str:
        return self.session.tenant

    @property
    def prompt_tokens(self) -> int:
        return self.session.prompt_len(self.call_index)

    @property
    def recorded_model(self) -> str:
        return self.session.calls[self.call_index].model

    def prompt_ids(self) -> np.ndarray:
        """The call's prompt token ids (recorded outputs stand in for earlier calls' outputs)."""
        return self.session.prompt_ids(self.call_index)


class CallableRouter:
    """A router from any callable `fn(CallContext) -> model name`; `models`, if given, bounds the answers."""

    def __init__(self, fn: Callable[[CallContext], str], models: Sequence[str] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.models = None if models is None else set(_models(models))

    def route(self, session: Session, call_index: int, history: Sequence[str], warm=None) -> str:
        _check_call(session, call_index, history)
        model = self.fn(CallContext(session, call_index, tuple(history)))
        if not isinstance(model, str) or not model:
            raise ValueError(f"router function returned {model!r}; expected a model name")
        if self.models is not None and model not in self.models:
            raise ValueError(f"router function returned {model!r}, not one of {sorted(self.models)}")
        return model
