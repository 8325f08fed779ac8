"""HostTier: sizing, LRU, allocation failure, and real bytes: a byte-exact device -> host -> device round trip
through the pool, and paged_attention output identical before a spill and after the reload (CPU tensors;
on a CUDA machine the same tests run with the device cache on the GPU and async copies)."""
import pytest
import torch

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.host_tier import DEFAULT_CAPACITY_BYTES, HostTier
from shadowprefill.kv.spec import KVCacheSpec
from shadowprefill.ops import paged_attention, reference

pytestmark = pytest.mark.usefixtures("kv_backend")   # every test on both KV cores (conftest.py)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_sizing():
    assert HostTier(page_bytes=2 * 2**20).num_pages == DEFAULT_CAPACITY_BYTES // (2 * 2**20)
    assert HostTier(capacity_bytes=10_000, page_bytes=3_000).num_pages == 3
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16)
    tier = HostTier(capacity_bytes=5 * spec.page_bytes, spec=spec, pin_memory=False)
    assert tier.num_pages == 5 and tuple(tier.cache.shape) == spec.shape(5)
    with pytest.raises(ValueError, match="page_bytes"):
        HostTier()
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(4, capacity_bytes=100, page_bytes=10)
    with pytest.raises(ValueError, match="num_pages"):
        HostTier(-1)


def test_allocation_failure_names_the_size():
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)          # a Llama-3-8B page: 2 MiB
    num_pages = 2**50 // spec.page_bytes                         # 1 PiB
    with pytest.raises(MemoryError, match=str(num_pages * spec.page_bytes)):
        HostTier(capacity_bytes=2**50, spec=spec, pin_memory=False)


def test_lru_put_get_drop():
    tier = HostTier(2)
    s1, copy, dropped = tier.put(1, shadow=True)
    assert copy and dropped == [] and tier.num_shadow == 1
    tier.put(2, shadow=False)
    assert tier.get(1) == s1 and tier.peek(5) == -1             # 1 becomes the most recently used
    s3, copy, dropped = tier.put(3, shadow=False)
    assert copy and dropped == [(2, False)] and s3 != s1
    assert 2 not in tier and 1 in tier and tier.num_used == 2
    assert tier.put(1, shadow=False) == (s1, False, [])   # already held: no copy, class updated
    assert tier.num_shadow == 0 and [h for h, _ in tier.items()] == [3, 1]
    s4, copy, dropped = tier.put(4, shadow=True)               # the LRU entry (3) is dropped for it
    assert dropped == [(3, False)] and [h for h, _ in tier.items()] == [1, 4] and tier.num_shadow == 1
    # more pages than the tier holds: the earliest admitted ones are dropped again by the later ones
    slots, copy, dropped = tier.put_many([5, 6, 7], [False, True, False])
    assert copy == [False, True, True] and [h for h, _ in dropped] == [1, 4, 5] and [h for h, _ in tier.items()] == [6, 7]
    assert tier.num_shadow == 1
    assert HostTier(0).put(1, shadow=False) == (-1, False, [])


def test_pool_and_tier_must_match():
    spec = KVCacheSpec(1, 1, 4, 4, torch.float32)
    cache = spec.allocate(4)
    with pytest.raises(ValueError, match="host_tier"):
        KVCacheManager(4, 4, kv_cache=cache, host_tier=HostTier(4, page_bytes=spec.page_bytes))
    other = KVCacheSpec(1, 1, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="host_tier"):
        KVCacheManager(4, 4, kv_cache=cache, host_tier=HostTier(4, spec=other, pin_memory=False))


def test_page_dropped_and_readmitted_in_one_eviction_batch_keeps_its_bytes():
    """Regression (found by the state machine): one eviction batch drops a host entry and later admits the
    same content again from its device copy; the bytes must be copied again."""
    spec = KVCacheSpec(1, 1, 2, 2, torch.float32)
    cache = spec.allocate(8).normal_()
    host = HostTier(4, spec=spec, pin_memory=False)
    host.cache.fill_(float("nan"))
    pool = KVCacheManager(8, 2, kv_cache=cache, host_tier=host)
    ids = pool.allocate(4, now=0)
    pool.commit(ids, [0] * 8, now=0)
    pool.free(ids, now=0)
    expect = {pool.block_hash(b): cache[b].clone() for b in ids}
    hold = pool.allocate(7, now=1)                 # evicts pages 3, 2, 1 into the host
    cache[hold] = float("nan")
    pool.free(hold, now=1)
    m = pool.match_prefix([0] * 12, now=2)       # page 0 on the device, 1..3 reloaded (host keeps copies)
    more = pool.allocate(2, now=2)
    pool.commit(m.block_ids + more, [0] * 12, now=2)
    pool.free(m.block_ids + more, now=2)
    hashes = [pool.block_hash(b) for b in ids]
    assert [h for h, _ in host.items()] == hashes[1:]
    hold = pool.allocate(7, now=3)                 # victims 5, 4, 3, 2, 1: page 4 drops page 1's entry, pages 3
    cache[hold] = float("nan")                     # and 2 are held, page 1 is admitted again (dropping page 5)
    assert [h for h, _ in host.items()][1:] == [hashes[3], hashes[2], hashes[1]]
    assert pool.stats.spills == 3 + 2 and pool.peek_prefix([0] * 8) == (2, 6)
    for h, slot in host.items():
        if h in expect:
            assert torch.equal(host.cache[slot], expect[h])


def _random_bits(shape, dtype):
    """Random bit patterns of dtype (NaN/Inf patterns included): compared as raw bytes."""
    if dtype.itemsize == 2:
        return torch.randint(-2**15, 2**15, shape, dtype=torch.int16).view(dtype)
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32).view(dtype)


def _allocate_evicting(pool, n, now):
    """allocate(n); with async CUDA spills the first call only starts them: wait, poll, retry."""
    ids = pool.allocate(n, now=now)
    if ids is None and pool.num_spilling_blocks:
        torch.cuda.synchronize()
        pool.poll(now)
        ids = pool.allocate(n, now=now)
    assert ids is not None
    return ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_device_host_device_is_byte_exact(device, dtype):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    num_blocks, n_pages = 10, 6
    cache = spec.allocate(num_blocks, device)
    pool = KVCacheManager(num_blocks, 4, kv_cache=cache, host_tier=HostTier(8, spec=spec), model_id="m")
    toks = torch.randint(0, 1000, (n_pages * 4,)).tolist()
    ids = pool.allocate(n_pages, now=0)
    written = _random_bits(spec.shape(n_pages), dtype)
    cache[ids] = written.to(device)
    pool.commit(ids, toks, now=0)
    pool.free(ids, now=0)
    hold = _allocate_evicting(pool, num_blocks, now=1)           # evicts (spills) all six pages
    assert pool.stats.spills == n_pages
    cache[hold] = torch.full(spec.shape(num_blocks), float("nan"), dtype=dtype, device=device)  # poison
    pool.free(hold, now=2)
    pool.allocate(3, now=2)                                      # reloads land in other pages than before
    m = pool.match_prefix(toks, now=3)
    assert m.host_tokens == n_pages * 4 and pool.stats.reloads == n_pages and set(m.block_ids) != set(ids)
    m.ready_event.wait()                                         # the layer-wise reload: every layer
    got = cache[m.block_ids].cpu()
    assert torch.equal(got.view(torch.uint8), written.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_identical_before_spill_and_after_reload(device):
    bs, n_pages, layer = 4, 5, 1
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=bs, dtype=torch.float32)
    cache = spec.allocate(12, device)
    cache.fill_(float("nan"))
    pool = KVCacheManager(12, bs, kv_cache=cache, host_tier=HostTier(12, spec=spec))
    seq_len = n_pages * bs - 2                                   # partial last page
    toks = torch.randint(0, 1000, (seq_len,)).tolist()
    ids = pool.allocate(n_pages, now=0)
    cache[ids] = torch.randn(spec.shape(n_pages), device=device)
    cache[ids[-1], :, :, :, bs - 2:] = float("nan")              # unwritten tail of the last page
    q = torch.randn(3, 4, 16, device=device)                     # the last 3 tokens, GQA 4:2

    def attend(block_ids):
        out = torch.full_like(q, float("nan"))
        return paged_attention(q, cache, layer, torch.tensor([block_ids], dtype=torch.int32, device=device),
                               torch.tensor([0, 3], dtype=torch.int32, device=device),
                               torch.tensor([seq_len], dtype=torch.int32, device=device), 0.25, out=out)

    before = attend(ids)
    k = cache[ids, layer, 0].permute(0, 2, 1, 3).reshape(-1, 2, 16)[:seq_len]
    v = cache[ids, layer, 1].permute(0, 2, 1, 3).reshape(-1, 2, 16)[:seq_len]
    torch.testing.assert_close(before.double().cpu(), reference.dense_attention(q.cpu(), k.cpu(), v.cpu(), 0.25),
                               rtol=1e-5, atol=1e-5)
    tail = cache[ids[-1]].clone()
    pool.commit(ids, toks, now=0)                                # registers the 4 full pages
    pool.free(ids[:-1], now=0)
    hold = _allocate_evicting(pool, pool.num_free_blocks + pool.num_cached_blocks, now=1)  # spill the 4 pages
    cache[hold] = float("nan")
    pool.free(hold, now=2)
    m = pool.match_prefix(toks, now=3)
    assert m.host_tokens == 4 * bs                              # the bytes come back from the host
    m.ready_event.wait()                                         # the layer-wise reload: every layer
    after = attend(m.block_ids + [ids[-1]])
    assert torch.equal(cache[ids[-1]].cpu().view(torch.int32), tail.cpu().view(torch.int32))
    assert not after.isnan().any()
    assert torch.equal(after, before)

