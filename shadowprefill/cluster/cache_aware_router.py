"""Per-call routers that price each candidate model by its warm prefix (issue #7).

Paper 003 (Unified AI Gateway) §III-A picks the target model jointly with the KV it can reuse, and §VI-C
notes that once prepared caches make switches cheap, "a joint routing policy could create more switching
opportunities". Paper 000 §2.2: "Switch-aware routers avoid switches and give up accuracy; ShadowPrefill
lowers their price." These routers let the simulator measure that: the simulator asks one at issue time
of every call (`Simulator(call_router=...)`), handing it a `WarmView` of the cluster.

Price of call k on model m (one implementation of cost: `ModelArch.token_cost`, cached input at 0.1x,
paper 000 §5.1):

    price(m) = price_in(m) x (uncached + 0.1 x cached) + price_out(m) x expected output tokens

with `cached` = the prompt tokens the router believes m holds, and expected output = the mean output of the
session's earlier calls (known at issue time; `default_output_tokens` for the first call).

Accuracy proxy. The simulator has no answers to grade, so the recorded route stands in for quality: it is
the model the quality router (LLMRouter's accuracy-per-cost policy, paper 000 §2.1) picked for the step,
the step's *needed* model. A model at least as capable (catalog `params_b`, equal counts as equal) is
counted correct; a weaker one is a quality miss, a *downgrade*. accuracy_proxy = share of calls not
downgraded. The proxy is optimistic about upgrades: paper 000 §5.4 finds the two models right on different
queries, so a real upgrade can lose a little accuracy; the proxy cannot see that.

Score and knob. score(m) = price(m) + lam x price(needed) x [m weaker than needed]; the router takes the
argmin. So a downgrade happens only when it cuts the call's price by more than the fraction `lam`:
lam >= 1 never downgrades (strict: accuracy_proxy = 1), lam = 0 takes the cheapest model. Sweeping lam
traces a cost / accuracy-proxy curve. Ties go to no miss, then the current model, then the needed one.

Routers (all share the score; they differ in what they know of caches):

- `FixedRouter`    the recorded route (the paper's fixed per-step router); ignores prices.
- `StickyCostRouter`  cache-unaware beyond its own model: it sees the warm prefix of the session's current
                   model and assumes every other model is cold (a switch pays full re-prefill), so it
                   leaves the current model only when the recorded route changes and the cold price is
                   still worth it (paper 000 §2.2's switch-aware router).
- `CacheAwareRouter`  sees every model's warm prefix (device + host tier, on the instance the manager
                   would place the call on), so a shadow-prefilled model is priced at its cached rate and
                   the router switches to it when that is cheaper.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shadowprefill.cluster.router import _check_call
from shadowprefill.cluster.warm_view import WarmView
from shadowprefill.cluster.workloads import Session
from shadowprefill.model.catalog import get_model

CALL_ROUTERS = ("fixed", "sticky", "cache-aware")


def capability(model: str) -> float:
    """Capability rank of a model for the accuracy proxy: its total parameters (catalog, billions)."""
    return get_model(model).params_b


def is_downgrade(chosen: str, needed: str) -> bool:
    """A quality miss: `chosen` is less capable than the step's `needed` (recorded) model."""
    return capability(chosen) < capability(needed)


class FixedRouter:
    """The recorded route of every call (what the simulator does without a call router)."""

    name = "fixed"

    def route(self, session: Session, call_index: int, history: Sequence[str], warm=None) -> str:
        _check_call(session, call_index, history)
        return session.calls[call_index].model


@dataclass(frozen=True)
class RouteOption:
    """One candidate model of one call as the router priced it."""

    model: str
    cached_tokens: int      # prompt tokens the router believes are cached on it
    price: float            # USD (token_cost at catalog prices)
    miss: bool              # weaker than the needed model
    score: float


class CostQualityRouter:
    """argmin over `models` of price + lam x price(needed) x miss (module docstring). `sees`: "all" (every
    model's warm prefix) or "current" (only the session's current model's; others priced cold)."""

    name = "cost-quality"

    def __init__(self, models: Sequence[str], lam: float = 1.0, *, sees: str = "all",
                 default_output_tokens: int = 64) -> None:
        models = list(models)
        if not models or not all(isinstance(m, str) and m for m in models) or len(set(models)) != len(models):
            raise ValueError(f"models must be distinct non-empty model names, got {models!r}")
        for m in models:
            get_model(m)                                     # unknown name -> ValueError
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or math.isnan(lam) or lam < 0:
            raise ValueError(f"lam must be a number >= 0 (math.inf allowed), got {lam!r}")
        if sees not in ("all", "current"):
            raise ValueError(f"sees must be 'all' or 'current', got {sees!r}")
        if isinstance(default_output_tokens, bool) or not isinstance(default_output_tokens, int) \
                or default_output_tokens < 0:
            raise ValueError(f"default_output_tokens must be an int >= 0, got {default_output_tokens!r}")
        self.models = models
        self.lam = float(lam)
        self.sees = sees
        self.default_output_tokens = default_output_tokens

    def expected_output_tokens(self, session: Session, call_index: int) -> int:
        """Mean output of the session's earlier calls (what is known when call `call_index` is issued)."""
        if call_index == 0:
            return self.default_output_tokens
        return round(sum(c.output_tokens for c in session.calls[:call_index]) / call_index)

    def options(self, session: Session, call_index: int, history: Sequence[str], warm: WarmView) -> list[RouteOption]:
        """Every candidate priced and scored, in `models` order."""
        _check_call(session, call_index, history)
        if not hasattr(warm, "__getitem__"):
            raise TypeError(f"warm must be a WarmView, got {type(warm).__name__}")
        needed = session.calls[call_index].model
        if needed not in self.models:
            raise ValueError(f"session {session.session_id!r} call {call_index} needs {needed!r}, not among the "
                             f"router's models {self.models}")
        prompt = session.prompt_len(call_index)
        out = self.expected_output_tokens(session, call_index)
        current = history[-1] if history else None
        prices = {}
        cached = {}
        for m in self.models:
            known = self.sees == "all" or m == current
            cached[m] = min(warm[m].cached_tokens, prompt) if known else 0
            prices[m] = get_model(m).token_cost(prompt, cached[m], out)
        ref = prices[needed]
        opts = []
        for m in self.models:
            miss = is_downgrade(m, needed)
            penalty = (math.inf if math.isinf(self.lam) else self.lam * ref) if miss else 0.0
            opts.append(RouteOption(m, cached[m], prices[m], miss, prices[m] + penalty))
        return opts

    def route(self, session: Session, call_index: int, history: Sequence[str], warm: WarmView | None = None) -> str:
        if warm is None:
            raise ValueError(f"warm: {type(self).__name__} prices the cache; pass a WarmView of the call's prompt")
        opts = self.options(session, call_index, history, warm)
        current = history[-1] if history else None
        needed = session.calls[call_index].model
        best = min(opts, key=lambda o: (o.score, o.miss, o.model != current, o.model != needed,
                                        self.models.index(o.model)))
        return best.model


class CacheAwareRouter(CostQualityRouter):
    """Prices every candidate by its warm prefix (shadow-prefilled KV included): switches when cheap."""

    name = "cache-aware"

    def __init__(self, models: Sequence[str], lam: float = 1.0, **kw) -> None:
        super().__init__(models, lam, sees="all", **kw)


class StickyCostRouter(CostQualityRouter):
    """Sees only the current model's warm prefix; prices a switch as a full re-prefill."""

    name = "sticky"

    def __init__(self, models: Sequence[str], lam: float = 1.0, **kw) -> None:
        super().__init__(models, lam, sees="current", **kw)


def make_call_router(name: str | None, models: Sequence[str], knob: float | None = None):
    """A call router by name ("fixed", "sticky", "cache-aware"; None -> None); `knob` is lam (default 1.0,
    strict)."""
    if name is None:
        if knob is not None:
            raise ValueError("router_knob needs a call router ('sticky' or 'cache-aware')")
        return None
    if name not in CALL_ROUTERS:
        raise ValueError(f"call router must be one of {CALL_ROUTERS}, got {name!r}")
    if name == "fixed":
        if knob is not None:
            raise ValueError("router_knob has no meaning for the 'fixed' router")
        return FixedRouter()
    lam = 1.0 if knob is None else knob
    return (CacheAwareRouter if name == "cache-aware" else StickyCostRouter)(models, lam)


def route_quality(calls: Iterable, sessions: Iterable[Session], keys: set | None = None) -> dict:
    """Accuracy proxy of served calls (records with session_id, call_index, model, measured; restricted to
    `keys` = (session_id, call_index) when given) against the sessions' recorded routes:
    {"accuracy_proxy", "downgraded_calls", "upgraded_calls", "rerouted_calls", "graded_calls"}."""
    by_id = {s.session_id: s for s in sessions}
    graded = down = up = moved = 0
    for c in calls:
        if not c.measured or (keys is not None and (c.session_id, c.call_index) not in keys):
            continue
        session = by_id.get(c.session_id)
        if session is None:
            raise ValueError(f"call of unknown session {c.session_id!r}")
        needed = session.calls[c.call_index].model
        graded += 1
        moved += c.model != needed
        down += is_downgrade(c.model, needed)
        up += capability(c.model) > capability(needed)
    return {"accuracy_proxy": (graded - down) / graded if graded else None, "downgraded_calls": down,
            "upgraded_calls": up, "rerouted_calls": moved, "graded_calls": graded}
