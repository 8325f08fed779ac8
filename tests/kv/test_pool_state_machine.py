"""Hypothesis state machine over KVCacheManager + HostTier with real (CPU) tensors.

Random sequences of admit (prefix lookup + allocate + write + commit), append, finish (free), memory
pressure (allocate, scribble, free: evictions and spills), lookups that reload from the host, bad frees and
time steps, on both KV cores (backend python and native). After every step: ref counts equal the owners, no writable page has two owners, every owned page
still holds what its owner wrote (no in-use page evicted or overwritten), pages are partitioned into
free / in use / cached / spilling, shadow pages <= cap, and every cached hash on the device or the host maps to
bytes equal to what was written for that (tenant, prefix) once the copies pending on it ran (CPU reloads are
layer-wise and run when waited on; the async variant queues every copy as CUDA would). Page contents are random per (tenant, prefix), so a
page shared across tenants, or a stale page, fails the byte checks.
"""
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.spec import KVCacheSpec

BS = 2
NUM_BLOCKS = 8
HOST_PAGES = 4
SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)
TOKENS = st.integers(0, 2)   # a tiny vocabulary: prefixes repeat, so lookups hit often


class Seq:
    def __init__(self, tenant, tokens, blocks, shadow):
        self.tenant, self.tokens, self.blocks, self.shadow = tenant, tokens, blocks, shadow
        self.partial = None  # bytes written into the partial last page


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = SPEC.allocate(NUM_BLOCKS).fill_(float("nan"))
        self.host = HostTier(HOST_PAGES, spec=SPEC, pin_memory=False)
        self.host.cache.fill_(float("nan"))
        self.pool = KVCacheManager(NUM_BLOCKS, BS, kv_cache=self.cache, host_tier=self.host, shadow_fraction=0.5,
                              cold_age_s=5.0, model_id="m")
        self.now = 0.0
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(1234)
        self.content: dict = {}      # (tenant, prefix tokens) -> the page written for it
        self.hash_owner: dict = {}   # page hash -> (tenant, prefix tokens)
        self.history: list = []      # (tenant, tokens) of sequences admitted so far

    # ---- hooks (the async variant below overrides them) ----------------------------------------------
    exact_can_allocate = True  # synchronous copies: can_allocate predicts allocate exactly

    def wait(self, event):
        """The forward pass waits on a reload before reading the pages (on CPU the layer-wise reload's
        copies run then, in order)."""
        if event is not None:
            event.wait()

    def pages_in_flight(self):
        """(device pages, host slots) a pending copy will still write: their bytes are not defined yet (on
        CPU: the pages of reloads nobody waited on yet)."""
        pages = set()
        for side in self.host._side_streams.values():
            for batch in [*side.open.values(), *side.pending]:
                if batch.copied < batch.num_layers:
                    pages |= set(batch.pages)
        return pages, set()

    # ---- helpers -----------------------------------------------------------------------------------
    def page_content(self, tenant, prefix):
        key = (tenant, tuple(prefix))
        if key not in self.content:
            self.content[key] = torch.randn(SPEC.page_shape, generator=self.gen)
        return self.content[key]

    def write_page(self, seq, index):
        """The owner writes page `index` of seq: full pages get the (tenant, prefix) content."""
        b = seq.blocks[index]
        assert self.pool.ref_count(b) == 1 and self.pool.block_hash(b) is None, "writing a shared page"
        end = (index + 1) * BS
        if end <= len(seq.tokens):
            self.cache[b] = self.page_content(seq.tenant, seq.tokens[:end])
            seq.partial = None
        else:
            seq.partial = torch.randn(SPEC.page_shape, generator=self.gen)
            self.cache[b] = seq.partial

    def commit(self, seq):
        self.pool.commit(seq.blocks, seq.tokens, now=self.now, tenant=seq.tenant)
        for i in range(len(seq.tokens) // BS):
            h = self.pool.block_hash(seq.blocks[i])
            owner = (seq.tenant, tuple(seq.tokens[:(i + 1) * BS]))
            assert self.hash_owner.setdefault(h, owner) == owner, "one hash for two (tenant, prefix)"

    # ---- rules -------------------------------------------------------------------------------------
    def draw_prompt(self, data):
        """A fresh prompt or, mostly, an earlier sequence's prefix plus new tokens (the agentic pattern)."""
        if self.history and data.draw(st.integers(0, 3)):
            tenant, earlier = data.draw(st.sampled_from(self.history))
            keep = data.draw(st.integers(1, len(earlier)))
            return tenant, earlier[:keep] + data.draw(st.lists(TOKENS, max_size=3))
        return data.draw(st.sampled_from(["a", "b"])), data.draw(st.lists(TOKENS, min_size=1, max_size=9))

    @precondition(lambda self: len(self.seqs) < 4)
    @rule(data=st.data(), shadow=st.booleans(), promote=st.booleans())
    def admit(self, data, shadow, promote):
        tenant, tokens = self.draw_prompt(data)
        pool = self.pool
        device_before, host_before = pool.peek_prefix(tokens, tenant=tenant)
        m = pool.match_prefix(tokens, now=self.now, tenant=tenant, shadow=shadow, promote=promote)
        assert m.num_tokens == len(m.block_ids) * BS == m.device_tokens + m.host_tokens
        assert m.num_tokens <= device_before + host_before and m.host_tokens <= host_before
        if host_before == 0:
            assert m.device_tokens == device_before
        self.wait(m.ready_event)
        for i, b in enumerate(m.block_ids):  # the bytes of every hit are what was written for that prefix
            assert torch.equal(self.cache[b], self.page_content(tenant, tokens[:(i + 1) * BS]))
        need = -(-len(tokens) // BS) - len(m.block_ids)
        can = pool.can_allocate(need, now=self.now, shadow=shadow)
        new = pool.allocate(need, now=self.now, shadow=shadow)
        assert (new is not None) == can if self.exact_can_allocate else (new is None or can)
        if new is None:
            pool.free(m.block_ids, now=self.now)
            return
        seq = Seq(tenant, list(tokens), m.block_ids + new, shadow)
        for i in range(len(m.block_ids), len(seq.blocks)):
            self.write_page(seq, i)
        self.commit(seq)
        self.seqs[self.next_id] = seq
        self.next_id += 1
        self.history.append((tenant, list(tokens)))

    @precondition(lambda self: self.history)
    @rule(data=st.data(), promote=st.booleans())
    def lookup(self, data, promote):
        """A prefix lookup that is dropped at once (e.g. an admission that then waits): reloads, cancels."""
        tenant, tokens = data.draw(st.sampled_from(self.history))
        m = self.pool.match_prefix(tokens, now=self.now, tenant=tenant, promote=promote)
        self.wait(m.ready_event)
        for i, b in enumerate(m.block_ids):
            assert torch.equal(self.cache[b], self.page_content(tenant, tokens[:(i + 1) * BS]))
        self.pool.free(m.block_ids, now=self.now)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def append(self, data, n):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        for _ in range(n):
            if len(seq.tokens) % BS == 0:
                new = self.pool.allocate(1, now=self.now, shadow=seq.shadow)
                if new is None:
                    return
                seq.blocks += new
            seq.tokens.append(data.draw(TOKENS))
            self.write_page(seq, len(seq.blocks) - 1)
            self.commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.pool.free(self.seqs.pop(sid).blocks, now=self.now)

    @rule(n=st.integers(1, NUM_BLOCKS), shadow=st.booleans())
    def pressure(self, n, shadow):
        """Allocate (evicting and spilling), scribble NaN over the pages, free them."""
        ids = self.pool.allocate(n, now=self.now, shadow=shadow)
        if ids is not None:
            self.cache[ids] = float("nan")
            self.pool.free(ids, now=self.now)

    @rule(data=st.data())
    def bad_release(self, data):
        unowned = [b for b in range(NUM_BLOCKS) if self.pool.ref_count(b) == 0]
        if unowned:
            b = data.draw(st.sampled_from(unowned))
            try:
                self.pool.free([b], now=self.now)
            except ValueError:
                return
            raise AssertionError("releasing an unowned page did not raise")

    @rule(dt=st.sampled_from([0.0, 1.0, 3.0, 6.0]))
    def advance_time(self, dt):
        self.now += dt
        self.pool.poll(self.now)

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def owners_and_bytes(self):
        pool = self.pool
        owners = Counter(b for s in self.seqs.values() for b in s.blocks)
        for s in self.seqs.values():
            assert len(set(s.blocks)) == len(s.blocks)
            for i, b in enumerate(s.blocks):
                end = (i + 1) * BS
                expect = self.page_content(s.tenant, s.tokens[:end]) if end <= len(s.tokens) else s.partial
                assert torch.equal(self.cache[b], expect), "an in-use page lost its bytes"
        for b in range(NUM_BLOCKS):
            assert pool.ref_count(b) == owners[b]
            if owners[b] > 1:
                assert pool.block_hash(b) is not None, "a writable page has two owners"

    @invariant()
    def partition_and_classes(self):
        pool = self.pool
        snap = pool.snapshot()
        free, spilling = snap["free"], set(snap["spilling"])
        normal_lru, shadow_lru = {b for b, _ in snap["lru"][0]}, {b for b, _ in snap["lru"][1]}
        in_use = {b for b in range(NUM_BLOCKS) if pool.ref_count(b) > 0}
        assert len(set(free)) == len(free)
        assert not spilling & in_use and all(pool.ref_count(b) == 0 for b in spilling)
        parts = [set(free), in_use, normal_lru, shadow_lru, spilling]
        assert sum(map(len, parts)) == NUM_BLOCKS and set().union(*parts) == set(range(NUM_BLOCKS))
        assert all(not pool.is_shadow(b) and pool.block_hash(b) is None for b in free)
        assert all(pool.is_shadow(b) for b in shadow_lru) and not any(pool.is_shadow(b) for b in normal_lru)
        num_shadow = sum(pool.is_shadow(b) for b in range(NUM_BLOCKS))
        assert num_shadow == pool.num_shadow_blocks <= pool.shadow_cap
        for b in normal_lru | shadow_lru:
            assert snap["index"][pool.block_hash(b)] == b
        s = pool.stats
        assert (s.free_blocks + s.normal_in_use_blocks + s.shadow_in_use_blocks + s.normal_cached_blocks
                + s.shadow_cached_blocks + s.spilling_blocks) == NUM_BLOCKS
        assert s.shadow_in_use_blocks == sum(pool.is_shadow(b) for b in in_use)
        assert s.host_normal_pages + s.host_shadow_pages == self.host.num_used <= HOST_PAGES

    @invariant()
    def cached_hashes_hold_their_bytes(self):
        pending_pages, pending_slots = self.pages_in_flight()
        for h, b in self.pool.snapshot()["index"].items():
            tenant, prefix = self.hash_owner[h]
            if b not in pending_pages:
                assert torch.equal(self.cache[b], self.page_content(tenant, prefix)), "device entry corrupted"
        for h, slot in self.host.items():
            if slot in pending_slots:
                continue
            tenant, prefix = self.hash_owner[h]
            assert torch.equal(self.host.cache[slot], self.page_content(tenant, prefix)), "host entry corrupted"


class ManualEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class AsyncPoolMachine(PoolMachine):
    """The same machine with the CUDA copy semantics, on the CPU: HostTier copies are queued on a simulated
    side stream and run (reading their source then) only when the test completes them, in order; the
    forward pass's wait on a reload event runs the queue up to that event. A page handed out, written or
    freed before the copy that reads it ran shows up as corrupted bytes on the host or the device."""
    exact_can_allocate = False

    def __init__(self):
        super().__init__()
        self.queue = []  # (event, src, dst, src ids, dst ids, device pages written, host slots written)
        host = self.host
        host.spill = lambda cache, blocks, slots: self.enqueue(cache, host.cache, blocks, slots, (), slots)
        host.reload = lambda cache, slots, blocks: self.enqueue(host.cache, cache, slots, blocks, blocks, ())

    def enqueue(self, src, dst, src_ids, dst_ids, pages, slots):
        event = ManualEvent()
        self.queue.append((event, src, dst, list(src_ids), list(dst_ids), set(pages), set(slots)))
        return event

    def run_copies(self, count):
        for event, src, dst, src_ids, dst_ids, _, _ in self.queue[:count]:
            dst[dst_ids] = src[src_ids]
            event.done = True
        del self.queue[:count]

    def wait(self, event):
        if event is not None and not event.done:
            self.run_copies(next(i for i, item in enumerate(self.queue) if item[0] is event) + 1)

    def pages_in_flight(self):
        pages, slots = set(), set()
        for item in self.queue:
            pages |= item[5]
            slots |= item[6]
        return pages, slots

    @rule(count=st.integers(1, 3))
    def complete_copies(self, count):
        self.run_copies(min(count, len(self.queue)))
        self.pool.poll(self.now)


@pytest.mark.parametrize("machine, examples", [(PoolMachine, 60), (AsyncPoolMachine, 40)], ids=["sync", "async"])
def test_pool_state_machine(kv_backend, machine, examples):
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=60,
                                                         deadline=None))
