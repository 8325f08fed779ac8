"""The native KV core (backend="native", csrc/kv/) against the Python reference (backend="python"): a
hypothesis state machine drives two managers with the same random operation sequences (prefix matches with
and without kept chains, allocations of both classes, commits, frees, touches, imports, peeks, bad frees, time
steps, async copy completions) and requires identical results, statistics and per-page state after every
step; plus the native page-hash chain against the independent reference of test_page_hashes.py."""
import random
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.native import native_available, native_module
from shadowprefill.kv.reload import ReloadBatch
from shadowprefill.kv.spec import KVCacheSpec

from .test_page_hashes import reference_hashes

if not native_available():   # the extension is built by `make install` on every machine: a missing one fails
    raise ImportError("shadowprefill._C_kv is not built")

BS = 2
NUM_BLOCKS = 12
HOST_PAGES = 6
TOKENS = st.integers(0, 2)
SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)
SEEN = Counter()   # the largest value of each statistic over the runs of a machine: what the runs exercised


def test_native_page_hashes_match_the_reference():
    rng = random.Random(3)
    nat = native_module()
    for block_size in (1, 2, 16, 29, 40):   # 29 and 40 tokens: pages of one and two BLAKE2b blocks
        toks = [rng.randrange(2**32) for _ in range(rng.randrange(0, 6 * block_size))]
        for salt in ("", "m\x00t", "ünï"):
            assert nat.page_hashes(toks, block_size, salt) == reference_hashes(toks, salt, block_size)
    with pytest.raises(ValueError, match="token_ids"):
        nat.page_hashes([1, -1], 2)
    with pytest.raises(ValueError, match="token_ids"):
        nat.page_hashes([2**32, 1], 2)
    with pytest.raises(TypeError, match="token_ids"):
        nat.page_hashes([1.0, 1], 2)


def test_native_chain_matches_the_python_chain():
    toks = [7] * (3 * BS) + [1] * BS
    chains = [KVCacheManager(8, BS, model_id="m", backend=b).hash_chain(toks, tenant="t") for b in ("python", "native")]
    for chain in chains:
        assert chain.extend_to(10) == 4 and chain.tokens is toks
    assert chains[0].hashes == chains[1].hashes == reference_hashes(toks, "m\x00t", BS)
    new = toks[:3 * BS] + [2] * (2 * BS)
    for chain in chains:
        chain.retarget(new, 3)
        assert len(chain) == 3 and chain.extend_to(10) == 5
    toks2 = chains[0].tokens
    toks2[BS] = 9                                         # an early page rewritten in place (and the tail)
    toks2[-1] = 9
    for chain in chains:
        assert chain.extend_to(10) == 5
    assert chains[0].hashes == chains[1].hashes == reference_hashes(toks2, "m\x00t", BS)


class ManualEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class Twin:
    """One manager, its tensors and its queue of (simulated) async copies."""

    def __init__(self, backend: str, tensors: bool, async_copies: bool):
        self.events = []
        if tensors:
            self.cache = SPEC.allocate(NUM_BLOCKS).normal_(generator=torch.Generator().manual_seed(0))
            self.host = HostTier(HOST_PAGES, spec=SPEC, pin_memory=False)
            self.host.cache.normal_(generator=torch.Generator().manual_seed(1))
        else:
            self.cache, self.host = None, HostTier(HOST_PAGES, page_bytes=64)
        if async_copies:
            for name in ("spill", "reload"):
                copy = getattr(self.host, name)

                def async_copy(*args, _copy=copy):
                    batch = _copy(*args)
                    if batch is not None:            # a layer-wise reload: its bytes move now
                        batch.wait()
                    self.events.append(ManualEvent())
                    return self.events[-1]
                setattr(self.host, name, async_copy)
        self.kv = KVCacheManager(NUM_BLOCKS, BS, kv_cache=self.cache, host_tier=self.host, page_bytes=0 if tensors else 64,
                                 shadow_fraction=0.5, cold_age_s=2.0, model_id="m", backend=backend)
        self.chains = {}

    def event_id(self, event):
        if isinstance(event, ReloadBatch):          # CPU tensors: the layer-wise reload (copies run on demand)
            return "reload", tuple(event.pages), event.issued, event.copied
        return None if event is None else next(i for i, e in enumerate(self.events) if e is event)


def call(twin, method, *args, **kwargs):
    """(result, or the exception type and message) of one manager call."""
    try:
        return getattr(twin.kv, method)(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return type(e), str(e)


class DifferentialMachine(RuleBasedStateMachine):
    tensors, async_copies = False, False

    def __init__(self):
        super().__init__()
        self.twins = [Twin(b, self.tensors, self.async_copies) for b in ("python", "native")]
        self.now = 0.0
        self.seqs = {}        # id -> (tenant, tokens, pages, shadow)
        self.history = []
        self.chained = []     # (chain key, tenant, tokens) of admissions that kept a chain
        self.next_id = 0

    def both(self, method, *args, chain_key=None, **kwargs):
        out = []
        for t in self.twins:
            kw = dict(kwargs)
            if chain_key is not None:
                kw["hashes"] = t.chains[chain_key]
            out.append(call(t, method, *args, **kw))
        return out

    def draw_tokens(self, data):
        if self.history and data.draw(st.integers(0, 3)):
            tenant, earlier = data.draw(st.sampled_from(self.history))
            keep = data.draw(st.integers(0, len(earlier)))
            return tenant, earlier[:keep] + data.draw(st.lists(TOKENS, max_size=5))
        return data.draw(st.sampled_from(["a", "b"])), data.draw(st.lists(TOKENS, min_size=1, max_size=12))

    @precondition(lambda self: len(self.seqs) < 5)
    @rule(data=st.data(), shadow=st.booleans(), promote=st.booleans(), use_chain=st.booleans(),
          cut=st.integers(0, 3))
    def admit(self, data, shadow, promote, use_chain, cut):
        tenant, tokens = self.draw_tokens(data)
        key = None
        if use_chain:
            key = len(self.chained)
            for t in self.twins:
                t.chains[key] = t.kv.hash_chain(tokens, tenant=tenant)
            self.chained.append((key, tenant, tokens))
        peeks = self.both("peek_prefix", tokens, tenant=tenant, chain_key=key)
        assert peeks[0] == peeks[1]
        matches = self.both("match_prefix", tokens, now=self.now, tenant=tenant, shadow=shadow, promote=promote,
                            max_tokens=max(0, len(tokens) - cut), chain_key=key)
        m0, m1 = matches
        assert (m0.block_ids, m0.num_tokens, m0.device_tokens, m0.host_tokens, m0.shadow_tokens) == \
               (m1.block_ids, m1.num_tokens, m1.device_tokens, m1.host_tokens, m1.shadow_tokens)
        assert self.twins[0].event_id(m0.ready_event) == self.twins[1].event_id(m1.ready_event)
        need = -(-len(tokens) // BS) - len(m0.block_ids)
        new = self.both("allocate", need, now=self.now, shadow=shadow)
        assert new[0] == new[1]
        if new[0] is None:
            assert self.both("free", m0.block_ids, now=self.now) == [None, None]
            return
        pages = m0.block_ids + new[0]
        written = data.draw(st.integers(m0.num_tokens, len(tokens)))
        for num_tokens in (written, None):       # a partial commit, then all (the first pages are not redone)
            got = self.both("commit", pages, tokens, now=self.now, tenant=tenant, num_tokens=num_tokens,
                            chain_key=key)
            assert got[0] == got[1]
        self.seqs[self.next_id] = (tenant, tokens, pages, shadow)
        self.history.append((tenant, tokens))
        self.next_id += 1

    @precondition(lambda self: self.chained)
    @rule(data=st.data(), shadow=st.booleans(), promote=st.booleans(), grow=st.lists(TOKENS, max_size=4))
    def rematch(self, data, shadow, promote, grow):
        """A kept chain used again (as a shadow job's, chunk after chunk): its remembered pages are
        revalidated, also after evictions; its token list may have grown."""
        key, tenant, tokens = data.draw(st.sampled_from(self.chained))
        tokens += grow
        got = self.both("peek_prefix", tokens, tenant=tenant, chain_key=key)
        assert got[0] == got[1]
        m0, m1 = self.both("match_prefix", tokens, now=self.now, tenant=tenant, shadow=shadow, promote=promote,
                           chain_key=key)
        assert (m0.block_ids, m0.device_tokens, m0.host_tokens, m0.shadow_tokens) == \
               (m1.block_ids, m1.device_tokens, m1.host_tokens, m1.shadow_tokens)
        assert self.both("free", m0.block_ids, now=self.now) == [None, None]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        pages = self.seqs.pop(sid)[2]
        assert self.both("free", pages, now=self.now) == [None, None]

    @rule(n=st.integers(0, NUM_BLOCKS + 1), shadow=st.booleans(), keep=st.booleans())
    def pressure(self, n, shadow, keep):
        got = self.both("allocate", n, now=self.now, shadow=shadow)
        assert got[0] == got[1]
        if got[0] is not None and not keep:
            assert self.both("free", got[0], now=self.now) == [None, None]
        elif got[0]:
            self.seqs[self.next_id] = ("a", [], got[0], shadow)
            self.next_id += 1

    @precondition(lambda self: self.history)
    @rule(data=st.data(), shadow=st.booleans())
    def import_prefix(self, data, shadow):
        tenant, tokens = data.draw(st.sampled_from(self.history))
        got = self.both("import_prefix", tokens, now=self.now, tenant=tenant, shadow=shadow)
        assert got[0] == got[1]

    @rule(data=st.data(), shadow=st.booleans(), limit=st.one_of(st.none(), st.integers(0, NUM_BLOCKS)))
    def free_blocks(self, data, shadow, limit):
        got = self.both("free_blocks", now=self.now, shadow=shadow, limit=limit)
        assert got[0] == got[1]

    @rule(pages=st.lists(st.integers(-1, NUM_BLOCKS), max_size=4))
    def touch_and_bad_free(self, pages):
        """Touches (out-of-range pages raise) and frees of arbitrary pages (unowned ones raise, nothing changes)."""
        got = self.both("touch", pages, now=self.now)
        assert got[0] == got[1]
        owned = {b for s in self.seqs.values() for b in s[2]}
        if not set(pages) & owned:
            got = self.both("free", pages, now=self.now)
            assert got[0] == got[1] and (not pages or got[0][0] is ValueError)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.5, 3.0]))
    def advance_time(self, dt):
        self.now += dt
        assert self.both("poll", self.now) == [None, None]
        got = self.both("allocate", 1, now=self.now - 1.0)     # time going back: both refuse, nothing changes
        assert got[0] == got[1] and got[0][0] is ValueError

    @precondition(lambda self: self.async_copies)
    @rule(count=st.integers(1, 3))
    def complete_copies(self, count):
        assert len(self.twins[0].events) == len(self.twins[1].events)
        for t in self.twins:
            pending = [e for e in t.events if not e.done]
            for e in pending[:count]:
                e.done = True
        assert self.both("poll", self.now) == [None, None]

    @invariant()
    def same_state(self):
        a, b = (t.kv for t in self.twins)
        assert a.stats == b.stats
        assert a.snapshot() == b.snapshot()
        assert a.host_tier.items() == b.host_tier.items()
        assert [a.host_tier.index.is_shadow(s) for s in range(HOST_PAGES)] == \
               [b.host_tier.index.is_shadow(s) for s in range(HOST_PAGES)]
        if self.tensors:
            assert torch.equal(self.twins[0].cache, self.twins[1].cache)
            assert torch.equal(self.twins[0].host.cache, self.twins[1].host.cache)
        for k, v in a.stats.as_dict().items():
            SEEN[k] = max(SEEN[k], v)


class TensorDifferentialMachine(DifferentialMachine):
    tensors = True


class AsyncDifferentialMachine(DifferentialMachine):
    tensors, async_copies = True, True


@pytest.mark.parametrize("machine, examples, wanted", [
    (DifferentialMachine, 150, ("host_hit_tokens", "shadow_blocks_promoted", "shadow_evictions", "host_drops",
                                "allocation_failures", "shadow_blocks_wasted")),
    (TensorDifferentialMachine, 100, ("host_hit_tokens", "spills", "reloads")),
    (AsyncDifferentialMachine, 150, ("host_hit_tokens", "spills", "reloads", "spills_cancelled")),
], ids=["bookkeeping", "tensors", "async-copies"])
def test_backends_take_the_same_decisions(machine, examples, wanted):
    SEEN.clear()
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=60,
                                                         deadline=None, derandomize=True))
    missing = [k for k in wanted if not SEEN[k]]
    assert not missing, f"the random sequences never exercised {missing}"
