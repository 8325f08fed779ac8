"""The orchestration core over request-level handles (the HTTP backend's contract, without HTTP): placement by
lowest estimate among healthy instances, shadows deferred to the completed call, cancellation when the
model serves the session itself, top-1 and the Predictive gate, fail-over, stateless calls; and the
Predictive gate on in-process engines."""
import pytest

from shadowprefill.cluster.manager import ClusterManager, NoLiveInstance
from shadowprefill.engine.clock import VirtualClock
from tests.cluster.test_manager import LARGE, SMALL, THIRD, Prior, drain, make_instance, tokens


class Upstream:
    """A request-level InstanceHandle double: estimates from a queue and what it holds, records the rest."""

    incremental = False
    role = "serve"

    def __init__(self, model, name):
        self.model, self.name = model, name
        self.up, self.queue, self.holding, self.log = True, 0, {}, []

    def healthy(self):
        return self.up

    def estimate_prefill_s(self, prompt, session, assume_cached=None):
        return float(self.queue + len(prompt) - self.holding.get(session.key, 0))

    def submit_call(self, ticket):
        self.log.append(("call", ticket.request_id))
        return (self.name, ticket.request_id)

    def upsert_shadow(self, session, history, switch_prob):
        self.log.append(("shadow", session.key, history, switch_prob))

    def extend_shadow(self, session, tokens):
        raise AssertionError("a request-level handle gets no streamed tokens")

    def cancel_shadow(self, session):
        self.log.append(("cancel", session.key))


def fleet():
    a0, a1, b0 = Upstream("a", "a0"), Upstream("a", "a1"), Upstream("b", "b0")
    return a0, a1, b0, ClusterManager({"a": [a0, a1], "b": [b0]})


def test_shadows_of_request_level_handles_follow_the_completed_call():
    a0, a1, b0, core = fleet()
    t0 = core.submit_call("s", None, "a", list(range(100)), tenant="t", payload="p0")
    assert t0.instance is a0 and t0.request == ("a0", "s#0") and a0.log == [("call", "s#0")]  # tie: lowest index
    assert t0.deferred == [("b", 0.5)] and b0.log == [] and t0.stream_to == []
    state = core.sessions[("t", "s")]
    assert state.sticky == {"a": a0} and state.models == ["a"]
    core.finish_call(t0, history="prompt+answer")
    assert b0.log == [("shadow", ("t", "s"), "prompt+answer", 0.5)] and state.shadow_on == {b0}
    assert "s#0" not in core.tickets
    # the switch call lands where its shadow is, and the routed model drops the session's pending shadow
    t1 = core.submit_call("s", None, "b", list(range(130)), tenant="t")
    assert t1.is_switch and t1.call_index == 1 and t1.instance is b0
    assert b0.log[1:] == [("cancel", ("t", "s")), ("call", "s#1")] and b0 not in state.shadow_on
    assert core.switch_calls == core.switch_calls_on_shadow == 1
    core.finish_call(t1, history=None)                      # a failed call gives no shadow
    assert a0.log == [("call", "s#0")]


def test_placement_counts_uncached_tokens_and_queue_and_skips_the_unhealthy():
    a0, a1, b0, core = fleet()
    prompt = list(range(1000))
    a1.holding[("t", "s")] = 900
    assert core.place("s", "a", prompt, "t") is a1
    a1.queue = 950                                          # busy: a cold prefill on a0 finishes first
    assert core.place("s", "a", prompt, "t") is a0
    a0.up = False
    assert core.place("s", "a", prompt, "t") is a1
    a1.up = False
    assert core.place("s", "a", prompt, "t") is None
    with pytest.raises(NoLiveInstance, match="'a'"):
        core.submit_call("s", None, "a", prompt, tenant="t")
    assert ("t", "s") not in core.tickets and core.sessions[("t", "s")].models == []
    with pytest.raises(ValueError, match="not deployed"):
        core.place("s", "zzz", prompt)


def test_fail_over_resubmits_cold_to_another_healthy_instance():
    a0, a1, b0, core = fleet()
    t = core.submit_call("s", None, "a", [1, 2, 3])
    a0.up = False
    assert core.fail_over(t) and t.instance is a1 and t.tried == [a0, a1]
    assert a1.log == [("call", "s#0")] and core.sessions[("", "s")].sticky["a"] is a1
    assert not core.fail_over(t)                            # a0 is down, a1 was tried
    assert t.instance is a1


def test_stateless_calls_have_no_session_and_no_shadows():
    a0, a1, b0, core = fleet()
    t1 = core.submit_call(None, None, "a", [1, 2])
    t2 = core.submit_call(None, None, "a", [1, 2])
    assert t1.request_id != t2.request_id and t1.session is None and t1.deferred == []
    assert core.sessions == {}
    core.finish_call(t1, history="x")
    assert b0.log == []


def test_top1_and_the_predictive_gate_pick_and_drop_targets():
    ups = {m: Upstream(m, m) for m in "abc"}
    prior = Prior({"b": 0.2, "c": 0.5})
    core = ClusterManager({m: [u] for m, u in ups.items()}, prior=prior, shadow_targets="top1")
    t = core.submit_call("s", None, "a", [1, 2, 3])
    assert t.deferred == [("c", 0.5)]
    core.finish_call(t, "h")
    gated = ClusterManager({m: [u] for m, u in ups.items()}, prior=prior, min_switch_prob=0.25)
    t = gated.submit_call("s", None, "a", [1, 2, 3])
    assert t.deferred == [("c", 0.5)]                       # b (0.2) is below the gate
    gated.finish_call(t, "h")
    state = gated.sessions[("", "s")]
    assert state.shadow_on == {ups["c"]}
    prior.probs["c"] = 0.1                                  # now c falls below the gate: its shadow is dropped
    t = gated.submit_call("s", None, "a", [1, 2, 3, 4])
    assert t.deferred == [] and ("cancel", ("", "s")) in ups["c"].log and state.shadow_on == set()
    with pytest.raises(ValueError, match="min_switch_prob"):
        ClusterManager({"a": [ups["a"]]}, min_switch_prob=1.5)


def test_predictive_gate_on_engines_creates_no_job_below_it_and_cancels_one_that_falls_below():
    clock = VirtualClock()
    insts = {m: [make_instance(m, 0, clock, mode="harvest")] for m in (SMALL, LARGE, THIRD)}
    prior = Prior({LARGE: 0.1, THIRD: 0.6})
    m = ClusterManager(insts, prior=prior, min_switch_prob=0.25)
    ticket = m.submit_call("s", 0, SMALL, tokens(1, 1000), 4)
    assert [h.model for h in ticket.stream_to] == [THIRD]
    assert insts[THIRD][0].engine.shadow_progress("s") is not None
    assert insts[LARGE][0].engine.shadow_progress("s") is None
    drain([i[0] for i in insts.values()], m, clock)
    prior.probs[THIRD] = 0.2
    m.submit_call("s", 1, SMALL, tokens(1, 1000) + tokens(2, 100), 4)
    assert insts[THIRD][0].engine.shadow_progress("s") is None
    assert m.sessions[("", "s")].shadow_on == set()
