"""EngineDriver: discrete events (begin/end) and its own thread give the same iterations as stepping the engine
by hand (the reference), work handed over with post() runs between iterations, a crash is reported."""
import threading

import pytest

from shadowprefill.cluster.driver import EngineDriver
from shadowprefill.engine.clock import VirtualClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.model.latency import LatencyModel
from tests.cluster.test_manager import tokens

MODEL = "Qwen2.5-7B"
_LM = {}


def engine():
    lm = _LM.setdefault(MODEL, LatencyModel(MODEL))
    return LLMEngine(SimulatedExecutor(lm, lambda r: 100 + len(r.output_token_ids)),
                     EngineConfig(num_blocks=2048, shadow_mode="harvest-slo", model_id=MODEL), clock=VirtualClock(),
                     latency_model=lm)


def load(e):
    for i in range(6):
        e.add_request(f"r{i}", tokens(i, 300 + 500 * i), 5 + i, priority="routed" if i % 2 else "normal")
    e.add_shadow("s", tokens(99, 4000), switch_prob=0.5)


def trace(outputs, clock):
    return [(round(clock.now(), 12), o.request_id, tuple(o.token_ids), o.finished) for o in outputs]


def reference():
    e = engine()
    load(e)
    out = []
    while e.has_work():
        out += trace(e.step(), e.clock)
    return out, e.stats.busy_time_s, e.stats.shadow_tokens


def test_discrete_events_match_stepping_by_hand():
    ref, busy, shadow = reference()
    e = engine()
    load(e)
    d = EngineDriver(e)
    out = []
    while True:
        it = d.begin()
        if it is None:
            break
        assert d.begin() is None                   # one iteration in flight at a time
        e.clock.advance_to(it.start + it.duration)
        out += trace(d.end(), e.clock)
    assert out == ref and d.busy_s == pytest.approx(busy) and e.stats.shadow_tokens == shadow > 0
    with pytest.raises(RuntimeError, match="without an iteration"):
        d.end()


def test_own_thread_runs_posted_work_and_delivers_every_output():
    ref, _, _ = reference()
    e = engine()
    got, done = [], threading.Event()

    def on_outputs(outputs):
        got.extend(trace(outputs, e.clock))
        if sum(o[3] for o in got) == 6:
            done.set()

    d = EngineDriver(e, on_outputs=on_outputs, idle_poll_s=0.005)
    with pytest.raises(RuntimeError, match="not running"):
        d.post(lambda: None)
    d.start()
    try:
        d.post(lambda: load(e))                    # handed over while the thread waits idle
        assert done.wait(30)
    finally:
        d.stop()
    assert not d.running and d.error is None
    assert [g for g in got if g[3]] == [r for r in ref if r[3]]
    assert {(g[1], g[2]) for g in got} <= {(r[1], r[2]) for r in ref}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the thread re-raises
def test_a_crash_is_kept_and_reported():
    e = engine()
    seen = []
    d = EngineDriver(e, on_error=seen.append)
    d.start()
    d.post(lambda: 1 / 0)
    d._thread.join(10)
    assert isinstance(d.error, ZeroDivisionError) and seen == [d.error] and not d.running
    with pytest.raises(RuntimeError, match="not running"):
        d.post(lambda: None)
    with pytest.raises(TypeError, match="engine"):
        EngineDriver(object())
    with pytest.raises(ValueError, match="idle_poll_s"):
        EngineDriver(e, idle_poll_s=0)
