"""P/D-disaggregated cluster: prefill on P, KV over the D link, decode on D; D keeps the session context;
shadow KV is prefilled on P and pushed to D, so a switch transfers and prefills less."""
import pytest

from shadowprefill.cluster.manager import ClusterManager
from shadowprefill.cluster.pd import Disaggregation
from shadowprefill.cluster.workloads import Call, Session
from shadowprefill.engine.clock import VirtualClock
from shadowprefill.sim.metrics import compare
from shadowprefill.sim.simulator import SimConfig, Simulator
from tests.cluster.test_manager import drain, make_instance, tokens

SMALL, LARGE = "Qwen2.5-7B", "Llama-3.1-8B"
_CACHE: dict = {}


def sessions():
    out = []
    for i in range(4):
        calls = [Call((SMALL, LARGE)[(k // 2 + i) % 2], 4000 if k == 0 else 300, 30, gap_s=1.0) for k in range(6)]
        out.append(Session(f"s{i}", "t", "task", 3.0 * i, calls))
    return out


def run(policy, normal=0.0, **kw):
    cfg = SimConfig(models=(SMALL, LARGE), instances=3, pd_prefill=2, normal_rate={SMALL: normal, LARGE: normal},
                    duration_s=20.0, warmup_s=0.0, max_drain_s=600.0, seed=2, **kw)
    sim = Simulator(cfg, policy, sessions(), latency_cache=_CACHE)
    return sim, sim.run()


def test_calls_prefill_on_p_decode_on_d_and_d_keeps_the_context():
    sim, r = run("no-shadow")
    by_id = {s.session_id: s for s in sessions()}
    assert len(r.calls) == 24 and r.sessions_unfinished == 0
    roles = {i.name: i.role for i in sim.instances}
    assert sorted(roles.values()) == ["decode", "decode", "prefill", "prefill", "prefill", "prefill"]
    kv = {m: sim.latency_models[m].kv_bytes_per_token for m in (SMALL, LARGE)}
    moved = sum(link.bytes_moved for link in sim.manager.pd.links.values())
    # every call moves what its D instance lacks: at most its whole prompt + first token, and a session
    # that stays on a model sends only the new tokens (D kept the previous prompt and output)
    full = sum((c.prompt_tokens + 1) * kv[c.model] for c in r.calls)
    assert 0 < moved < 0.6 * full
    for c in r.calls:
        assert c.output_tokens == by_id[c.session_id].calls[c.call_index].output_tokens
        assert c.arrival < c.first_token < c.finish
        assert roles[c.instance] == "decode"
    d_engines = [i.engine for i in sim.instances if i.role == "decode"]
    p_engines = [i.engine for i in sim.instances if i.role == "prefill"]
    assert sum(e.stats.decode_tokens for e in d_engines) > 0 and sum(e.stats.decode_tokens for e in p_engines) == 0
    # D prefills only the tail after the last whole page (+ the first token) of each call
    assert sum(e.stats.prefill_tokens_routed for e in d_engines) <= 24 * 17
    # P prefill = uncached prompt tokens
    assert sum(e.stats.prefill_tokens_routed for e in p_engines) == sum(c.prompt_tokens - c.cached_tokens
                                                                        for c in r.calls)


def test_shadow_on_p_is_pushed_to_d_and_shortens_switches():
    base_sim, base = run("no-shadow")
    sim, harvest = run("harvest-slo")
    assert sim.manager.pd.shadow_pushed_tokens > 0
    assert sum(i.engine.stats.shadow_tokens for i in sim.instances if i.role == "prefill") > 0
    assert sum(i.engine.stats.shadow_tokens for i in sim.instances if i.role == "decode") == 0
    moved_base = sum(link.bytes_moved for link in base_sim.manager.pd.links.values())
    moved = sum(link.bytes_moved for link in sim.manager.pd.links.values())
    assert moved >= moved_base          # pushes add link traffic ...
    res = compare({"no-shadow": base, "harvest-slo": harvest})
    assert res["harvest-slo"]["switch_hit_rate"] > res["no-shadow"]["switch_hit_rate"] + 0.2
    assert res["harvest-slo"]["switch_call_ttft_mean_s"] < res["no-shadow"]["switch_call_ttft_mean_s"]


def test_normal_traffic_and_bad_config():
    sim, r = run("no-shadow", normal=1.0)
    assert r.normal and all(n.finish is not None and n.first_token < n.finish or n.output_tokens == 1
                            for n in r.normal)
    with pytest.raises(ValueError, match="pd_prefill"):
        SimConfig(models=(SMALL,), instances=2, pd_prefill=2)
    with pytest.raises(ValueError, match="Dedicated"):
        Simulator(SimConfig(models=(SMALL, LARGE), instances=2, pd_prefill=1), "dedicated", [])


def test_prefill_stage_streams_its_token_into_shadows_and_wakes_their_instances():
    """The first token (sampled on P) goes through the core's output handling like every other: into the
    session's shadow on the other model's P instance, which is woken to run it; the call continues on D."""
    clock = VirtualClock()
    p_s, p_l = (make_instance(m, 0, clock, role="prefill", token_fn=lambda r: 42) for m in (SMALL, LARGE))
    d_s, d_l = (make_instance(m, 0, clock, mode="none", role="decode", token_fn=lambda r: 43) for m in (SMALL, LARGE))
    woken = []
    pd = Disaggregation({SMALL: [d_s], LARGE: [d_l]}, kv_bytes_per_token={SMALL: 1e5, LARGE: 1e5})
    m = ClusterManager({SMALL: [p_s], LARGE: [p_l]}, disaggregation=pd, on_work=woken.append)
    prompt = tokens(3, 700)
    t = m.submit_call("s", 0, SMALL, prompt, 5)
    assert t.stream_to == [p_l] and t.request.max_tokens == 1
    woken.clear()
    it = p_s.driver.begin()
    clock.advance_to(it.start + it.duration)
    assert m.on_outputs(p_s, p_s.driver.end()) == []
    assert p_l.engine.shadow_progress("s").token_ids == prompt + [42]
    assert p_l in woken and d_s in woken and t.instance is d_s and t.stage == 1
    done = drain([p_s, p_l, d_s, d_l], m, clock)
    assert done == [t] and t.output_tokens == 5 and t.first_token < t.finish
    assert p_l.engine.shadow_progress("s").token_ids == prompt + [42] + [43] * 4
