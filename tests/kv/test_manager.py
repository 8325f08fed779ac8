"""KVCacheManager on hand-built scenarios (bookkeeping-only mode): allocation, ref counts, prefix cache, the
shadow-class rules of paper §3.3 (cap, cold age, evict-first, LRU within class, promotion), tenant and model
isolation, the host tier's decisions and the accounting. Bytes are tested in test_host_tier.py and the
state machine."""
import pytest

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.page_hash import page_hashes, pool_salt

pytestmark = pytest.mark.usefixtures("kv_backend")   # every test on both KV cores (conftest.py)

BS = 4


def pool_hashes(toks, model_id="", tenant=""):
    """The page hashes a pool of `model_id` registers for a sequence of `tenant`."""
    return page_hashes(toks, BS, pool_salt(model_id, tenant))


def tokens(start, n_pages, extra=0):
    return list(range(start, start + n_pages * BS + extra))


def cached_sequence(pool, toks, *, now, shadow=False, tenant=""):
    """Allocate pages for toks, register the full ones, release: they stay cached (ref 0)."""
    ids = pool.allocate(-(-len(toks) // BS), now=now, shadow=shadow)
    assert ids is not None
    pool.commit(ids, toks, now=now, tenant=tenant)
    pool.free(ids, now=now)
    return ids


def test_allocate_is_all_or_nothing():
    pool = KVCacheManager(8, BS)
    assert pool.allocate(9, now=0) is None
    assert pool.num_free_blocks == 8 and pool.stats.allocation_failures == 1
    ids = pool.allocate(8, now=0)
    assert sorted(ids) == list(range(8)) and all(pool.ref_count(b) == 1 for b in ids)
    assert pool.allocate(1, now=0) is None and not pool.can_allocate(1, now=0)
    assert pool.allocate(0, now=0) == []


def test_release_rejects_unowned_and_double_free_and_changes_nothing():
    pool = KVCacheManager(8, BS)
    ids = pool.allocate(3, now=0)
    with pytest.raises(ValueError, match="block_ids"):
        pool.free([ids[0], 7], now=0)          # 7 was never allocated
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1]
    with pytest.raises(ValueError, match="block_ids"):
        pool.free([ids[0], ids[0]], now=0)     # the same page twice with one reference
    assert pool.ref_count(ids[0]) == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.free([-1], now=0)
    pool.free(ids, now=0)
    assert pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1], now=0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="shadow_fraction"):
        KVCacheManager(8, BS, shadow_fraction=1.5)
    with pytest.raises(TypeError, match="num_blocks"):
        KVCacheManager(8.0, BS)
    with pytest.raises(ValueError, match="kv_cache"):
        import torch
        KVCacheManager(8, BS, kv_cache=torch.zeros(8, 1, 2, 1, BS + 1, 2))
    pool = KVCacheManager(8, BS)
    with pytest.raises(ValueError, match="n"):
        pool.allocate(-1, now=0)
    pool.allocate(1, now=5)
    with pytest.raises(ValueError, match="now"):
        pool.allocate(1, now=4)
    with pytest.raises(TypeError, match="token_ids"):
        pool.match_prefix("abc", now=5)


def test_commit_registers_full_pages_only_and_is_idempotent():
    pool = KVCacheManager(8, BS)
    toks = tokens(0, 2, extra=3)                  # 2 full pages + a partial one
    ids = pool.allocate(3, now=0)
    assert pool.commit(ids, toks, now=0) == 2
    assert pool.commit(ids, toks, now=0) == 0
    assert pool.block_hash(ids[2]) is None
    assert [pool.block_hash(b) for b in ids[:2]] == pool_hashes(toks)
    pool.free(ids, now=1)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2   # the partial page went back to free
    m = pool.match_prefix(toks, now=2)
    assert m.block_ids == ids[:2] and m.num_tokens == 2 * BS and m.device_tokens == 2 * BS
    assert pool.num_cached_blocks == 0 and all(pool.ref_count(b) == 1 for b in ids[:2])


def test_shared_prefix_pages_are_read_only_and_counted():
    pool = KVCacheManager(16, BS)
    toks = tokens(0, 3)
    a = pool.allocate(3, now=0)
    pool.commit(a, toks, now=0)
    m = pool.match_prefix(toks + [99], now=1)   # a second sequence, same prompt: shares the 3 pages
    assert m.block_ids == a and all(pool.ref_count(b) == 2 for b in a)
    pool.free(a, now=2)
    assert all(pool.ref_count(b) == 1 for b in a) and pool.num_cached_blocks == 0
    m2 = pool.match_prefix(toks, now=3, max_tokens=3 * BS - 1)   # max_tokens rounds down to full pages
    assert m2.block_ids == a[:2]
    assert pool.stats.miss_tokens == 1 + (3 * BS - 1 - 2 * BS)


def test_duplicate_content_stays_private():
    pool = KVCacheManager(8, BS)
    toks = tokens(0, 1)
    a, b = pool.allocate(1, now=0), pool.allocate(1, now=0)   # two requests computed the same page
    assert pool.commit(a, toks, now=0) == 1 and pool.commit(b, toks, now=0) == 0
    pool.free(b, now=1)
    assert pool.num_free_blocks == 7          # the duplicate is not a cache entry: freed
    pool.free(a, now=1)
    assert pool.num_cached_blocks == 1


def test_tenant_isolation():
    pool = KVCacheManager(16, BS)
    toks = tokens(0, 2)
    ids = cached_sequence(pool, toks, now=0, tenant="alice")
    m = pool.match_prefix(toks, now=1, tenant="bob")
    assert m.block_ids == [] and m.num_tokens == 0
    assert pool.peek_prefix(toks, tenant="bob") == (0, 0)
    assert pool.match_prefix(toks, now=1, tenant="alice").block_ids == ids[:2]
    assert pool_hashes(toks, tenant="alice") != pool_hashes(toks, tenant="bob")


def test_model_isolation_through_a_shared_host_tier():
    host = HostTier(8, page_bytes=64)
    pa = KVCacheManager(4, BS, host_tier=host, page_bytes=64, model_id="llama-3-8b")
    pb = KVCacheManager(4, BS, host_tier=host, page_bytes=64, model_id="qwen-2.5-7b")
    toks = tokens(0, 2)
    cached_sequence(pa, toks, now=0)
    assert pa.allocate(4, now=1) is not None      # evicts pa's pages into the shared host tier
    assert host.num_used == 2
    assert pb.match_prefix(toks, now=2).num_tokens == 0
    assert pool_hashes(toks, model_id="llama-3-8b") != pool_hashes(toks, model_id="qwen-2.5-7b")


def test_eviction_takes_shadow_before_normal_even_if_newer():
    pool = KVCacheManager(8, BS, shadow_fraction=0.5)
    normal = cached_sequence(pool, tokens(0, 2), now=0)
    shadow = cached_sequence(pool, tokens(100, 2), now=10, shadow=True)   # more recently used
    pool.allocate(4, now=11)                      # takes the 4 remaining free pages, no eviction
    got = pool.allocate(2, now=11)
    assert sorted(got) == sorted(shadow)
    assert pool.peek_prefix(tokens(0, 2)) == (2 * BS, 0) and pool.peek_prefix(tokens(100, 2)) == (0, 0)
    assert pool.stats.shadow_evictions == 2 and pool.stats.normal_evictions == 0
    assert pool.stats.shadow_blocks_wasted == 2   # evicted without a routed hit, no host tier


def test_lru_within_class_and_touch():
    pool = KVCacheManager(6, BS)
    first = cached_sequence(pool, tokens(0, 2), now=1)
    second = cached_sequence(pool, tokens(100, 2), now=2)
    pool.allocate(2, now=3)
    pool.touch(first, now=4)                      # first is now the most recently used
    got = pool.allocate(2, now=5)
    assert sorted(got) == sorted(second)
    # within one released sequence the tail page is older than the head page: evicted first
    pool2 = KVCacheManager(3, BS)
    ids = cached_sequence(pool2, tokens(0, 3), now=0)
    assert pool2.allocate(1, now=1) == [ids[2]]
    assert pool2.peek_prefix(tokens(0, 3)) == (2 * BS, 0)


def test_shadow_allocation_cold_age_rule():
    pool = KVCacheManager(8, BS, shadow_fraction=0.5, cold_age_s=5.0)
    held = pool.allocate(4, now=0)                # in use: never taken
    cached_sequence(pool, tokens(0, 4), now=0)    # 4 normal entries, last used at t=0
    assert pool.num_free_blocks == 0
    assert not pool.can_allocate(1, now=4.0, shadow=True) and pool.allocate(1, now=4.0, shadow=True) is None
    assert pool.free_blocks(now=5.0, shadow=True) == 0   # idle exactly 5 s is not "more than 5 s"
    assert pool.can_allocate(4, now=5.5, shadow=True) and not pool.can_allocate(5, now=5.5, shadow=True)
    got = pool.allocate(4, now=5.5, shadow=True)
    assert got is not None and not set(got) & set(held)
    assert all(pool.is_shadow(b) for b in got) and pool.num_shadow_blocks == 4
    # a normal allocation may evict any entry, however fresh
    pool.free(got, now=6)
    assert pool.allocate(4, now=6) is not None


def test_shadow_cap_and_promotion():
    pool = KVCacheManager(16, BS, shadow_fraction=0.25)   # cap 4
    assert pool.shadow_cap == 4
    assert pool.allocate(5, now=0, shadow=True) is None
    job = pool.allocate(4, now=0, shadow=True)
    assert pool.allocate(1, now=0, shadow=True) is None and pool.num_free_blocks == 12
    toks = tokens(0, 4)
    pool.commit(job, toks, now=0)
    pool.free(job, now=1)
    # a shadow job's own lookup does not promote
    m = pool.match_prefix(toks, now=2, shadow=True)
    assert m.shadow_tokens == 4 * BS and pool.num_shadow_blocks == 4
    pool.free(m.block_ids, now=2)
    # a routed request hits the shadow pages: they become normal and the cap frees up
    m = pool.match_prefix(toks, now=3, promote=True, max_tokens=2 * BS)
    assert m.shadow_tokens == 2 * BS and not any(pool.is_shadow(b) for b in m.block_ids)
    assert pool.num_shadow_blocks == 2 and pool.stats.shadow_blocks_promoted == 2
    assert pool.stats.shadow_tokens_used == 2 * BS
    assert pool.allocate(2, now=3, shadow=True) is not None


def test_shadow_cap_recycles_cold_shadow_entries_first():
    pool = KVCacheManager(16, BS, shadow_fraction=0.25, cold_age_s=5.0)
    old = cached_sequence(pool, tokens(0, 4), now=0, shadow=True)        # at the cap, all cached
    assert pool.allocate(1, now=1, shadow=True) is None                  # entries not cold yet
    got = pool.allocate(2, now=6, shadow=True)                            # cold: recycled despite free pages
    assert set(got) <= set(old) and pool.num_shadow_blocks == 4
    assert pool.num_free_blocks == 12


def test_host_tier_spill_reload_and_drop_accounting():
    page_bytes = 1000
    host = HostTier(3, page_bytes=page_bytes)
    pool = KVCacheManager(4, BS, host_tier=host, page_bytes=page_bytes)
    toks = tokens(0, 4)
    cached_sequence(pool, toks, now=0)
    hold = pool.allocate(4, now=1)                # evicts all 4; the host keeps the 3 most recent (head)
    st = pool.stats
    assert st.normal_evictions == 4 and st.spills == 3 and st.host_drops == 1
    assert st.spill_bytes == 3 * page_bytes and host.num_used == 3
    assert pool.peek_prefix(toks) == (0, 3 * BS)
    pool.free(hold[:2], now=2)                 # 2 free pages: the reload stops after 2
    m = pool.match_prefix(toks, now=3)
    assert m.host_tokens == 2 * BS and m.device_tokens == 0 and len(m.block_ids) == 2
    assert pool.stats.reloads == 2 and pool.stats.reload_bytes == 2 * page_bytes
    pool.free(m.block_ids + hold[2:], now=4)
    m = pool.match_prefix(toks, now=5)          # head pages on the device, the third from the host
    assert (m.device_tokens, m.host_tokens) == (2 * BS, BS)
    assert [pool.block_hash(b) for b in m.block_ids] == pool_hashes(toks)[:3]


def test_shadow_waste_counts_only_content_lost_everywhere():
    host = HostTier(2, page_bytes=8)
    pool = KVCacheManager(4, BS, host_tier=host, page_bytes=8, shadow_fraction=1.0)
    toks = tokens(0, 2)
    cached_sequence(pool, toks, now=0, shadow=True)
    hold = pool.allocate(4, now=1)                # both shadow pages spilled, nothing lost yet
    assert pool.stats.shadow_blocks_wasted == 0 and host.num_shadow == 2
    pool.free(hold, now=2)
    m = pool.match_prefix(toks, now=3, promote=True)   # routed hit from the host: used
    assert m.shadow_tokens == 2 * BS and pool.stats.shadow_blocks_promoted == 2 and host.num_shadow == 0
    pool.free(m.block_ids, now=4)
    cached_sequence(pool, tokens(100, 2), now=5, shadow=True)   # 2 new shadow entries, never hit
    pool.allocate(4, now=6)                       # evicts shadow then normal entries into the 2-page host:
    st = pool.stats                               # the normal ones (spilled last) push the shadow ones out
    assert st.shadow_evictions == 4 and st.normal_evictions == 2 and st.host_drops == 4
    assert st.shadow_blocks_wasted == 2 and host.num_shadow == 0
    assert pool.peek_prefix(toks) == (0, 2 * BS) and pool.peek_prefix(tokens(100, 2)) == (0, 0)


def test_peek_prefix_changes_nothing():
    pool = KVCacheManager(8, BS)
    toks = tokens(0, 2)
    cached_sequence(pool, toks, now=0)
    before = pool.stats.as_dict()
    assert pool.peek_prefix(toks + [1, 2]) == (2 * BS, 0)
    assert pool.stats.as_dict() == before and pool.num_cached_blocks == 2


class Req:
    """The request shape the request-level calls read (engine.Request has these attributes)."""

    def __init__(self, rid, toks, tenant=""):
        self.request_id, self.tenant, self._toks, self.num_computed_tokens = rid, tenant, toks, 0

    def token_ids_upto(self, n):
        assert n <= len(self._toks)
        return self._toks


def test_request_shaped_calls_keep_the_request_pages():
    pool = KVCacheManager(16, BS)
    toks = tokens(100, 6, extra=2)                       # 6 full pages + 2 tokens
    cached_sequence(pool, toks[:3 * BS], now=0.0)        # the first 3 pages are cached
    r = Req("a", toks)
    m = pool.get_computed_blocks(r, now=1.0, max_tokens=len(toks) - 1)
    assert m.num_tokens == 3 * BS and pool.block_table(r) == m.block_ids
    with pytest.raises(ValueError, match="already holds pages"):
        pool.get_computed_blocks(r, now=1.0, max_tokens=4)
    new = pool.allocate_slots(r, 5, now=1.0, num_computed_tokens=3 * BS)   # 17 tokens -> 5 pages
    assert len(new) == 2 and pool.block_table(r) == m.block_ids[:3] + new
    r.num_computed_tokens = 3 * BS + 5
    assert pool.allocate_slots(r, 3, now=1.0) == []      # 20 tokens still fit in 5 pages
    assert len(pool.allocate_slots(r, 4, now=1.0)) == 1  # 21 tokens: a 6th page
    table = list(pool.block_table(r))
    assert all(pool.ref_count(b) == 1 for b in table)
    r.num_computed_tokens = 5 * BS + 1
    assert pool.cache(r, now=2.0) == 2                   # pages 4 and 5 become cache entries (1-3 already were)
    assert [pool.block_hash(b) for b in table[:5]] == pool_hashes(toks)[:5]
    assert pool.block_hash(table[5]) is None             # the partial page is not registered
    pool.free(r, now=3.0)
    assert pool.block_table(r) == [] and all(pool.ref_count(b) == 0 for b in table)
    assert pool.peek_prefix(toks) == (5 * BS, 0)         # its full pages stay cached
    pool.free(r, now=3.0)                                # a request without pages: nothing to do
    assert pool.num_free_blocks == 16 - 5


def test_allocate_slots_is_all_or_nothing():
    pool = KVCacheManager(4, BS)
    r = Req("a", tokens(0, 8))
    assert pool.allocate_slots(r, 5 * BS, now=0.0) is None
    assert pool.block_table(r) == [] and pool.num_free_blocks == 4
    assert len(pool.allocate_slots(r, 4 * BS, now=0.0)) == 4


@pytest.mark.parametrize("seed", range(4))
def test_batched_calls_equal_the_calls_one_by_one(seed):
    """allocate_many / commit_many (one core call per iteration) against allocate / commit one call at a
    time on a twin pool: the same pages, registrations, failures and accounting, page by page, on a small
    host-tiered pool that runs full (evictions, spills, drops, an allocation that fails part-way)."""
    import random
    rng = random.Random(seed)

    def make():
        return KVCacheManager(24, BS, host_tier=HostTier(capacity_bytes=8 * 64, page_bytes=64), page_bytes=64)
    batched, single = make(), make()
    held = []                                            # (pages, tokens) of the sequences alive
    now = 0.0
    for _ in range(60):
        now += 0.5
        counts = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 6))]
        got = batched.allocate_many(counts, now=now)
        want = []
        for n in counts:                                 # the definition: in order, up to the first refusal
            pages = single.allocate(n, now=now)
            if pages is None:
                break
            want.append(pages)
        assert got == want
        for pages in got:
            toks = [rng.randrange(4) for _ in range(len(pages) * BS)]   # few values: shared content
            held.append((pages, toks))
        items = [(pages, toks, rng.choice(["", "t"]), rng.choice([None, rng.randrange(len(toks) + 1)]), None)
                 for pages, toks in held]
        assert batched.commit_many(items, now=now) == sum(
            single.commit(p, t, now=now, tenant=ten, num_tokens=n) for p, t, ten, n, _ in items)
        rng.shuffle(held)
        done = rng.randrange(len(held) // 2 + 1)         # some sequences finish
        for pages, _ in held[:done]:
            batched.free(pages, now=now)
            single.free(pages, now=now)
        held = held[done:]
        assert batched.snapshot() == single.snapshot()
        assert batched.stats.as_dict() == single.stats.as_dict()
    st = batched.stats
    assert st.allocation_failures > 0 and st.normal_evictions > 0 and st.host_drops > 0


def test_batched_calls_reject_bad_input_and_change_nothing():
    pool = KVCacheManager(8, BS)
    ids = pool.allocate(2, now=0)
    before, stats = pool.snapshot(), pool.stats.as_dict()
    for counts, error in (([1, -1], ValueError), ([1, True], TypeError), ([1, 2.0], TypeError), (5, TypeError)):
        with pytest.raises(error, match="counts"):
            pool.allocate_many(counts, now=1)
        assert pool.snapshot() == before and pool.stats.as_dict() == stats   # validated before taking any
    toks = tokens(0, 2)
    for items, match in (([(ids, toks, "", None)], "items"), ([[ids, toks, "", None, None]], "items"),
                         (7, "items"), ([(ids, "abcdefgh", "", None, None)], "token_ids")):
        with pytest.raises(TypeError, match=match):
            pool.commit_many(items, now=1)
        assert pool.snapshot() == before
    assert pool.allocate_many([], now=1) == [] and pool.commit_many([], now=1) == 0
    with pytest.raises(ValueError, match="num_new_tokens"):
        pool.allocate_slots_many([Req("a", toks)], -1, now=1)


def test_request_batched_calls_equal_the_request_calls():
    """allocate_slots_many / cache_many against allocate_slots / cache per request, on twin pools."""
    batched, single = KVCacheManager(12, BS), KVCacheManager(12, BS)
    reqs = {pool: [Req(f"r{i}", tokens(10 * i, 3)) for i in range(4)] for pool in (batched, single)}
    for step, n in enumerate((5, 4, 4)):                 # the last step cannot serve every request
        served = batched.allocate_slots_many(reqs[batched], n, now=step)
        want = 0
        for r in reqs[single]:
            if single.allocate_slots(r, n, now=step) is None:
                break
            want += 1
        assert served == want
        for pool in (batched, single):
            for r in reqs[pool][:served]:
                r.num_computed_tokens += n
        assert batched.cache_many(reqs[batched][:served], now=step) == sum(
            single.cache(r, now=step) for r in reqs[single][:served])
        assert [batched.block_table(r) for r in reqs[batched]] == [single.block_table(r) for r in reqs[single]]
        assert batched.snapshot() == single.snapshot()
    assert served < len(reqs[batched]) and batched.stats.allocation_failures == 1
