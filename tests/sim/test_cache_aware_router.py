"""Per-call routers priced by warm prefix (issue #7): constructed routing decisions against an independent
price formula, the simulator hook (a router that only peeks changes nothing), the knob's direction on a
small seeded simulation, plumbing (Experiment / CLI) and bad input. A few seconds in all."""
import itertools
import json
import math

import numpy as np
import pytest

from shadowprefill.cluster.cache_aware_router import (
    CacheAwareRouter,
    FixedRouter,
    StickyCostRouter,
    make_call_router,
    route_quality,
)
from shadowprefill.cluster.warm_view import WarmPrefix, WarmView
from shadowprefill.cluster.workloads import Call, Session
from shadowprefill.model.catalog import MODELS
from shadowprefill.sim.cli import main as cli_main
from shadowprefill.sim.experiment import Experiment
from shadowprefill.sim.simulator import SimConfig, Simulator

SMALL, LARGE = "Qwen2.5-7B", "Llama-3.1-70B"
PAIR = (SMALL, LARGE)
_LATENCY: dict = {}


# ---------------------------------------------------------------------------------------- reference
def ref_price(model: str, prompt: int, cached: int, out: int) -> float:
    """USD of one call, written out from the paper's rule (cached input at a tenth of the input price)."""
    arch = MODELS[model]
    return (np.float64(prompt - cached) * arch.price_input + np.float64(cached) * arch.price_input / 10
            + np.float64(out) * arch.price_output) / 1e6


class FakeWarm:
    """A WarmView stand-in: given cached tokens per model (device only)."""

    def __init__(self, prompt: int, cached: dict):
        self.prompt, self.cached = prompt, cached

    def __getitem__(self, model):
        return WarmPrefix(model, f"{model}-0", self.prompt, self.cached.get(model, 0), 0)


def two_call_session(route=(LARGE, SMALL), first=8000, new=600, outs=(50, 70)):
    return Session("s", "t", "task", 0.0, [Call(route[0], first, outs[0]), Call(route[1], new, outs[1], gap_s=1.0)])


# -------------------------------------------------------------------------------- constructed cases
def test_cache_aware_switches_to_the_warm_model_the_sticky_router_stays():
    s = two_call_session((LARGE, SMALL))          # call 1 needs the small model; the session is on the large
    p = s.prompt_len(1)
    history = 8000 + 50
    warm_both = FakeWarm(p, {LARGE: history // 16 * 16, SMALL: history // 16 * 16})   # small shadow-prefilled
    warm_large = FakeWarm(p, {LARGE: history // 16 * 16})                              # no shadow
    ca, sticky = CacheAwareRouter(PAIR), StickyCostRouter(PAIR)
    assert ca.route(s, 1, [LARGE], warm_both) == SMALL
    assert sticky.route(s, 1, [LARGE], warm_both) == LARGE      # it prices the small model cold
    assert ca.route(s, 1, [LARGE], warm_large) == LARGE         # cold small: re-prefill costs more
    out = 50                                                          # mean of the earlier outputs
    for router, warm in ((ca, warm_both), (sticky, warm_both), (ca, warm_large)):
        for o in router.options(s, 1, [LARGE], warm):
            seen = warm.cached.get(o.model, 0) if router is ca or o.model == LARGE else 0
            assert o.cached_tokens == seen
            assert o.price == pytest.approx(ref_price(o.model, p, seen, out), rel=1e-12)
            assert not o.miss                                          # both models are >= the needed one


def test_needed_large_step_is_never_downgraded_at_the_strict_setting():
    s = two_call_session((SMALL, LARGE))          # call 1 needs the large model; only the small one is warm
    p = s.prompt_len(1)
    warm = FakeWarm(p, {SMALL: 8048})
    for lam in (1.0, 2.0, math.inf):
        for cls in (CacheAwareRouter, StickyCostRouter):
            assert cls(PAIR, lam).route(s, 1, [SMALL], warm) == LARGE
    saving = 1 - ref_price(SMALL, p, 8048, 50) / ref_price(LARGE, p, 0, 50)
    assert 0.9 < saving < 1
    assert CacheAwareRouter(PAIR, 0.0).route(s, 1, [SMALL], warm) == SMALL
    assert CacheAwareRouter(PAIR, saving - 1e-6).route(s, 1, [SMALL], warm) == SMALL
    assert CacheAwareRouter(PAIR, saving + 1e-6).route(s, 1, [SMALL], warm) == LARGE


def test_choice_minimises_the_reference_score_on_random_states():
    rng = np.random.default_rng(7)
    for _ in range(300):
        route = tuple(PAIR[i] for i in rng.integers(2, size=2))
        s = two_call_session(route, first=int(rng.integers(100, 20000)), new=int(rng.integers(1, 3000)),
                             outs=(int(rng.integers(1, 400)), 10))
        p = s.prompt_len(1)
        cached = {m: int(rng.integers(0, p // 16 + 1)) * 16 for m in PAIR}
        cached = {m: min(c, (p - 1) // 16 * 16) for m, c in cached.items()}
        lam = float(rng.choice([0.0, rng.uniform(0, 1.2), 1.0, math.inf]))
        history = [route[0]]
        for cls, sees_all in ((CacheAwareRouter, True), (StickyCostRouter, False)):
            chosen = cls(PAIR, lam).route(s, 1, history, FakeWarm(p, cached))
            needed = route[1]
            known = {m: cached[m] if sees_all or m == history[-1] else 0 for m in PAIR}
            price = {m: ref_price(m, p, known[m], s.calls[0].output_tokens) for m in PAIR}
            score = {m: price[m] + (lam * price[needed] if m == SMALL and needed == LARGE else 0.0) for m in PAIR}
            assert score[chosen] <= min(score.values()) * (1 + 1e-12)
            if lam >= 1:
                assert not (chosen == SMALL and needed == LARGE)


def test_route_quality_counts_downgrades_against_the_recorded_route():
    s = Session("q", "t", "task", 0.0, [Call(LARGE, 100, 5), Call(SMALL, 10, 5), Call(LARGE, 10, 5),
                                        Call(SMALL, 10, 5)])

    class Rec:
        def __init__(self, k, model, measured=True):
            self.session_id, self.call_index, self.model, self.measured = "q", k, model, measured

    calls = [Rec(0, SMALL), Rec(1, LARGE), Rec(2, LARGE), Rec(3, SMALL), Rec(3, SMALL, measured=False)]
    q = route_quality(calls, [s])
    assert q == {"accuracy_proxy": 0.75, "downgraded_calls": 1, "upgraded_calls": 1, "rerouted_calls": 2,
                 "graded_calls": 4}
    assert route_quality(calls, [s], keys={("q", 0)})["accuracy_proxy"] == 0.0


# ---------------------------------------------------------------------------------------- simulator
def varied_sessions(n=8, calls=8, seed=0):
    """n sessions, 2 s apart, random context sizes, a route that switches with probability 0.4 per call."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        model, cs = PAIR[int(rng.integers(2))], []
        for k in range(calls):
            if k and rng.random() < 0.4:
                model = SMALL if model == LARGE else LARGE
            cs.append(Call(model, int(rng.integers(1000, 12000)) if k == 0 else int(rng.integers(100, 1500)),
                           int(rng.integers(20, 120)), gap_s=0.0 if k == 0 else 1.0))
        out.append(Session(f"v{i}", "t", f"task{i % 2}", 2.0 * i, cs))
    return out


def simulate(policy, router=None, sessions=None, **kw):
    cfg = SimConfig(models=PAIR, normal_rate={SMALL: 1.0, LARGE: 0.3}, duration_s=16.0, warmup_s=0.0,
                    max_drain_s=600.0, seed=3, **{"instances": 1, **kw})
    return Simulator(cfg, policy, sessions or varied_sessions(), latency_cache=_LATENCY, call_router=router).run()


def pool_state(manager):
    """Everything a prefix lookup could disturb, on every instance (test-only look at pool internals)."""
    out = []
    for inst in manager.all_instances():
        kv = inst.engine.kv
        host = kv.host_tier
        out.append((kv.snapshot(), kv.stats.as_dict(), None if host is None else list(host.items())))
    return out


class PeekingRecorded:
    """Looks at every model's warm prefix (checking that looking changes no pool), then routes as recorded."""

    def __init__(self):
        self.seen = {}

    def route(self, session, k, history, warm):
        assert isinstance(warm, WarmView) and list(history) == session.models[:k]
        before = pool_state(warm.manager)
        self.seen[(session.session_id, k)] = {m: warm[m] for m in PAIR}
        assert pool_state(warm.manager) == before
        return session.calls[k].model


def signature(run):
    return ([(c.key, c.model, c.instance, c.arrival, c.first_token, c.finish, c.cached_tokens, c.host_cached_tokens)
             for c in run.calls], [(n.request_id, n.first_token, n.finish) for n in run.normal],
            run.shadow_tokens, run.prefill_tokens)


def test_hook_reproducing_recorded_routes_changes_nothing():
    base = simulate("harvest-slo+host")
    peek = PeekingRecorded()
    assert signature(simulate("harvest-slo+host", peek)) == signature(base)
    assert signature(simulate("harvest-slo+host", FixedRouter())) == signature(base)
    assert len(peek.seen) == len(base.calls)
    # the view is what the call then found: the recorded model's warm prefix matches its cache hits
    agree = sum(peek.seen[c.key][c.model].cached_tokens == c.cached_tokens for c in base.calls)
    assert agree >= 0.9 * len(base.calls)
    # and it sees shadow-prefilled KV on the model the session is not on
    assert any(peek.seen[c.key][m].cached_tokens > 0 for c in base.calls if c.call_index
               for m in PAIR if m != c.model)


def test_hook_on_a_pd_cluster_peeks_at_prefill_instances():
    base = simulate("harvest-slo+host", instances=2, pd_prefill=1)
    peek = PeekingRecorded()
    assert signature(simulate("harvest-slo+host", peek, instances=2, pd_prefill=1)) == signature(base)
    assert {w.instance for seen in peek.seen.values() for w in seen.values()} == {f"{m}/p0" for m in PAIR}


@pytest.fixture(scope="module")
def knob_runs():
    return {lam: simulate("harvest-slo+host", CacheAwareRouter(PAIR, lam)) for lam in (1.0, 0.9, 0.7, 0.0)}


def _cost(run):
    return sum(c.cost() for c in run.calls)


def test_looser_knob_costs_no_more_and_is_no_more_accurate(knob_runs):
    sessions = varied_sessions()
    lams = sorted(knob_runs, reverse=True)
    costs = [_cost(knob_runs[lam]) for lam in lams]
    acc = [route_quality(knob_runs[lam].calls, sessions)["accuracy_proxy"] for lam in lams]
    assert all(len(knob_runs[lam].calls) == 64 for lam in lams)
    assert acc[0] == 1.0 and acc[-1] < 1.0
    assert all(a >= b for a, b in itertools.pairwise(acc)), acc
    assert all(a >= b for a, b in itertools.pairwise(costs)), costs
    assert costs[-1] < costs[0]


def test_with_shadow_the_cache_aware_router_switches_more_and_pays_less(knob_runs):
    strict = knob_runs[1.0]
    sticky = simulate("harvest-slo+host", StickyCostRouter(PAIR, 1.0))
    assert sum(c.is_switch for c in strict.calls) > sum(c.is_switch for c in sticky.calls)
    assert _cost(strict) < _cost(sticky)
    assert route_quality(sticky.calls, varied_sessions())["accuracy_proxy"] == 1.0


# ----------------------------------------------------------------------------------- plumbing, input
def test_experiment_and_cli_plumbing(tmp_path):
    exp = Experiment(models=PAIR, call_router="cache-aware", router_knob=0.8)
    assert isinstance(make_call_router(exp.call_router, exp.models, exp.router_knob), CacheAwareRouter)
    with pytest.raises(ValueError, match="call_router"):
        Experiment(models=PAIR, call_router="greedy")
    with pytest.raises(ValueError, match="router_knob"):
        Experiment(models=PAIR, router_knob=0.5)
    with pytest.raises(ValueError, match="lam"):
        Experiment(models=PAIR, call_router="sticky", router_knob=-0.1)
    assert cli_main(["simulate", "--pair", f"{SMALL}/{LARGE}", "--router", "markov", "--router-knob", "0.5",
                     "--out", str(tmp_path / "x.json")]) == 2              # a one-line usage error (test_cli.py)
    out = tmp_path / "run.json"
    rc = cli_main(["simulate", "--workload", "fusionbench", "--pair", f"{SMALL}/{LARGE}", "--policies",
                   "no-shadow,harvest-slo+host", "--duration", "12", "--warmup", "2", "--instances", "1",
                   "--session-rate", "0.3", "--capacity", f"{SMALL}=2,{LARGE}=1", "--rho", "0.5", "--seed", "1",
                   "--router", "cache-aware", "--router-knob", "0.7", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["call_router"] == "cache-aware" and data["config"]["router_knob"] == 0.7
    for p in data["policies"].values():
        assert 0.0 <= p["accuracy_proxy"] <= 1.0 and p["token_cost"] > 0 and p["graded_calls"] == p["num_calls"] > 0


def test_bad_input_names_the_argument():
    s = two_call_session()
    with pytest.raises(TypeError, match="call_router"):
        Simulator(SimConfig(models=PAIR), "no-shadow", [s], call_router=object())
    for bad in (-1.0, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="lam"):
            CacheAwareRouter(PAIR, bad)
    with pytest.raises(ValueError, match="models"):
        CacheAwareRouter((SMALL, SMALL))
    with pytest.raises(ValueError, match="unknown model"):
        StickyCostRouter((SMALL, "no-such-model"))
    with pytest.raises(ValueError, match="call_index"):
        CacheAwareRouter(PAIR).route(s, 2, [LARGE, SMALL], FakeWarm(10, {}))
    with pytest.raises(ValueError, match="history"):
        CacheAwareRouter(PAIR).route(s, 1, [], FakeWarm(10, {}))
    with pytest.raises(TypeError, match="session"):
        FixedRouter().route("s", 0, [])
    with pytest.raises(ValueError, match="not among the router's models"):
        CacheAwareRouter((SMALL, "Llama-3.1-8B")).route(s, 0, [], FakeWarm(10, {}))
    with pytest.raises(ValueError, match="call router"):
        make_call_router("random-ish", PAIR)

    class Rogue:
        def route(self, session, k, history, warm):
            return "Mistral-7B"

    with pytest.raises(ValueError, match="not deployed"):
        simulate("no-shadow", Rogue(), [s])
    sim = Simulator(SimConfig(models=PAIR, instances=1), "no-shadow", [s], latency_cache=_LATENCY)
    with pytest.raises(ValueError, match="not deployed"):
        WarmView(sim.manager, "s", [1, 2, 3])["Mistral-7B"]
    with pytest.raises(ValueError, match="prompt"):
        WarmView(sim.manager, "s", [])
    with pytest.raises(TypeError, match="manager"):
        WarmView(object(), "s", [1])
