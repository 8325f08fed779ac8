"""Control plane decisions on constructed cases (paper 003 §III-A): argmin λ_L·L̃ + λ_C·C̃ s.t. L <= L̄, Q >= Q̄."""
import math
import random

import pytest

from shadowprefill.gateway.control_plane import (AnalyticCostModel, Candidate, Constraints, ControlPlane,
                                                 GatewayRequest, MapperRegistry)
from shadowprefill.gateway.registry import CacheLayout, CacheRegistry, Location
from shadowprefill.gateway.sites import Link, Site, Topology

LAYOUT = CacheLayout(16, 32, 8, 128)  # Llama-3-8B-like page, bf16: 128 KiB per token
N = 16_384
TOKENS = [random.Random(0).randrange(100_000) for _ in range(N)]
OVERHEAD = 0.005  # Table III t_route + t_lookup


def prefill_s(n, m=0):  # Table III, written out independently: a(n-m) + b(n^2-m^2) + tau, in seconds
    return (0.04 * (n - m) + 3e-6 * (n * n - m * m) + 20.0) / 1000.0


def topo():
    return Topology([Site("cloud"), Site("cloud2"), Site("edge", kind="edge", compute_scale=0.5)],
                    default_link=Link(8e9, rtt_s=0.02))


def score_argmin(decision, cons):
    """Recompute the choice from the returned estimates, independently of the plane's own scoring."""
    finite = [o for o in decision.options if math.isfinite(o.latency_s)]
    l_ref, c_ref = max(o.latency_s for o in finite), max(o.cost for o in finite)
    ok = [o for o in finite if o.latency_s <= cons.max_latency_s and o.quality >= cons.min_quality]
    return min(ok, key=lambda o: cons.lambda_latency * o.latency_s / l_ref + cons.lambda_cost * o.cost / c_ref)


def test_target_cache_present_means_reuse():
    reg = CacheRegistry()
    reg.insert("t", "A", "v1", TOKENS[:12_000], LAYOUT, Location("cloud"), now=0)
    cp = ControlPlane(topo(), reg)
    cons = Constraints()
    d = cp.decide(GatewayRequest("t", TOKENS, now=1), [Candidate("A", "cloud", layout=LAYOUT),
                                                      Candidate("B", "cloud", layout=LAYOUT)], cons)
    c = d.chosen
    assert (c.model_id, c.site, c.action, c.cached_tokens) == ("A", "cloud", "reuse", 12_000 // 16 * 16)
    assert c.latency_s == pytest.approx(OVERHEAD + prefill_s(N, c.cached_tokens))
    assert c.cost == pytest.approx(c.cached_tokens * 0.1 + (N - c.cached_tokens))
    assert score_argmin(d, cons) == c
    # every (model, site) has a reprefill option with the §VI-B full prefill time
    for o in d.options:
        if o.action == "reprefill":
            assert o.latency_s == pytest.approx(OVERHEAD + prefill_s(N))


def test_another_models_cache_without_mapper_gives_shadow_or_reprefill_by_cost():
    reg = CacheRegistry()
    reg.insert("t", "A", "v1", TOKENS, LAYOUT, Location("cloud"), now=0)  # only the source model's cache
    cp = ControlPlane(topo(), reg)
    req = GatewayRequest("t", TOKENS, lead_time_s=2.0, now=1)
    # no harvested capacity: the only option for B is a full re-prefill (no map without a mapper)
    d = cp.decide(req, [Candidate("B", "cloud", layout=LAYOUT)])
    assert {o.action for o in d.options} == {"reprefill"} and d.chosen.action == "reprefill"
    # harvested capacity warms 4000 tok/s * 2 s of B during the lead time, for free: shadow wins
    cand = Candidate("B", "cloud", layout=LAYOUT, harvest_tokens_per_s=4000)
    d = cp.decide(req, [cand])
    assert d.chosen.action == "shadow" and d.chosen.cached_tokens == 8000
    assert d.chosen.latency_s == pytest.approx(OVERHEAD + prefill_s(N, 8000))
    # the same capacity priced at 3x the input price, and a cost-only objective: re-prefill is cheaper
    pricey = Candidate("B", "cloud", layout=LAYOUT, harvest_tokens_per_s=4000, harvest_price_per_token=3.0)
    cons = Constraints(lambda_latency=0.0, lambda_cost=1.0)
    d = cp.decide(req, [pricey], cons)
    shadow = next(o for o in d.options if o.action == "shadow")
    assert shadow.cost == pytest.approx(8000 * 0.1 + (N - 8000) + 8000 * 3.0)
    assert d.chosen.action == "reprefill" and score_argmin(d, cons) == d.chosen
    # a registered mapper A->B adds a map option with its declared fidelity loss
    class Linear:
        source_model, target_model, fidelity_loss = "A", "B", 0.03

        def time_s(self, tokens):
            return 1e-6 * tokens

    mappers = MapperRegistry()
    mappers.register(Linear())
    d = ControlPlane(topo(), reg, mappers=mappers).decide(req, [Candidate("B", "cloud", quality=0.9, layout=LAYOUT)])
    m = next(o for o in d.options if o.action == "map")
    assert m.quality == pytest.approx(0.87) and m.cached_tokens == N and m.source == "A"
    d = ControlPlane(topo(), reg, mappers=mappers).decide(
        req, [Candidate("B", "cloud", quality=0.9, layout=LAYOUT)], Constraints(min_quality=0.88))
    assert d.chosen.action == "reprefill"  # the mapper's loss violates Q̄


def _remote_setup(bandwidth=8e9):
    """A's cache sits at cloud2; the request can run at cloud or at the edge (all links at ``bandwidth``)."""
    reg = CacheRegistry()
    reg.insert("t", "A", "v1", TOKENS, LAYOUT, Location("cloud2"), now=0)
    cands = [Candidate("A", "cloud", layout=LAYOUT), Candidate("A", "edge", layout=LAYOUT, queue_s=0.1)]
    t = Topology([Site("cloud"), Site("cloud2"), Site("edge", kind="edge", compute_scale=0.5)],
                 default_link=Link(bandwidth, rtt_s=0.02))
    return ControlPlane(t, reg), GatewayRequest("t", TOKENS, now=1), cands


def test_tight_latency_bound_gives_fastest_feasible_action():
    cp, req, cands = _remote_setup(bandwidth=0.5e9)  # cheap cached KV behind a slow link
    cost_only = Constraints(lambda_latency=0.0, lambda_cost=1.0)
    free = cp.decide(req, cands, cost_only)
    actions = {o.action for o in free.options}
    assert {"transfer", "edge_prefill", "reprefill"} <= actions
    fastest = min(free.options, key=lambda o: o.latency_s)
    assert free.chosen.latency_s > fastest.latency_s  # the cheap choice is not the fast one
    tight = Constraints(lambda_latency=0.0, lambda_cost=1.0, max_latency_s=fastest.latency_s * 1.0001)
    d = cp.decide(req, cands, tight)
    assert d.chosen.latency_s == pytest.approx(fastest.latency_s)
    assert all(not o.feasible and "L̄" in o.reason for o in d.options if o.latency_s > tight.max_latency_s)
    none = cp.decide(req, cands, Constraints(max_latency_s=1e-4))
    assert not none.ok and none.chosen is None and all(not o.feasible for o in none.options)


def test_quality_bound_excludes_fp8_transfer():
    cp, req, _ = _remote_setup()
    cands = [Candidate("A", "cloud", quality=0.8, layout=LAYOUT)]
    fast = Constraints(lambda_latency=1.0, lambda_cost=0.0)
    d = cp.decide(req, cands, fast)
    raw = next(o for o in d.options if o.action == "transfer" and o.compression is None)
    fp8 = next(o for o in d.options if o.action == "transfer" and o.compression == "fp8")
    # wire bytes: raw pages vs e4m3 + one float32 scale per (page, layer, K/V, head), 20 ms RTT, 8 GB/s
    pages = N // 16
    raw_bytes, fp8_bytes = pages * 16 * 131072, pages * 32 * 2 * 8 * (16 * 128 + 4)
    assert raw.latency_s == pytest.approx(OVERHEAD + raw_bytes / 8e9 + 0.02 + prefill_s(N, N))
    assert fp8.latency_s == pytest.approx(OVERHEAD + fp8_bytes / 8e9 + 0.02 + prefill_s(N, N))
    assert fp8.quality < raw.quality == 0.8
    assert d.chosen == fp8  # allowed and faster
    strict = Constraints(lambda_latency=1.0, lambda_cost=0.0, min_quality=0.8)
    d = cp.decide(req, cands, strict)
    assert d.chosen.action == "transfer" and d.chosen.compression is None
    assert all(not o.feasible and "Q̄" in o.reason for o in d.options if o.compression == "fp8")


def test_other_tenants_cache_is_invisible_and_commit_touches():
    reg = CacheRegistry()
    e = reg.insert("alice", "A", "v1", TOKENS, LAYOUT, Location("cloud"), now=0)
    cp = ControlPlane(topo(), reg)
    d = cp.decide(GatewayRequest("bob", TOKENS, now=1), [Candidate("A", "cloud", layout=LAYOUT)])
    assert {o.action for o in d.options} == {"reprefill"}
    req = GatewayRequest("alice", TOKENS, now=7)
    d = cp.decide(req, [Candidate("A", "cloud", layout=LAYOUT)])
    assert d.chosen.action == "reuse" and d.chosen.entry_id == e.entry_id
    cp.commit(d, req)
    assert reg.get(e.entry_id).last_used_at == 7
    assert isinstance(d.as_dict()["options"], list)


def test_estimator_is_pluggable():
    class LinearModel:  # stands in for the simulator's latency model
        def prefill_time_s(self, model, tokens, cached_tokens=0):
            return {"A": 1e-4, "B": 2e-4}[model] * (tokens - cached_tokens) + 0.01

    cp = ControlPlane(topo(), CacheRegistry(), estimator=LinearModel())
    d = cp.decide(GatewayRequest("t", TOKENS, now=0), [Candidate("A", "cloud"), Candidate("B", "cloud")])
    lat = {o.model_id: o.latency_s for o in d.options}
    assert lat == pytest.approx({"A": OVERHEAD + 1e-4 * N + 0.01, "B": OVERHEAD + 2e-4 * N + 0.01})
    assert d.chosen.model_id == "A"
    edge = ControlPlane(topo(), CacheRegistry()).decide(GatewayRequest("t", TOKENS, now=0), [Candidate("A", "edge")])
    assert edge.chosen.latency_s == pytest.approx(OVERHEAD + prefill_s(N) / 0.5)  # edge at half speed
    assert AnalyticCostModel().prefill_time_s("x", N) == pytest.approx(prefill_s(N))


def test_bad_arguments():
    cp = ControlPlane(topo(), CacheRegistry())
    with pytest.raises(TypeError, match="request"):
        cp.decide({"tenant": "t"}, [Candidate("A", "cloud")])
    with pytest.raises(ValueError, match="candidates"):
        cp.decide(GatewayRequest("t", [1, 2]), [])
    with pytest.raises(ValueError, match="tokens"):
        GatewayRequest("t", [])
    with pytest.raises(ValueError, match="input_price"):
        Candidate("A", "cloud", input_price=-1)
    with pytest.raises(ValueError, match="site"):
        cp.decide(GatewayRequest("t", [1, 2]), [Candidate("A", "mars")])
    with pytest.raises(TypeError, match="estimator"):
        ControlPlane(estimator=object())
