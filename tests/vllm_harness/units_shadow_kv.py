"""ShadowKV (shadowprefill.integrations.vllm.shadow_kv) on vLLM 0.32's real KVCacheManager and block pool.

Run in the vLLM venv (make test-vllm does): .venv-vllm/bin/python -m pytest -q tests/vllm_harness/units_shadow_kv.py

The reference is vLLM's own queue walk (`FreeKVCacheBlockQueue.get_all_free_blocks`) and prefix lookup
(`KVCacheManager.get_computed_blocks`): after every operation the free queue must read uncached blocks, then
shadow entries, then normal cache entries; its length must equal vLLM's free count; lookups must find exactly
the blocks the order says survived.
"""
import random

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from shadowprefill.integrations.vllm.shadow_kv import ShadowKV

BS = 4
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


class Pool:
    """A vLLM KVCacheManager plus ShadowKV, driven the way ShadowScheduler drives them."""

    def __init__(self, num_blocks: int, cap: int, cold_age_s: float = 5.0) -> None:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
        self.m = KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                                enable_caching=True)
        self.kv = ShadowKV(self.m.block_pool, cap, cold_age_s)
        self.n = 0

    def request(self, tokens, shadow=False):
        self.n += 1
        return Request(f"r{self.n}", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=HASHER,
                       priority=1000 if shadow else 0)

    def run(self, r, shadow: bool, now: float):
        """Admit `r` with its prefix hit and compute it whole; None if it does not fit (nothing taken)."""
        computed, hit, _ = self.m.get_computed_blocks(r)
        n = r.num_tokens - hit
        if shadow:
            need = -(-(hit + n) // BS) - len(computed.blocks[0])
            if not self.kv.prepare(need, now, {b.block_id for b in computed.blocks[0]}):
                return None
        new = self.m.allocate_slots(r, n, num_new_computed_tokens=hit, new_computed_blocks=computed)
        if new is None:
            return None
        ids = [b.block_id for b in self.m.get_blocks(r.request_id).blocks[0]]
        if shadow:
            self.kv.add(new.blocks[0])
        else:
            hits = hit // BS
            self.kv.leave(ids[:hits], hit=True)
            self.kv.leave(ids[hits:], hit=False)
        r.num_computed_tokens = r.num_tokens
        return hit

    def free(self, r, shadow: bool, now: float) -> None:
        blocks = self.m.get_blocks(r.request_id).blocks[0]
        self.m.free(r)
        self.kv.note_freed(blocks, now)
        if shadow:
            self.kv.place_freed(blocks, now)

    def queue(self):
        return self.m.block_pool.free_block_queue.get_all_free_blocks()

    def check(self) -> None:
        """Free queue = uncached, then shadow entries, then normal entries; consistent counts."""
        q = self.queue()
        assert len(q) == self.m.block_pool.get_num_free_blocks()
        kinds = [0 if b.block_hash is None else (1 if b.block_id in self.kv else 2) for b in q]
        assert kinds == sorted(kinds), kinds
        assert self.kv.count() <= self.kv.cap
        for i in list(self.kv._blocks):   # every class member is held by a request or cached
            b = self.m.block_pool.blocks[i]
            assert b.ref_cnt > 0 or b.block_hash is not None


def ids_of(rng, n):
    return [rng.randrange(1, 10_000) for _ in range(n)]


def test_shadow_entries_sit_between_free_and_normal_cache():
    p, rng = Pool(32, cap=8), random.Random(0)
    normal, shadow = p.request(ids_of(rng, 3 * BS)), p.request(ids_of(rng, 2 * BS + 1), shadow=True)
    p.run(normal, False, 0.0)
    p.free(normal, False, 0.0)
    p.run(shadow, True, 1.0)
    shadow_blocks = [b.block_id for b in p.m.get_blocks(shadow.request_id).blocks[0]]
    p.free(shadow, True, 1.0)
    p.check()
    q = p.queue()
    kinds = ["U" if b.block_hash is None else ("S" if b.block_id in p.kv else "H") for b in q]
    assert kinds.count("S") == 2 and kinds.count("H") == 3
    # the shadow's chain tail is evicted first (vLLM's own rule for a request's blocks)
    s_order = [b.block_id for b in q if b.block_id in p.kv]
    assert s_order == [shadow_blocks[1], shadow_blocks[0]]
    assert p.kv.placed == 2


def test_allocation_uses_free_blocks_then_shadow_entries_before_normal_ones():
    p, rng = Pool(24, cap=8), random.Random(1)
    normal, shadow = p.request(ids_of(rng, 4 * BS + 1)), p.request(ids_of(rng, 4 * BS + 1), shadow=True)
    p.run(normal, False, 0.0)
    p.free(normal, False, 0.0)
    p.run(shadow, True, 0.0)
    p.free(shadow, True, 0.0)
    p.check()
    uncached = sum(b.block_hash is None for b in p.queue())
    filler = p.request(ids_of(rng, (uncached + 3) * BS))      # evicts exactly 3 cached blocks
    assert p.run(filler, False, 10.0) == 0
    p.check()
    assert p.kv.evicted == 3 and p.kv.count() == 1
    p.free(filler, False, 10.0)
    # vLLM's lookups: the normal prompt is whole, the shadow kept its first block only
    again_normal, again_shadow = p.request(normal.prompt_token_ids), p.request(shadow.prompt_token_ids)
    assert p.m.get_computed_blocks(again_normal)[1] == 4 * BS
    assert p.m.get_computed_blocks(again_shadow)[1] == 1 * BS


def test_stock_order_would_evict_the_normal_prefix_first():
    """The same sequence without ShadowKV (vLLM's LRU alone) loses the normal prefix: the test above is not
    satisfied by vLLM's default order."""
    p, rng = Pool(24, cap=8), random.Random(1)
    normal, shadow = p.request(ids_of(rng, 4 * BS + 1)), p.request(ids_of(rng, 4 * BS + 1), shadow=True)
    for r in (normal, shadow):
        p.run(r, False, 0.0)
        p.free(r, False, 0.0)
    uncached = sum(b.block_hash is None for b in p.queue())
    filler = p.request(ids_of(rng, (uncached + 3) * BS))
    p.run(filler, False, 10.0)
    p.free(filler, False, 10.0)
    assert p.m.get_computed_blocks(p.request(normal.prompt_token_ids))[1] == 1 * BS
    assert p.m.get_computed_blocks(p.request(shadow.prompt_token_ids))[1] == 4 * BS


def test_non_shadow_hit_promotes_and_the_block_then_ages_as_normal_cache():
    p, rng = Pool(24, cap=8), random.Random(2)
    shadow = p.request(ids_of(rng, 3 * BS + 1), shadow=True)
    p.run(shadow, True, 0.0)
    p.free(shadow, True, 0.0)
    switch = p.request(shadow.prompt_token_ids + ids_of(rng, 2))
    assert p.run(switch, False, 1.0) == 3 * BS
    assert p.kv.promoted == 3 and p.kv.count() == 0
    p.free(switch, False, 1.0)
    p.check()
    assert all(b.block_id not in p.kv for b in p.queue())


def test_cap_recycles_the_oldest_cold_shadow_entries_only():
    p, rng = Pool(64, cap=4, cold_age_s=5.0), random.Random(3)
    a = p.request(ids_of(rng, 3 * BS + 1), shadow=True)
    p.run(a, True, 0.0)
    p.free(a, True, 0.0)
    assert p.kv.count() == 3
    b = p.request(ids_of(rng, 2 * BS + 1), shadow=True)          # needs 3 blocks: one over the cap...
    assert p.run(b, True, 1.0) is None                            # ...and a's entries are warm
    assert p.kv.count() == 3 and p.kv.evicted == 0
    assert p.kv.available(8, 1.0) == 1
    assert p.run(b, True, 6.0) == 0                               # cold now: the oldest two are recycled
    p.check()
    assert p.kv.count() == 4 and p.kv.evicted == 2
    p.free(b, True, 6.0)
    # a lost its chain tail (evicted first), kept its head
    assert p.m.get_computed_blocks(p.request(a.prompt_token_ids))[1] == 1 * BS


def test_available_counts_free_and_cold_blocks_up_to_a_warm_entry():
    p, rng = Pool(12, cap=11, cold_age_s=5.0), random.Random(4)
    r = p.request(ids_of(rng, 10 * BS))                           # every usable block but one ends cached
    p.run(r, False, 0.0)
    p.free(r, False, 0.0)
    assert p.kv.available(11, 1.0) == 1                           # one uncached, then warm normal entries
    assert p.kv.available(11, 5.0) == 11
    assert p.kv.available(3, 5.0) == 3


def test_boundary_search_with_long_uncached_or_long_cached_runs():
    for cached_first in (False, True):
        p, rng = Pool(40, cap=20), random.Random(5)
        if cached_first:                                          # long H, short U
            r = p.request(ids_of(rng, 30 * BS))
            p.run(r, False, 0.0)
            p.free(r, False, 0.0)
        s = p.request(ids_of(rng, 2 * BS + 1), shadow=True)
        assert p.run(s, True, 10.0) is not None
        p.free(s, True, 10.0)
        p.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_queue_order_and_the_cap(seed):
    rng = random.Random(seed)
    p = Pool(48, cap=rng.choice((4, 8, 12)), cold_age_s=rng.choice((0.0, 2.0)))
    prompts = [ids_of(rng, rng.randrange(1, 6) * BS + rng.randrange(0, BS)) for _ in range(8)]
    live, now = [], 0.0
    for _ in range(200):
        now += rng.random()
        if live and rng.random() < 0.45:
            r, shadow = live.pop(rng.randrange(len(live)))
            p.free(r, shadow, now)
        else:
            shadow = rng.random() < 0.5
            base = rng.choice(prompts)
            r = p.request(base + ids_of(rng, rng.randrange(0, 2 * BS)), shadow=shadow)
            if p.run(r, shadow, now) is not None:
                live.append((r, shadow))
        p.check()
        assert p.kv.count() <= p.kv.cap
    for r, shadow in live:
        p.free(r, shadow, now)
    p.check()
    assert p.m.block_pool.get_num_free_blocks() == 47
