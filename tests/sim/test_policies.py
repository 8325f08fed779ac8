"""Table 2 policies: the table itself, parsing, and each policy configuring the same engine and manager
(checked on a tiny cluster run)."""
import pytest

from shadowprefill.cluster.workloads import Call, Session
from shadowprefill.sim.policies import POLICIES, POLICY_ORDER, get_policy, parse_policies
from shadowprefill.sim.simulator import SimConfig, Simulator

SMALL, LARGE = "Qwen2.5-7B", "Llama-3.1-8B"
_CACHE: dict = {}

EXPECTED = {   # name: (shadow mode, host tier, gate, dedicated, oracle) from the paper's Table 2
    "no-shadow": ("none", False, 0.0, False, False),
    "host-tier": ("none", True, 0.0, False, False),
    "harvest": ("harvest", False, 0.0, False, False),
    "harvest-slo": ("harvest-slo", False, 0.0, False, False),
    "harvest-slo+host": ("harvest-slo", True, 0.0, False, False),
    "predictive": ("harvest", False, 0.25, False, False),
    "dedicated": ("none", False, 0.0, True, False),
    "eager": ("eager", False, 0.0, False, False),
    "oracle": ("none", False, 0.0, False, True),
    "oracle+host": ("none", True, 0.0, False, True),
}


def test_table2_has_the_ten_policies():
    assert POLICY_ORDER == tuple(EXPECTED)
    for name, (mode, host, gate, dedicated, oracle) in EXPECTED.items():
        p = POLICIES[name]
        assert (p.shadow_mode, p.host_tier, p.min_switch_prob, p.dedicated, p.oracle) == (mode, host, gate,
                                                                                          dedicated, oracle)
        assert p.description


def test_parse_policies():
    assert [p.name for p in parse_policies("no-shadow, Harvest_SLO+host,no-shadow")] == ["no-shadow",
                                                                                          "harvest-slo+host"]
    assert len(parse_policies("all")) == 10
    assert get_policy(POLICIES["eager"]) is POLICIES["eager"]
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies("no-shadow,magic")
    with pytest.raises(ValueError, match="policies"):
        parse_policies(" ")
    with pytest.raises(TypeError, match="policy"):
        get_policy(3)


def _sessions():
    out = []
    for i in range(3):
        calls = [Call((SMALL, LARGE)[(k + i) % 2], 2500 if k == 0 else 300, 20, gap_s=0.5) for k in range(4)]
        out.append(Session(f"s{i}", "t", "task", 1.0 * i, calls))
    return out


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_policy_configures_the_cluster(name):
    mode, host, gate, dedicated, oracle = EXPECTED[name]
    cfg = SimConfig(models=(SMALL, LARGE), instances=1, normal_rate={SMALL: 0.5, LARGE: 0.5}, duration_s=5.0,
                    warmup_s=0.0, max_drain_s=300.0)
    sim = Simulator(cfg, name, _sessions(), latency_cache=_CACHE)
    assert len(sim.instances) == 2 * (2 if dedicated else 1)
    for inst in sim.instances:
        ecfg = inst.engine.config
        expected_mode = "harvest-slo" if inst.role == "dedicated" else ("none" if dedicated else mode)
        assert ecfg.shadow_mode == expected_mode
        assert (inst.engine.kv.host_tier is not None) == host
        if host:       # 32 GB of DRAM per GPU
            assert inst.engine.kv.host_tier.num_pages * ecfg.page_bytes == pytest.approx(32e9 * inst.gpus,
                                                                                          rel=1e-3)
        assert sim.manager.targets.min_switch_prob == gate
    assert sim.manager.oracle == oracle
    r = sim.run()
    assert len(r.calls) == 12 and r.sessions_unfinished == 0
    switch_cached = sum(c.cached_tokens for c in r.calls if c.is_switch)
    if mode == "none" and not dedicated and not oracle:
        assert r.shadow_tokens == 0
    elif oracle:
        assert r.shadow_tokens == 0 and r.extra["oracle_tokens"] > 0
    else:
        assert r.shadow_tokens > 0 and switch_cached > 0
    assert r.extra["shadow_use_tracked"] == (mode != "eager")
    assert r.gpus == len(sim.instances)
