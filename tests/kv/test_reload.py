"""Layer-wise reload (kv/reload.py) on CPU caches, where the side stream runs in order, on demand: one batch
per cache collects an iteration's reloads; wait(l) brings exactly layers 0..l of every page (earlier batches
first), query() all of them; a spill issues every open batch and first finishes the pending reloads that
read a host slot it writes (the tier dropped and reused it). Checked byte-exactly against the pages' original contents, with the
device pages poisoned (NaN) in between so that a copy that did not happen shows."""
import pytest
import torch

from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.reload import ReloadBatch, record_reloads
from shadowprefill.kv.spec import KVCacheSpec

pytestmark = pytest.mark.usefixtures("kv_backend")   # every test on both KV cores (conftest.py)

BS = 2
LAYERS = 3
SPEC = KVCacheSpec(num_layers=LAYERS, num_kv_heads=2, head_dim=4, block_size=BS, dtype=torch.float32)


def spilled(num_blocks=8, host_pages=16, seqs=((1, 2, 3, 4),)):
    """A pool whose sequences' pages (random bytes) were spilled to the host; device pages poisoned."""
    cache = SPEC.allocate(num_blocks).normal_(generator=torch.Generator().manual_seed(0))
    host = HostTier(host_pages, spec=SPEC, pin_memory=False)
    pool = KVCacheManager(num_blocks, BS, kv_cache=cache, host_tier=host)
    written = []
    for toks in seqs:
        ids = pool.allocate(len(toks) // BS, now=0)
        written.append(cache[ids].clone())
        pool.commit(ids, list(toks), now=0)
        pool.free(ids, now=0)
    hold = pool.allocate(num_blocks, now=1)                  # evicts (spills) every cached page
    assert hold is not None and pool.stats.spills == sum(len(t) // BS for t in seqs)
    cache[hold] = float("nan")
    pool.free(hold, now=1)
    return pool, cache, written


def test_wait_brings_exactly_the_layers_up_to_l_in_order():
    pool, cache, (written,) = spilled()
    with record_reloads() as log:
        m = pool.match_prefix([1, 2, 3, 4], now=2)
        batch = m.ready_event
        assert isinstance(batch, ReloadBatch) and m.host_tokens == 4 and batch.pages == m.block_ids
        assert cache[m.block_ids].isnan().all()             # nothing copied before anyone waits
        pool.start_reloads()
        for layer in range(LAYERS):
            batch.wait(layer)
            got = cache[m.block_ids]
            assert torch.equal(got[:, :layer + 1], written[:, :layer + 1])
            assert got[:, layer + 1:].isnan().all()          # later layers: not yet
        assert batch.query()
    b = batch.id
    assert log == [("issue", b, None)] + [e for layer in range(LAYERS)
                                          for e in (("copy", b, layer), ("wait", b, layer))]


def test_an_iterations_reloads_share_one_batch_and_batches_run_in_issue_order():
    pool, cache, (first, second) = spilled(seqs=((1, 2, 3, 4), (5, 6, 7, 8)))
    m1 = pool.match_prefix([1, 2, 3, 4], now=2)
    m2 = pool.match_prefix([5, 6, 7, 8], now=2)
    assert m1.ready_event is m2.ready_event                  # one open batch, one event per layer for both
    pool.free(m1.block_ids + m2.block_ids, now=2)
    pool, cache, (first, second) = spilled(seqs=((1, 2, 3, 4), (5, 6, 7, 8)))
    with record_reloads() as log:
        m1 = pool.match_prefix([1, 2, 3, 4], now=2)
        pool.start_reloads()                                 # issued: the next match opens a new batch
        m2 = pool.match_prefix([5, 6, 7, 8], now=2)
        pool.start_reloads()
        assert m1.ready_event is not m2.ready_event
        m2.ready_event.wait(0)                               # the earlier batch completes first
    assert torch.equal(cache[m1.block_ids], first)
    assert torch.equal(cache[m2.block_ids][:, :1], second[:, :1]) and cache[m2.block_ids][:, 1:].isnan().all()
    a, b = m1.ready_event.id, m2.ready_event.id
    assert [e for e in log if e[0] == "copy"] == [("copy", a, 0), ("copy", a, 1), ("copy", a, 2), ("copy", b, 0)]


def test_a_spill_runs_after_the_reloads_reading_its_slots():
    """A reload still to run reads host slots; a later spill may write those slots (the tier dropped and
    reused them): the spill first issues and finishes the reload, as one side stream would order them."""
    pool, cache, (written,) = spilled(num_blocks=4, host_pages=2)
    m = pool.match_prefix([1, 2, 3, 4], now=2)               # reload pending from both host slots (held)
    assert cache[m.block_ids].isnan().all()
    other = pool.allocate(2, now=3)
    cache[other] = 7.0
    pool.commit(other, [9, 9, 8, 8], now=3)
    pool.free(other, now=3)
    assert pool.allocate(2, now=4) is not None                # evicts the pair: spilled into the reload's slots
    assert pool.stats.host_drops == 2 and pool.stats.spills == 4
    assert torch.equal(cache[m.block_ids], written)


def test_query_completes_the_copy_so_a_parked_page_is_never_stuck():
    pool, cache, (written,) = spilled()
    m = pool.match_prefix([1, 2, 3, 4], now=2)
    pool.free(m.block_ids, now=2)
    assert m.ready_event.query() and torch.equal(cache[m.block_ids], written)
    assert pool.allocate(8, now=3) is not None               # every page usable again


def test_no_batch_without_bytes_or_pages():
    host = HostTier(4, page_bytes=64)                         # bookkeeping only (the simulator)
    pool = KVCacheManager(4, BS, host_tier=host, page_bytes=64)
    assert host.reload(None, [0], [1]) is None
    pool.start_reloads()                                      # no tensors: nothing to issue
    tier = HostTier(4, spec=SPEC, pin_memory=False)
    assert tier.reload(SPEC.allocate(4), [], []) is None
