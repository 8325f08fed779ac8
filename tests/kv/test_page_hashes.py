"""The page-hash chain (kv.page_hashes, PageHashes) against an independent BLAKE2b reference, its stability
across processes, and the manager's hashes= argument: the same decisions and hashes as without it, bad chains
rejected, stale pages dropped when a list is rewritten."""
import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest

from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.page_hash import PageHashes, page_hashes, pool_salt, salt_root

BS = 4


def reference_hashes(tokens, salt="", block_size=BS):
    """Independent chain, written from the definition in page_hash.py token by token with struct:
    root = BLAKE2b-128("shadowprefill.kv.root\\0" + salt), h_i = BLAKE2b-128(le128(h_{i-1}) + le32 tokens)."""
    parent = hashlib.blake2b(b"shadowprefill.kv.root\x00" + salt.encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // block_size):
        msg = parent + b"".join(struct.pack("<I", t) for t in tokens[i * block_size:(i + 1) * block_size])
        parent = hashlib.blake2b(msg, digest_size=16).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def test_page_hashes_match_the_reference():
    rng = random.Random(0)
    for block_size in (1, 3, 16, 32):
        toks = [rng.randrange(2**32) for _ in range(rng.randrange(0, 9 * block_size))]
        for salt in ("", "llama-3-8b\x00alice", "ünïcode"):
            assert page_hashes(toks, block_size, salt) == reference_hashes(toks, salt, block_size)
    assert page_hashes([1, 2, 3], 4) == [] and len(page_hashes(list(range(9)), 4)) == 2
    import numpy as np
    import torch
    toks = [rng.randrange(128_000) for _ in range(40)]
    assert page_hashes(np.array(toks), 8, "s") == page_hashes(torch.tensor(toks), 8, "s") == reference_hashes(toks, "s", 8)


def test_each_hash_depends_on_every_earlier_token_and_the_salt():
    rng = random.Random(1)
    toks = [rng.randrange(1000) for _ in range(6 * BS)]
    base = page_hashes(toks, BS, "s")
    assert len(set(base)) == 6 and all(0 <= h < 2**128 for h in base)
    for i in range(len(toks)):
        changed = list(toks)
        changed[i] += 1
        other = page_hashes(changed, BS, "s")
        page = i // BS
        assert other[:page] == base[:page] and all(a != b for a, b in zip(other[page:], base[page:]))
    assert not set(page_hashes(toks, BS, "t")) & set(base)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="token_ids"):
        page_hashes([1, -2, 3, 4], 2)
    with pytest.raises(ValueError, match="token_ids"):
        page_hashes([2**32, 0], 2)
    with pytest.raises(TypeError, match="token_ids"):
        page_hashes([1.5, 2], 2)
    with pytest.raises(TypeError, match="token_ids"):
        page_hashes("abcd", 2)
    with pytest.raises(ValueError, match="block_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(TypeError, match="salt"):
        page_hashes([1, 2], 2, salt=5)


def test_stable_across_processes_and_hash_seeds():
    """Same tokens, block size and salt give the same hashes in fresh interpreters whatever PYTHONHASHSEED is
    (the pool's chains included: the manager's hash_chain under two seeds)."""
    code = ("from shadowprefill.kv import page_hashes\n"
            "from shadowprefill.kv.manager import KVCacheManager\n"
            "t = list(range(1000, 1040))\n"
            "c = KVCacheManager(8, 8, model_id='m').hash_chain(t, tenant='alice'); c.extend_to(99)\n"
            "print(page_hashes(t, 8, 'm\\x00alice') == c.hashes, c.hashes)")
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout)
    assert len(outs) == 1
    assert outs.pop() == f"True {reference_hashes(list(range(1000, 1040)), 'm' + chr(0) + 'alice', 8)}\n"


def test_chain_grows_with_appends_and_matches_reference():
    rng = random.Random(1)
    toks = [rng.randrange(1000) for _ in range(10)]
    chain = PageHashes(toks, BS, salt_root("m\x00t"))
    assert chain.extend_to(100) == 2 and chain.hashes == reference_hashes(toks, "m\x00t")
    toks.extend(rng.randrange(1000) for _ in range(13))
    assert chain.extend_to(4) == 4 and chain.hashes == reference_hashes(toks, "m\x00t")[:4]
    assert chain.extend_to(100) == 5 and chain.hashes == reference_hashes(toks, "m\x00t")
    toks[19] += 1                                      # the last known page rewritten: dropped and re-hashed
    assert chain.extend_to(100) == 5 and chain.hashes == reference_hashes(toks, "m\x00t")
    toks[2] += 1                                       # an early page rewritten (and the tail): all re-hashed
    toks[19] += 1
    assert chain.extend_to(100) == 5 and chain.hashes == reference_hashes(toks, "m\x00t")
    del toks[9:]                                       # shrunk: pages beyond the list dropped
    assert chain.extend_to(100) == 2 and chain.hashes == reference_hashes(toks, "m\x00t")


def drive(pool, rng_seed, use_chain):
    """Random sessions (shared prefixes, two tenants) through lookups, allocations, commits and releases."""
    rng = random.Random(rng_seed)
    bases = {t: [rng.randrange(50) for _ in range(12 * BS)] for t in ("a", "b")}
    log, now = [], 0.0
    for step in range(60):
        now += rng.random()
        tenant = rng.choice("ab")
        toks = bases[tenant][:rng.randrange(1, 12) * BS] + [rng.randrange(50) for _ in range(rng.randrange(0, 3 * BS))]
        chain = pool.hash_chain(toks, tenant=tenant) if use_chain else None
        log.append(pool.peek_prefix(toks, tenant=tenant, hashes=chain))
        m = pool.match_prefix(toks, now=now, tenant=tenant, shadow=step % 3 == 0, promote=step % 4 == 0,
                                max_tokens=len(toks) - 1, hashes=chain)
        need = -(-len(toks) // BS) - len(m.block_ids)
        new = pool.allocate(need, now=now, shadow=step % 3 == 0)
        if new is None:
            pool.free(m.block_ids, now=now)
            log.append(None)
            continue
        blocks = m.block_ids + new
        written = m.num_tokens
        while written < len(toks):                       # commit chunk by chunk, as an engine does
            written = min(len(toks), written + rng.randrange(1, 2 * BS))
            log.append(pool.commit(blocks, toks, now=now, tenant=tenant, num_tokens=written, hashes=chain))
        log.append((m.num_tokens, m.device_tokens, m.host_tokens, m.shadow_tokens,
                    [pool.block_hash(b) for b in blocks]))
        pool.free(blocks, now=now)
    return log, pool.stats.as_dict()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hashes_argument_changes_no_decision(seed, kv_backend):
    def make():
        return KVCacheManager(24, BS, host_tier=HostTier(8, page_bytes=64), page_bytes=64, model_id="m",
                         cold_age_s=1.0)
    with_chain, without = drive(make(), seed, use_chain=True), drive(make(), seed, use_chain=False)
    assert with_chain == without
    stats = with_chain[1]   # the scenario exercises device and host hits, evictions and promotions
    assert stats["device_hit_tokens"] and stats["host_hit_tokens"] and stats["normal_evictions"]
    assert stats["shadow_blocks_promoted"]


def test_chain_of_another_list_tenant_or_model_is_rejected(kv_backend):
    pool = KVCacheManager(8, BS, model_id="m")
    toks = list(range(3 * BS))
    chain = pool.hash_chain(toks, tenant="alice")
    with pytest.raises(ValueError, match="hashes"):
        pool.match_prefix(toks, now=0, tenant="bob", hashes=chain)
    with pytest.raises(ValueError, match="hashes"):
        pool.peek_prefix(list(toks), tenant="alice", hashes=chain)
    with pytest.raises(ValueError, match="hashes"):
        KVCacheManager(8, BS, model_id="other").peek_prefix(toks, tenant="alice", hashes=chain)
    with pytest.raises(TypeError, match="hashes"):
        pool.peek_prefix(toks, tenant="alice", hashes=[1, 2, 3])
    ids = pool.allocate(3, now=0)
    with pytest.raises(ValueError, match="hashes"):
        pool.commit(ids, toks, now=0, tenant="bob", hashes=chain)
    assert pool.commit(ids, toks, now=0, tenant="alice", hashes=chain) == 3
    assert [pool.block_hash(b) for b in ids] == reference_hashes(toks, pool_salt("m", "alice"))


def test_lookup_and_commit_share_the_chain_each_page_hashed_once():
    pool = KVCacheManager(16, BS, backend="python")   # looks inside the reference's PageHashes
    toks = list(range(5 * BS + 2))
    chain = pool.hash_chain(toks)
    m = pool.match_prefix(toks, now=0, hashes=chain)   # a miss: hashing stops at the first page
    assert m.num_tokens == 0 and len(chain) == 1
    ids = pool.allocate(6, now=0)
    assert pool.commit(ids, toks, now=0, num_tokens=3 * BS, hashes=chain) == 3 and len(chain) == 3
    assert pool.commit(ids, toks, now=0, hashes=chain) == 2 and len(chain) == 5
    reference = reference_hashes(toks, pool_salt("", ""))
    assert [pool.block_hash(b) for b in ids[:5]] == chain.hashes == reference
    pool.free(ids, now=1)
    chain.hashes[:] = [h + 1 for h in chain.hashes]        # a corrupted chain would now miss: proves reuse
    chain.pages.clear()                                    # (of the hashes: no resolved pages to trust)
    assert pool.match_prefix(toks, now=2, hashes=chain).num_tokens == 0
    chain.hashes[:] = reference
    m = pool.match_prefix(toks, now=3, hashes=chain)
    assert m.block_ids == ids[:5] and len(chain) == 5 and chain.pages == ids[:5]
    pool.free(m.block_ids, now=3)


def test_a_kept_chain_revalidates_its_pages_by_generation_without_lookups():
    pool = KVCacheManager(8, BS, backend="python")      # looks inside the reference's PageHashes
    toks = list(range(4 * BS))
    chain = pool.hash_chain(toks)
    ids = pool.allocate(4, now=0)
    pool.commit(ids, toks, now=0, hashes=chain)            # the committing manager records the pages
    assert chain.pages == ids and chain.owner == pool._core.serial
    pool.free(ids, now=0)
    reference = list(chain.hashes)
    chain.hashes[:] = [h + 1 for h in reference]           # corrupted hashes: the kept pages are still used
    assert pool.match_prefix(toks, now=1, hashes=chain).block_ids == ids
    pool.free(ids, now=1)
    assert pool.peek_prefix(toks, hashes=chain) == (4 * BS, 0)
    chain.hashes[:] = reference
    other = KVCacheManager(8, BS, backend="python")        # another manager does not trust them
    assert other.match_prefix(toks, now=1, hashes=chain).num_tokens == 0 and chain.pages == []
    m = pool.match_prefix(toks, now=2, hashes=chain)       # found by lookup again, recorded again
    assert m.block_ids == ids and chain.pages == ids
    pool.free(ids, now=2)
    pool.allocate(6, now=3)                                # evicts the two tail pages: their generations move
    m = pool.match_prefix(toks, now=4, hashes=chain)
    assert m.block_ids == ids[:2] and chain.pages == ids[:2]


def test_retarget_keeps_the_shared_pages_and_rehashes_the_rest():
    old = [7] * (3 * BS) + [1] * BS
    chain = PageHashes(old, BS, salt_root("m"))
    chain.extend_to(10)
    new = old[:3 * BS] + [2] * (2 * BS)               # a rewrite keeping 3 pages (as ShadowRequest.update does)
    chain.retarget(new, 3)
    assert len(chain) == 3 and chain.tokens is new
    assert chain.extend_to(10) == 5 and chain.hashes == reference_hashes(new, "m")


def test_shadow_job_rewrite_retargets_its_chain(kv_backend):
    from shadowprefill.engine.shadow_work import ShadowQueue
    pool = KVCacheManager(16, BS)
    jobs = ShadowQueue(BS)
    job = jobs.upsert("s", list(range(4 * BS)), now=0)
    job.page_hashes = pool.hash_chain(job.token_ids)
    job.page_hashes.extend_to(10)
    rewritten = list(range(2 * BS)) + [99] * (3 * BS)
    jobs.upsert("s", rewritten, now=1)                # not an extension: only the 2 common pages are kept
    assert job.page_hashes.tokens is job.token_ids and len(job.page_hashes) == 2
    assert job.page_hashes.extend_to(10) == 5 and job.page_hashes.hashes == reference_hashes(job.token_ids, pool_salt("", ""))
    jobs.upsert("s", job.token_ids + [5] * BS, now=2)  # an extension keeps every page
    assert len(job.page_hashes) == 5 and job.page_hashes.extend_to(10) == 6
    assert job.page_hashes.hashes == reference_hashes(job.token_ids, pool_salt("", ""))


def test_peek_with_a_kept_chain_matches_a_fresh_peek(kv_backend):
    pool = KVCacheManager(32, BS, host_tier=HostTier(4, page_bytes=64), page_bytes=64)
    history = list(range(6 * BS))
    ids = pool.allocate(6, now=0)
    pool.commit(ids, history, now=0)
    pool.free(ids, now=0)
    pool.allocate(30, now=1)                            # evicts the 4 tail pages into the host tier
    chain = pool.hash_chain(history)
    assert pool.peek_prefix(history, hashes=chain) == pool.peek_prefix(history) == (2 * BS, 4 * BS)
    assert len(chain) == 6
    other = [1000 + t for t in history]
    other_chain = pool.hash_chain(other)
    assert pool.peek_prefix(other, hashes=other_chain) == (0, 0) and len(other_chain) == 1   # stops at a miss


def test_a_chain_whose_list_was_rewritten_in_place_is_not_trusted(kv_backend):
    pool = KVCacheManager(16, BS)
    toks = list(range(3 * BS))
    chain = pool.hash_chain(toks)
    ids = pool.allocate(3, now=0)
    pool.commit(ids, toks, now=0, hashes=chain)
    pool.free(ids, now=0)
    toks[-1] = 999                      # the last page changed in place (against the append-only contract)
    m = pool.match_prefix(toks, now=1, hashes=chain)
    assert m.num_tokens == 2 * BS and m.block_ids == ids[:2]     # the stale third page is not returned
    assert chain.hashes == reference_hashes(toks, pool_salt("", ""))[:3]
