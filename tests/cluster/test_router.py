"""Routers (replay, Markov, random, callable) and the online next-model predictor."""
import math
from collections import Counter

import numpy as np
import pytest

from shadowprefill.cluster.router import (CallableRouter, CallContext, MarkovRouter, RandomRouter, ReplayRouter,
                                          SwitchPredictor)
from shadowprefill.cluster.targets import ShadowTargets
from shadowprefill.cluster.workloads import Call, Session, generate_sessions

PAIR = ("Qwen2.5-7B", "Llama-3.1-70B")


def _route_all(router, sessions):
    routes = []
    for s in sessions:
        history = []
        for k in range(len(s.calls)):
            history.append(router.route(s, k, list(history)))
        routes.append(history)
    return routes


def _sessions(n=600, seed=0):
    return generate_sessions("fusionbench", PAIR, num_sessions=n, seed=seed)


def test_replay_is_exact_and_can_rename():
    sessions = _sessions(50)
    assert _route_all(ReplayRouter(), sessions) == [s.models for s in sessions]
    mapped = _route_all(ReplayRouter({"Qwen2.5-7B": "Llama-3.1-8B"}), sessions)
    assert mapped == [[{"Qwen2.5-7B": "Llama-3.1-8B"}.get(m, m) for m in s.models] for s in sessions]


@pytest.fixture(scope="module")
def many_sessions():
    return _sessions(1500, seed=1)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5])
def test_markov_switch_rate_converges_to_p(p, many_sessions):
    sessions = many_sessions
    routes = _route_all(MarkovRouter(PAIR, p, seed=3), sessions)
    steps = sum(len(r) - 1 for r in routes)
    switches = sum(a != b for r in routes for a, b in zip(r, r[1:]))
    assert abs(switches / steps - p) < 4 * math.sqrt(p * (1 - p) / steps)
    first = Counter(r[0] for r in routes)
    assert abs(first[PAIR[0]] / len(routes) - 0.5) < 4 * math.sqrt(0.25 / len(routes))


def test_markov_is_deterministic_per_call_and_seed():
    sessions = _sessions(100, seed=2)
    router = MarkovRouter(PAIR, 0.3, seed=9)
    forward = _route_all(router, sessions)
    backward = _route_all(router, sessions[::-1])[::-1]                      # asking order does not matter
    assert forward == backward == _route_all(MarkovRouter(PAIR, 0.3, seed=9), sessions)
    assert forward != _route_all(MarkovRouter(PAIR, 0.3, seed=10), sessions)


def test_markov_n_states_targets_and_task_override():
    models = ["a", "b", "c"]
    sessions = _sessions(800, seed=3)
    router = MarkovRouter(models, 0.4, seed=1, targets={"a": {"b": 3.0, "c": 1.0}},
                          p_by_task={sessions[0].task: 0.0})
    moves = Counter()
    for s, r in zip(sessions, _route_all(router, sessions)):
        if s.task == sessions[0].task:
            assert len(set(r)) == 1                                          # p = 0 for that task
        moves.update((x, y) for x, y in zip(r, r[1:]) if x != y)
    from_a = moves[("a", "b")] + moves[("a", "c")]
    assert from_a > 200
    assert abs(moves[("a", "b")] / from_a - 0.75) < 4 * math.sqrt(0.75 * 0.25 / from_a)
    from_b = moves[("b", "a")] + moves[("b", "c")]
    assert abs(moves[("b", "a")] / from_b - 0.5) < 4 * math.sqrt(0.25 / from_b)


def test_random_router_weights():
    sessions = _sessions(300, seed=4)
    routes = _route_all(RandomRouter(PAIR, weights={PAIR[0]: 3.0, PAIR[1]: 1.0}, seed=2), sessions)
    calls = [m for r in routes for m in r]
    share = calls.count(PAIR[0]) / len(calls)
    assert abs(share - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(calls))


def test_callable_router_sees_the_call():
    seen = []

    def fn(ctx: CallContext) -> str:
        seen.append((ctx.call_index, ctx.history, ctx.prompt_tokens, ctx.task, ctx.recorded_model))
        assert len(ctx.prompt_ids()) == ctx.prompt_tokens
        return PAIR[1] if ctx.prompt_tokens > 3000 else PAIR[0]

    s = _sessions(5, seed=5)[0]
    routes = _route_all(CallableRouter(fn, models=PAIR), [s])[0]
    assert routes == [PAIR[1] if s.prompt_len(k) > 3000 else PAIR[0] for k in range(len(s.calls))]
    assert [x[0] for x in seen] == list(range(len(s.calls)))
    assert seen[1][1] == (routes[0],) and seen[0][4] == s.calls[0].model
    with pytest.raises(ValueError, match="not one of"):
        CallableRouter(lambda ctx: "gpt-17", models=PAIR).route(s, 0, [])
    with pytest.raises(ValueError, match="returned None"):
        CallableRouter(lambda ctx: None).route(s, 0, [])
    with pytest.raises(TypeError):
        CallableRouter("not callable")


def test_router_argument_validation():
    s = Session("s", "t", "x", 0.0, [Call("m", 5, 1), Call("m", 5, 1)])
    with pytest.raises(ValueError, match="history"):
        ReplayRouter().route(s, 1, [])
    with pytest.raises(ValueError, match="call_index"):
        ReplayRouter().route(s, 2, ["m", "m"])
    with pytest.raises(ValueError, match="p must be"):
        MarkovRouter(PAIR, 1.5)
    with pytest.raises(ValueError, match="models"):
        MarkovRouter(["a", "a"], 0.1)
    with pytest.raises(ValueError, match="history"):
        MarkovRouter(PAIR, 0.1).route(s, 1, ["zzz"])
    with pytest.raises(ValueError, match="unknown model"):
        RandomRouter(PAIR, weights={"zzz": 1.0})


def test_predictor_learns_per_task_switch_probability(many_sessions):
    sessions = many_sessions
    tasks = sorted({s.task for s in sessions})
    truth = {t: 0.1 + 0.2 * i for i, t in enumerate(tasks)}                 # 0.1, 0.3, 0.5, 0.7
    routes = _route_all(MarkovRouter(PAIR, 0.0, seed=4, p_by_task=truth), sessions)
    predictor = SwitchPredictor()
    assert predictor.switch_probability(tasks[0], PAIR[0], PAIR[1]) == pytest.approx(0.25)   # the prior
    for s, r in zip(sessions, routes):
        predictor.observe_session(s.task, r)
    assert predictor.num_sessions == 1500
    for t, p in truth.items():
        for current, target in (PAIR, PAIR[::-1]):
            assert predictor.switch_probability(t, current, target) == pytest.approx(p, abs=0.04)
            assert predictor.switch_probability(t, current, current) == pytest.approx(1 - p, abs=0.04)
    # an unseen task backs off to the model-level estimate over all tasks (about the mean of `truth`)
    assert predictor.switch_probability("other", PAIR[0], PAIR[1]) == pytest.approx(0.4, abs=0.08)


def test_predictor_ranks_targets_with_more_models():
    predictor = SwitchPredictor(pseudo_count=1.0)
    for _ in range(30):
        predictor.observe_session("plan", ["a", "b", "a", "c", "a", "b", "a"])
    dist = predictor.next_model_distribution("plan", "a", ["a", "b", "c", "d"])
    assert sum(dist.values()) == pytest.approx(1.0)
    ranked = ShadowTargets("all").choose(predictor, "plan", "a", ["a", "b", "c", "d"])
    assert [m for m, _ in ranked] == ["b", "c", "d"]
    assert ranked[0][1] == pytest.approx(2 / 3, abs=0.02) and ranked[2][1] < 0.01
    assert ShadowTargets("top1").choose(predictor, "plan", "a", ["a", "b", "c", "d"]) == ranked[:1]
    # the Predictive gate drops the unlikely targets (c: about 1/3, d: about 0)
    assert [m for m, _ in ShadowTargets("all", 0.25).choose(predictor, "plan", "a", list("abcd"))] == ["b", "c"]
    assert predictor.switch_probability("plan", "b", "a") == pytest.approx(1.0, abs=0.02)
    assert predictor.probabilities("plan", "a", ["b", "c", "d"]) == {m: dist[m] for m in "bcd"}
    with pytest.raises(ValueError, match="prior_switch"):
        SwitchPredictor(prior_switch=2.0)
    np.testing.assert_allclose(sum(predictor.next_model_distribution("new", "z").values()), 1.0)
