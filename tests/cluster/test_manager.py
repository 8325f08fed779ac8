"""ClusterManager: sticky lowest-estimate placement, shadow jobs with streamed output, N > 2 targets,
Oracle warm-up, Dedicated shadow instances. Engines are real `LLMEngine`s with a SimulatedExecutor on a
shared virtual clock; the test drives them by hand."""
import numpy as np
import pytest

from shadowprefill.cluster.manager import ClusterManager, Instance
from shadowprefill.engine.clock import VirtualClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.model.latency import LatencyModel

SMALL, LARGE, THIRD = "Qwen2.5-7B", "Llama-3.1-8B", "Mistral-7B"
_LM: dict = {}


def make_instance(model, index, clock, mode="harvest-slo", role="serve", token_fn=None, num_blocks=4096):
    lm = _LM.setdefault(model, LatencyModel(model))
    cfg = EngineConfig(num_blocks=num_blocks, shadow_mode=mode, model_id=model)
    engine = LLMEngine(SimulatedExecutor(lm, token_fn), cfg, clock=clock, latency_model=lm)
    return Instance(f"{model}/{index}", model, index, engine, lm, role=role)


def tokens(seed, n):
    return np.random.default_rng(seed).integers(10, 30000, size=n).tolist()


class Prior:
    """A fixed next-model prior, recording what it was taught."""

    def __init__(self, probs):
        self.probs, self.seen = probs, []

    def probabilities(self, task, current_model, candidates):
        return {m: self.probs.get(m, 0.0) for m in candidates}

    def observe_session(self, task, models):
        self.seen.append((task, list(models)))


def drain(instances, manager, clock, limit=20000):
    """Step every engine with work through its EngineDriver, in time order, until all are idle; returns
    finished tickets."""
    done = []
    for _ in range(limit):
        for inst in instances:
            inst.driver.begin()
        pending = [inst for inst in instances if inst.driver.iteration is not None]
        if not pending:
            return done
        inst = min(pending, key=lambda i: i.driver.iteration.start + i.driver.iteration.duration)
        clock.advance_to(inst.driver.iteration.start + inst.driver.iteration.duration)
        done += manager.on_outputs(inst, inst.driver.end())
    raise AssertionError("engines did not go idle")


def test_sticky_placement_prefers_cache_until_the_instance_is_busy():
    clock = VirtualClock()
    a0, a1 = make_instance(SMALL, 0, clock), make_instance(SMALL, 1, clock)
    b0 = make_instance(LARGE, 0, clock)
    m = ClusterManager({SMALL: [a0, a1], LARGE: [b0]}, shadows=False)
    p0 = tokens(1, 3000)
    t0 = m.submit_call("s", 0, SMALL, p0, 4)
    assert t0.instance is a0                                  # tie: lowest index
    drain([a0, a1, b0], m, clock)
    p1 = p0 + t0.request.output_token_ids + tokens(2, 500)
    # a0 caches the session's prefix: its estimate counts only the uncached tail
    est0, est1 = m.estimate_prefill_s(a0, p1), m.estimate_prefill_s(a1, p1)
    assert est0 < est1
    cached = a0.engine.cached_prefix_tokens(p1)[0]
    assert cached >= 3000 - 16
    expect0 = a0.engine.predictor.prefill_time(len(p1) - cached, cached, 2048)
    assert est0 == pytest.approx(expect0)
    t1 = m.submit_call("s", 1, SMALL, p1, 4)
    assert t1.instance is a0
    drain([a0, a1, b0], m, clock)
    # a long queue ahead on a0: a cold prefill on a1 finishes first
    for i in range(12):
        a0.engine.add_request(f"n{i}", tokens(100 + i, 8000), 2, priority="normal")
    p2 = p1 + t1.request.output_token_ids + tokens(3, 200)
    queue = a0.engine.queued_prefill_tokens()
    assert queue == 12 * 8000
    assert m.estimate_prefill_s(a0, p2) > m.estimate_prefill_s(a1, p2)
    t2 = m.submit_call("s", 2, SMALL, p2, 4)
    assert t2.instance is a1
    assert m.sessions[("", "s")].sticky[SMALL] is a1


def test_shadow_job_gets_input_at_once_and_output_as_it_streams():
    clock = VirtualClock()
    outs = {}
    fn = lambda r: outs.get(r.request_id, [7] * 1000)[len(r.output_token_ids)]   # noqa: E731
    a, b = make_instance(SMALL, 0, clock, token_fn=fn), make_instance(LARGE, 0, clock, token_fn=fn)
    prior = Prior({LARGE: 0.4, SMALL: 0.3})
    m = ClusterManager({SMALL: [a], LARGE: [b]}, prior=prior)
    prompt = tokens(5, 2000)
    outs["s#0"] = tokens(6, 40)
    ticket = m.submit_call("s", 0, SMALL, prompt, 40, task="t")
    job = b.engine.jobs.get("s")
    assert job is not None and job.token_ids == prompt       # input appended at once
    assert job.switch_prob == pytest.approx(0.4)
    assert ticket.stream_to == [b]
    done = drain([a, b], m, clock)
    assert [t.request_id for t in done] == ["s#0"]
    # the routed output streamed into the job (the job may have been fully shadowed and still be queued)
    job = b.engine.jobs.get("s")
    assert job is not None and job.token_ids == prompt + outs["s#0"]
    assert b.engine.stats.shadow_tokens > 0
    # the switch call finds the history cached on the large model's sticky instance
    nxt = prompt + outs["s#0"] + tokens(8, 300)
    t1 = m.submit_call("s", 1, LARGE, nxt, 3, task="t")
    assert t1.is_switch and t1.instance is b
    assert "s" not in b.engine.jobs                           # the model now serves the session itself
    shadowed = b.engine.stats.shadow_tokens
    drain([a, b], m, clock)
    # whole pages only, and a tail below n_min (256) is left for the switch call itself
    assert t1.request.num_cached_tokens == shadowed >= (len(prompt) + 40) // 16 * 16 - 256
    m.end_session("s")
    assert prior.seen == [("t", [SMALL, LARGE])]


def test_three_models_all_targets_by_prior_or_top1():
    for targets in ("all", "top1"):
        clock = VirtualClock()
        insts = {mod: [make_instance(mod, 0, clock)] for mod in (SMALL, LARGE, THIRD)}
        prior = Prior({LARGE: 0.1, THIRD: 0.6})
        m = ClusterManager(insts, prior=prior, shadow_targets=targets)
        ticket = m.submit_call("s", 0, SMALL, tokens(9, 1000), 2)
        homes = [h.model for h in ticket.stream_to]
        assert homes == ([THIRD, LARGE] if targets == "all" else [THIRD])
        assert insts[THIRD][0].engine.jobs.get("s").switch_prob == pytest.approx(0.6)
        assert ("s" in insts[LARGE][0].engine.jobs) == (targets == "all")


def test_oracle_warm_registers_the_history_without_compute():
    clock = VirtualClock()
    a, b = make_instance(SMALL, 0, clock, mode="none"), make_instance(LARGE, 0, clock, mode="none")
    m = ClusterManager({SMALL: [a], LARGE: [b]}, oracle=True, shadows=False)
    history = tokens(11, 5000)
    m.submit_call("s", 0, SMALL, history[:4000], 1000)       # history[4000:] stands for its output
    drain([a, b], m, clock)
    busy_before = b.engine.stats.busy_time_s
    prompt = history + tokens(12, 100)
    t = m.submit_call("s", 1, LARGE, prompt, 2, kept_prefix=len(history))
    assert t.is_switch and t.oracle_warmed_tokens == 5000 // 16 * 16
    assert b.engine.stats.busy_time_s == busy_before         # nothing was computed to warm it
    drain([a, b], m, clock)
    assert t.request.num_cached_tokens == 5000 // 16 * 16
    assert b.engine.stats.prefill_tokens_routed == len(prompt) - 5000 // 16 * 16


def test_dedicated_instance_receives_all_shadow_jobs():
    clock = VirtualClock()
    a = make_instance(SMALL, 0, clock, mode="none")
    b = make_instance(LARGE, 0, clock, mode="none")
    bd = make_instance(LARGE, 1, clock, role="dedicated")
    ad = make_instance(SMALL, 1, clock, role="dedicated")
    m = ClusterManager({SMALL: [a, ad], LARGE: [b, bd]}, shadow_instances={SMALL: ad, LARGE: bd})
    for i in range(4):                                        # a is busy, ad idle: still not a candidate
        a.engine.add_request(f"n{i}", tokens(200 + i, 4000), 2, priority="normal")
    p0 = tokens(13, 3000)
    t = m.submit_call("s", 0, SMALL, p0, 2)
    assert t.instance is a
    assert t.stream_to == [bd] and "s" in bd.engine.jobs and "s" not in b.engine.jobs
    drain([a, b, ad, bd], m, clock)
    assert bd.engine.stats.shadow_tokens >= 2048
    t1 = m.submit_call("s", 1, LARGE, p0 + t.request.output_token_ids + tokens(14, 100), 2)
    assert t1.is_switch and t1.instance is bd                 # the switch call finds its shadow there
    assert m.switch_calls_on_shadow == m.switch_calls == 1


def test_bad_arguments():
    clock = VirtualClock()
    a = make_instance(SMALL, 0, clock)
    with pytest.raises(ValueError, match="instances"):
        ClusterManager({})
    with pytest.raises(ValueError, match="shadow_targets"):
        ClusterManager({SMALL: [a]}, shadow_targets="some")
    with pytest.raises(ValueError, match="instances"):
        ClusterManager({LARGE: [a]})
    m = ClusterManager({SMALL: [a]})
    with pytest.raises(ValueError, match="not deployed"):
        m.submit_call("s", 0, LARGE, [1, 2, 3], 1)
    with pytest.raises(ValueError, match="role"):
        Instance("x", SMALL, 0, a.engine, role="other")
