"""The pool's handling of asynchronous spill/reload copies (the CUDA path), driven on the CPU by events the
test completes by hand: HostTier copies run synchronously (a layer-wise reload is waited on at once), then
return a ManualEvent instead, which is exactly what the pool sees on CUDA (an event that is not yet complete). Checked: a spilled page is not
handed out before its event completed; allocations do not over-evict while copies are in flight; a page hit
while its spill is in flight is served from the device; a page still read by a copy is not freed early;
reloads return the event the forward must wait on. On a GPU, test_host_tier.py runs the real thing."""
import pytest
import torch

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.spec import KVCacheSpec

pytestmark = pytest.mark.usefixtures("kv_backend")   # every test on both KV cores (conftest.py)

BS = 2
SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)


class ManualEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def make_pool(num_blocks=4, host_pages=8):
    cache = SPEC.allocate(num_blocks).normal_()
    host = HostTier(host_pages, spec=SPEC, pin_memory=False)
    pool = KVCacheManager(num_blocks, BS, kv_cache=cache, host_tier=host)
    events = []
    for name in ("spill", "reload"):
        copy = getattr(host, name)

        def async_copy(*args, _copy=copy):
            batch = _copy(*args)               # the bytes move now (CPU) ...
            if batch is not None:
                batch.wait()
            events.append(ManualEvent())       # ... but the pool is told the copy is still running
            return events[-1]
        setattr(host, name, async_copy)
    return pool, cache, events


def cached(pool, tokens, now):
    ids = pool.allocate(len(tokens) // BS, now=now)
    pool.commit(ids, tokens, now=now)
    pool.free(ids, now=now)
    return ids


def test_spilled_pages_are_handed_out_only_after_their_copy():
    pool, cache, events = make_pool()
    ids = cached(pool, [1, 2, 3, 4, 5, 6, 7, 8], now=0)          # 4 cached pages, pool full
    assert pool.can_allocate(2, now=1)
    assert pool.allocate(2, now=1) is None                        # evicts 2, their spills in flight
    assert pool.num_spilling_blocks == 2 and pool.stats.normal_evictions == 2 and len(events) == 1
    assert pool.allocate(2, now=1) is None                        # waits: no further eviction
    assert pool.stats.normal_evictions == 2 and pool.num_cached_blocks == 2
    pool.poll(2)
    assert pool.num_spilling_blocks == 2                          # not complete yet
    events[0].done = True
    pool.poll(3)
    got = pool.allocate(2, now=3)
    assert sorted(got) == sorted(ids[2:]) and pool.num_spilling_blocks == 0   # tail pages evicted first
    assert pool.peek_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == (2 * BS, 2 * BS)


def test_hit_during_spill_is_served_from_the_device_and_not_freed_early():
    pool, cache, events = make_pool()
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    ids = cached(pool, toks, now=0)
    assert pool.allocate(4, now=1) is None                        # all four spilling
    m = pool.match_prefix(toks, now=2)
    assert m.block_ids == ids and m.device_tokens == 4 * BS and m.host_tokens == 0
    assert pool.stats.spills_cancelled == 4 and pool.num_spilling_blocks == 0
    assert m.ready_event is events[0]                              # the spill may still read these pages
    pool.free(m.block_ids, now=3)
    assert pool.allocate(1, now=4) is None                        # the host holds it already, but the
    assert pool.num_spilling_blocks == 1 and pool.stats.spills == 4   # copy out of it still runs: parked
    events[0].done = True
    assert pool.allocate(1, now=5) == [ids[3]]


def test_reload_returns_the_event_to_wait_on():
    pool, cache, events = make_pool()
    toks = [1, 2, 3, 4]
    ids = cached(pool, toks, now=0)
    written = cache[ids].clone()
    other = cached(pool, [9, 9, 8, 8], now=0)
    assert pool.allocate(4, now=1) is None
    events[0].done = True
    hold = pool.allocate(4, now=2)
    cache[hold] = float("nan")
    pool.free(hold, now=3)
    m = pool.match_prefix(toks, now=4)
    assert m.host_tokens == 2 * BS and m.ready_event is events[-1] and not events[-1].done
    assert torch.equal(cache[m.block_ids], written)
    again = pool.match_prefix(toks, now=4)                      # device hits on pages still being written
    assert again.device_tokens == 2 * BS and again.ready_event is events[-1]
    events[-1].done = True
    pool.poll(5)
    third = pool.match_prefix(toks, now=5)
    assert third.ready_event is None
    assert len(other) == 2


def test_a_cancelled_spill_does_not_hide_a_newer_reload():
    """The event a reader of recently copied pages waits on is the newest copy's: a spill cancelled after a
    reload carries an older event, and waiting on it would let the forward read the reloaded pages early."""
    pool, cache, events = make_pool()
    cached(pool, [1, 2, 3, 4], now=0)
    assert pool.allocate(4, now=1) is None                        # spills C's two pages
    events[0].done = True
    pool.poll(1)
    pool.free(pool.allocate(4, now=1), now=1)                     # C on the host, four free pages
    cached(pool, [5, 6, 7, 8], now=2)
    assert pool.allocate(4, now=3) is None                        # V's spill in flight (events[1])
    m = pool.match_prefix([1, 2, 3, 4], now=4)                    # C reloaded (events[2], newer)
    assert m.host_tokens == 2 * BS and m.ready_event is events[2]
    v = pool.match_prefix([5, 6, 7, 8], now=5)                    # V's spill cancelled: its older event
    assert v.device_tokens == 2 * BS and pool.stats.spills_cancelled == 2
    again = pool.match_prefix([1, 2, 3, 4], now=6)                # C's pages: their reload may still run
    assert again.device_tokens == 2 * BS and again.ready_event is events[2]
