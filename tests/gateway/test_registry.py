"""Cache registry: longest prefix, tenant isolation, version invalidation, revocation, TTL / capacity / LRU
(hypothesis state machine against a plain reference model), and placement decisions."""
import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shadowprefill.gateway.placement import apply_placement, plan_placement
from shadowprefill.gateway.registry import CacheLayout, CacheRegistry, Location
from shadowprefill.kv import page_hashes
from shadowprefill.gateway.sites import Link, Site, Topology

BS = 4
LAYOUT = CacheLayout(block_size=BS, num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE_BYTES = BS * 16  # 1 layer * (K,V) * 1 head * 2 dims * 4 bytes per token


def _tokens(seed, n):
    rng = random.Random(seed)
    return [seed * 1000 + 1] + [rng.randrange(50_000) for _ in range(n - 1)]


def test_layout_bytes_per_token():
    assert LAYOUT.bytes_per_token == 16
    llama8b = CacheLayout(16, 32, 8, 128)  # bf16: 32 layers * 2 * 8 heads * 128 dims * 2 bytes
    assert llama8b.bytes_per_token == 131072
    fp8 = CacheLayout(16, 32, 8, 128, compression="fp8")  # 1 byte + one float32 scale per head-page
    assert fp8.bytes_per_token == 32 * 2 * 8 * (128 + 4 / 16)


def test_longest_prefix_and_partial_pages():
    reg = CacheRegistry()
    toks = _tokens(1, 40)
    short = reg.insert("t", "m", "v1", toks[:10], LAYOUT, Location("s"), now=0)  # 2 full pages
    assert short.num_tokens == 8
    long = reg.insert("t", "m", "v1", toks[:30], LAYOUT, Location("s2"), now=1)  # 7 pages
    hit = reg.lookup("t", "m", toks, now=2)
    assert hit.entry.entry_id == long.entry_id and hit.matched_tokens == 28
    hit = reg.lookup("t", "m", toks[:9] + [999_999] * 20, now=2)  # diverges in page 3
    assert hit.matched_tokens == 8
    assert reg.lookup("t", "m", [7] + toks[1:], now=2) is None  # first page differs: nothing usable
    assert reg.lookup("t", "m", toks[:3], now=2) is None  # less than a page


def test_lookup_prefers_requesting_site_then_faster_tier():
    reg = CacheRegistry()
    toks = _tokens(2, 32)
    far = reg.insert("t", "m", "v1", toks, LAYOUT, Location("far"), now=0)
    host = reg.insert("t", "m", "v1", toks, LAYOUT, Location("near", "host"), now=0)
    assert reg.lookup("t", "m", toks, site="near", now=1).entry.entry_id == host.entry_id
    dev = reg.insert("t", "m", "v1", toks, LAYOUT, Location("near", "device"), now=0)
    assert reg.lookup("t", "m", toks, site="near", now=1).entry.entry_id == dev.entry_id
    assert reg.lookup("t", "m", toks, site="far", now=1).entry.entry_id == far.entry_id


def test_insert_extends_or_refreshes_instead_of_duplicating():
    reg = CacheRegistry()
    toks = _tokens(3, 40)
    a = reg.insert("t", "m", "v1", toks[:16], LAYOUT, Location("s"), now=0)
    b = reg.insert("t", "m", "v1", toks[:32], LAYOUT, Location("s"), now=1)  # extends a: a is replaced
    assert reg.get(a.entry_id) is None and len(reg) == 1
    c = reg.insert("t", "m", "v1", toks[:20], LAYOUT, Location("s"), now=5)  # covered by b: refresh b
    assert c.entry_id == b.entry_id and c.last_used_at == 5 and len(reg) == 1
    assert reg.used_bytes("s") == 8 * PAGE_BYTES


def test_tenant_isolation_and_revocation():
    reg = CacheRegistry()
    toks = _tokens(4, 64)
    reg.insert("alice", "m", "v1", toks, LAYOUT, Location("s"), now=0)
    assert reg.lookup("bob", "m", toks, now=1) is None
    assert reg.hits("bob", "m", toks, now=1) == []
    # identical tokens of two tenants hash to disjoint chains
    assert not set(page_hashes(toks, BS, "alice\x00m\x00v1")) & set(page_hashes(toks, BS, "bob\x00m\x00v1"))
    bob = reg.insert("bob", "m", "v1", toks[:32], LAYOUT, Location("s"), now=1)
    hit = reg.lookup("bob", "m", toks, now=2)
    assert hit.entry.entry_id == bob.entry_id and hit.matched_tokens == 32  # never alice's longer entry
    assert reg.revoke_tenant("alice") == 1
    assert reg.lookup("alice", "m", toks, now=3) is None
    assert all(e.tenant != "alice" for e in reg.entries())
    with pytest.raises(ValueError, match="revoked"):
        reg.insert("alice", "m", "v1", toks, LAYOUT, Location("s"), now=3)
    reg.reinstate_tenant("alice")
    assert reg.lookup("alice", "m", toks, now=3) is None  # revocation deleted the entries for good
    reg.insert("alice", "m", "v1", toks, LAYOUT, Location("s"), now=4)
    assert reg.lookup("alice", "m", toks, now=5).matched_tokens == 64


def test_model_version_change_invalidates():
    reg = CacheRegistry()
    toks = _tokens(5, 32)
    reg.insert("t", "m", "v1", toks, LAYOUT, Location("s"), now=0)
    other = reg.insert("t", "n", "v1", toks, LAYOUT, Location("s"), now=0)
    assert reg.set_model_version("m", "v2") == 1
    assert reg.lookup("t", "m", toks, now=1) is None
    assert reg.lookup("t", "n", toks, now=1).entry.entry_id == other.entry_id  # other models untouched
    with pytest.raises(ValueError, match="stale"):
        reg.insert("t", "m", "v1", toks, LAYOUT, Location("s"), now=1)
    reg.insert("t", "m", "v2", toks, LAYOUT, Location("s"), now=1)
    assert reg.lookup("t", "m", toks, now=2).entry.model_version == "v2"
    assert reg.used_bytes("s") == 2 * 8 * PAGE_BYTES


def test_ttl_and_lru_capacity():
    reg = CacheRegistry(ttl_s=10.0, capacity_bytes={"s": 5 * PAGE_BYTES})  # two 2-page spans fit
    t1, t2, t3 = _tokens(6, 8), _tokens(7, 8), _tokens(8, 8)
    a = reg.insert("t", "m", "v1", t1, LAYOUT, Location("s"), now=0)
    b = reg.insert("t", "m", "v1", t2, LAYOUT, Location("s"), now=1)
    reg.lookup("t", "m", t1, now=2)  # a is now more recent than b
    c = reg.insert("t", "m", "v1", t3, LAYOUT, Location("s"), now=3)  # evicts b (LRU), keeps a
    assert reg.get(b.entry_id) is None and reg.get(a.entry_id) is not None and reg.get(c.entry_id) is not None
    assert reg.used_bytes("s") == 4 * PAGE_BYTES
    assert reg.lookup("t", "m", t3, now=13.5) is None  # idle 10.5 s > TTL
    assert reg.lookup("t", "m", t1, now=11.9) is not None  # last used at 2: 9.9 s
    assert [e.entry_id for e in reg.expire(now=30)] == [a.entry_id]
    assert reg.insert("t", "m", "v1", _tokens(9, 40), LAYOUT, Location("s"), now=30) is None  # > capacity


def test_placement_replicates_hot_remote_entries_and_migrates_abandoned_ones():
    topo = Topology([Site("cloud"), Site("edge1", kind="edge"), Site("edge2", kind="edge")],
                    default_link=Link(1e6, rtt_s=0.01))
    big = CacheLayout(16, 4, 2, 64)  # 2 KiB per token
    reg = CacheRegistry(rate_window_s=60.0)
    toks = _tokens(10, 256)
    e = reg.insert("t", "m", "v1", toks, big, Location("cloud"), now=0)
    for k in range(30):  # hot from edge1, still used at cloud
        reg.lookup("t", "m", toks, site="edge1", now=1 + k)
        reg.lookup("t", "m", toks, site="cloud", now=1 + k)
    reg.lookup("t", "m", toks, site="edge2", now=31)  # one stray request from edge2
    plan = plan_placement(reg, topo, now=32, horizon_s=60)
    assert [(a.kind, a.dst.site) for a in plan] == [("replicate", "edge1")]
    assert plan[0].benefit_s > plan[0].cost_s
    replica = apply_placement(reg, plan[0], now=32)
    assert replica.location.site == "edge1" and replica.provenance == f"replicate:{e.entry_id}"
    assert reg.lookup("t", "m", toks, site="edge1", now=33).entry.entry_id == replica.entry_id
    assert plan_placement(reg, topo, now=33, horizon_s=60) == []  # edge1 already holds a copy

    reg2 = CacheRegistry(rate_window_s=10.0)
    e2 = reg2.insert("t", "m", "v1", toks, big, Location("cloud"), now=0)
    for k in range(40):  # only edge2 asks, long after cloud's own use decayed
        reg2.lookup("t", "m", toks, site="edge2", now=100 + k)
    plan = plan_placement(reg2, topo, now=140, horizon_s=60)
    assert [(a.kind, a.dst.site) for a in plan] == [("migrate", "edge2")]
    moved = apply_placement(reg2, plan[0], now=140)
    assert reg2.get(e2.entry_id) is None and moved.location.site == "edge2"
    assert reg2.used_bytes("cloud") == 0


def test_placement_weighs_transfer_cost():
    big = CacheLayout(16, 4, 2, 64)
    toks = _tokens(13, 256)
    plans = {}
    for bw in (1e6, 100e9):  # the same request stream behind a slow and a fast link
        topo = Topology([Site("cloud"), Site("edge", kind="edge")], default_link=Link(bw))
        reg = CacheRegistry(rate_window_s=60.0)
        reg.insert("t", "m", "v1", toks, big, Location("cloud"), now=0)
        for k in range(30):
            reg.lookup("t", "m", toks, site="edge", now=1 + k)
            reg.lookup("t", "m", toks, site="cloud", now=1 + k)
        plans[bw] = plan_placement(reg, topo, now=31, horizon_s=60)
    assert [a.kind for a in plans[1e6]] == ["replicate"]
    assert plans[100e9] == []  # a 5 µs fetch is not worth a copy


def test_placement_respects_capacity_held_by_hotter_entries():
    topo = Topology([Site("cloud"), Site("edge", kind="edge")], default_link=Link(1e4))  # 0.5 s per entry
    local, remote = _tokens(11, 320), _tokens(12, 320)  # 80 pages each; the edge holds 100
    for local_hits, want in ((2, []), (0, ["migrate"])):  # a hotter local entry blocks; a cold one yields
        reg = CacheRegistry(capacity_bytes={"edge": 100 * PAGE_BYTES}, rate_window_s=60.0)
        reg.insert("t", "m", "v1", local, LAYOUT, Location("edge"), now=0)
        reg.insert("t", "m", "v1", remote, LAYOUT, Location("cloud"), now=0)
        for k in range(20):
            for _ in range(local_hits):
                reg.lookup("t", "m", local, site="edge", now=1 + k)
            reg.lookup("t", "m", remote, site="edge", now=1 + k)
        now = 21 if local_hits else 600  # the cold case: the local entry's insert-time use has decayed
        if not local_hits:
            for k in range(20):
                reg.lookup("t", "m", remote, site="edge", now=now - 20 + k)
        plan = plan_placement(reg, topo, now=now, horizon_s=600)
        assert [a.kind for a in plan] == want
        if want:
            copy = apply_placement(reg, plan[0], now=now)
            assert copy.location.site == "edge" and reg.used_bytes("edge") <= 100 * PAGE_BYTES


def test_bad_arguments():
    reg = CacheRegistry()
    with pytest.raises(ValueError, match="tokens"):
        reg.insert("t", "m", "v1", [1, 2], LAYOUT, Location("s"))
    with pytest.raises(TypeError, match="layout"):
        reg.insert("t", "m", "v1", list(range(8)), None, Location("s"))
    with pytest.raises(ValueError, match="tier"):
        Location("s", "disk")
    with pytest.raises(ValueError, match="tenant"):
        reg.lookup("", "m", [1])
    with pytest.raises(ValueError, match="ttl_s"):
        CacheRegistry(ttl_s=0)
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout(0, 1, 1, 1)


# ---- random request stream vs a plain reference model ---------------------------------------------------

TTL = 20.0
CAPS = {"s1": 10 * PAGE_BYTES, "s2": 6 * PAGE_BYTES}
SESSIONS = [_tokens(100 + i, 10 * BS) for i in range(3)]
# Biased draws keep the key space small so that lookups meet live, expiring and evicted entries often.
TENANTS = st.sampled_from(["a", "a", "a", "b"])
MODELS = st.sampled_from(["m1", "m1", "m1", "m2"])
RARE = st.integers(0, 7)  # version bumps and revocations act on 1 draw in 8
TIER_RANK = {"device": 0, "host": 1, "remote": 2}


class RegistryMachine(RuleBasedStateMachine):
    """Reference: a dict of live entries {id: dict(tenant, model, version, session, pages, loc, last, size)}."""

    @initialize()
    def setup(self):
        self.reg = CacheRegistry(ttl_s=TTL, capacity_bytes=dict(CAPS))
        self.now = 0.0
        self.ref = {}
        self.version = {"m1": "v0", "m2": "v0"}
        self.revoked = set()

    def _live(self):
        return {i: e for i, e in self.ref.items() if self.now - e["last"] <= TTL}

    @rule(dt=st.floats(0, 8))
    def advance(self, dt):
        self.now += dt

    @rule(tenant=TENANTS, model=MODELS, s=st.integers(0, 2), pages=st.integers(1, 10),
          site=st.sampled_from(["s1", "s2"]), tier=st.sampled_from(["device", "host"]))
    def insert(self, tenant, model, s, pages, site, tier):
        toks = SESSIONS[s][:pages * BS + 1]  # a partial page at the end is ignored
        loc = Location(site, tier)
        if tenant in self.revoked:
            with pytest.raises(ValueError):
                self.reg.insert(tenant, model, self.version[model], toks, LAYOUT, loc, now=self.now)
            return
        before = {e.entry_id: e for e in self.reg.entries()}
        got = self.reg.insert(tenant, model, self.version[model], toks, LAYOUT, loc, now=self.now)
        self.ref = self._live()  # expired entries are gone as far as anything observable goes
        same = [i for i, e in self.ref.items() if (e["tenant"], e["model"], e["session"], e["loc"]) ==
                (tenant, model, s, loc)]
        covering = [i for i in same if self.ref[i]["pages"] >= pages]
        size = pages * PAGE_BYTES
        if size > CAPS[site]:  # larger than the site: refused, nothing changes
            assert got is None and {e.entry_id for e in self.reg.entries()} == set(before)
            return
        if covering:
            (i,) = covering
            self.ref[i]["last"] = max(self.ref[i]["last"], self.now)
            assert got is not None and got.entry_id == i
            return
        for i in same:
            del self.ref[i]
        assert got is not None
        at_site = sorted((e["last"], i) for i, e in self.ref.items() if e["loc"].site == site)
        used = sum(self.ref[i]["size"] for _, i in at_site)
        evicted = []
        for _, i in at_site:  # LRU eviction order
            if used + size <= CAPS[site]:
                break
            used -= self.ref[i]["size"]
            evicted.append(i)
            del self.ref[i]
        for i in evicted:
            assert i not in {e.entry_id for e in self.reg.entries()} and i in before
        self.ref[got.entry_id] = dict(tenant=tenant, model=model, version=self.version[model], session=s,
                                      pages=pages, loc=loc, last=self.now, size=size)

    @rule(tenant=TENANTS, model=MODELS, s=st.integers(0, 2), pages=st.integers(1, 10), extra=st.integers(0, 3),
          site=st.sampled_from(["s1", "s2", None]))
    def lookup(self, tenant, model, s, pages, extra, site):
        toks = SESSIONS[s][:pages * BS + extra]
        hit = self.reg.lookup(tenant, model, toks, site=site, now=self.now)
        self.ref = self._live()
        cands = [(i, e) for i, e in self.ref.items() if e["tenant"] == tenant and e["model"] == model
                 and e["session"] == s]
        if not cands:
            assert hit is None
            return
        key = lambda ie: (-min(ie[1]["pages"], pages), ie[1]["loc"].site != site, TIER_RANK[ie[1]["loc"].tier],
                          -ie[1]["last"], ie[0])
        i, e = min(cands, key=key)
        assert hit is not None and hit.entry.tenant == tenant and hit.entry.model_version == self.version[model]
        assert hit.matched_tokens == min(e["pages"], pages) * BS
        assert hit.entry.entry_id == i
        e["last"] = max(e["last"], self.now)

    @rule(model=MODELS, go=RARE)
    def bump_version(self, model, go):
        if go:
            return
        self.version[model] = f"v{int(self.version[model][1:]) + 1}"
        self.reg.set_model_version(model, self.version[model])
        self.ref = {i: e for i, e in self.ref.items() if e["model"] != model}

    @rule(tenant=TENANTS, go=RARE)
    def revoke(self, tenant, go):
        if go:
            return
        self.reg.revoke_tenant(tenant)
        self.revoked.add(tenant)
        self.ref = {i: e for i, e in self.ref.items() if e["tenant"] != tenant}
        assert all(e.tenant != tenant for e in self.reg.entries())

    @rule(tenant=TENANTS)
    def reinstate(self, tenant):
        self.reg.reinstate_tenant(tenant)
        self.revoked.discard(tenant)

    @rule()
    def expire(self):
        self.reg.expire(now=self.now)
        assert all(self.now - e.last_used_at <= TTL for e in self.reg.entries())

    @invariant()
    def capacity_and_live_set(self):
        if not hasattr(self, "reg"):
            return
        for site, cap in CAPS.items():
            used = sum(e.size_bytes for e in self.reg.entries() if e.location.site == site)
            assert self.reg.used_bytes(site) == pytest.approx(used) and used <= cap
        live = {e.entry_id for e in self.reg.entries() if self.now - e.last_used_at <= TTL}
        assert live == set(self._live())
        for e in self.reg.entries():
            assert e.model_version == self.version[e.model_id] and e.tenant not in self.revoked


TestRegistryStream = RegistryMachine.TestCase
TestRegistryStream.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
