"""The native core's hash memo (csrc/kv/hash_memo.h): prefix lookups that reuse remembered chain steps give
exactly the results of hashing. Random token lists over a tiny vocabulary share prefixes and repeat page
contents under other parents, positions and tenants; with the memo's keys cut to a few bits (the test hook)
most lookups land on entries of other pages and must reject them. Every call is compared with the Python
core, and the chains lookups build with the reference hashes."""
import random

import pytest

from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.native import native_available

from .test_page_hashes import reference_hashes

if not native_available():
    raise ImportError("shadowprefill._C_kv is not built")

BS = 4


def managers(key_bits: int):
    out = []
    for backend in ("python", "native"):
        kv = KVCacheManager(24, BS, host_tier=HostTier(12, page_bytes=64), page_bytes=64, model_id="m",
                            backend=backend)
        if backend == "native":
            kv._core._set_memo_key_bits(key_bits)
        out.append(kv)
    return out


def random_tokens(rng, pool):
    if pool and rng.random() < 0.7:                     # an earlier list's prefix, then new tokens
        base = rng.choice(pool)
        tokens = base[:rng.randrange(len(base) + 1)]
    else:
        tokens = []
    if rng.random() < 0.3:                              # a page content seen before, at another position
        tokens += [rng.randrange(2)] + [1] * (BS - 1)
    return tokens + [rng.randrange(2) for _ in range(rng.randrange(3 * BS))]


@pytest.mark.parametrize("key_bits", [0, 1, 3, 64])
def test_memo_lookups_match_the_python_core(key_bits):
    rng = random.Random(key_bits)
    kvs = managers(key_bits)
    held, pool, now = [], [], 0.0
    for step in range(600):
        now += 0.1
        tokens, tenant = random_tokens(rng, pool), rng.choice(["", "t"])
        pool.append(tokens)
        op = rng.random()
        if op < 0.15:
            peeks = [kv.peek_prefix(tokens, tenant=tenant) for kv in kvs]
            assert peeks[0] == peeks[1]
            continue
        chains = [kv.hash_chain(tokens, tenant=tenant) for kv in kvs] if rng.random() < 0.3 else [None, None]
        limit = rng.randrange(len(tokens) + 1)
        matches = [kv.match_prefix(tokens, now=now, tenant=tenant, max_tokens=limit, hashes=c)
                   for kv, c in zip(kvs, chains)]
        assert matches[0] == matches[1]
        if chains[1] is not None:   # (the Python chain may hold more: it hashes ahead in batches)
            ref = reference_hashes(tokens, "m\x00" + tenant, BS)
            assert chains[1].hashes == ref[:len(chains[1].hashes)] and chains[0].hashes == ref[:len(chains[0].hashes)]
        pages = [m.block_ids for m in matches]
        need = (len(tokens) + BS - 1) // BS - len(pages[0])
        if need > 0:
            new = [kv.allocate(need, now=now) for kv in kvs]
            assert new[0] == new[1]
            if new[0] is not None:
                pages = [p + n for p, n in zip(pages, new)]
                commits = [kv.commit(p, tokens, now=now, tenant=tenant) for kv, p in zip(kvs, pages)]
                assert commits[0] == commits[1]
        held.append(pages)
        while len(held) > 3 or (held and rng.random() < 0.3):
            for kv, p in zip(kvs, held.pop(rng.randrange(len(held)))):
                kv.free(p, now=now)
        assert kvs[0].stats == kvs[1].stats
        assert kvs[0].snapshot() == kvs[1].snapshot()
    assert kvs[1].stats.host_hit_tokens > 0 and kvs[1].stats.device_hit_tokens > 0


def test_memo_lookups_raise_like_hashing():
    """A token beyond the fast read (a float, a bool, a big or negative int) after cached pages is read as
    by hashing."""
    for bad, error in ((1.5, TypeError), (-1, ValueError), (2**32, ValueError), (True, None), (2**31, None)):
        tokens = [3] * (3 * BS) + [bad] + [2] * (2 * BS)
        results = []
        for kv in managers(64):
            pages = kv.allocate(3, now=0.0)
            kv.commit(pages, tokens[:3 * BS], now=0.0)
            kv.free(pages, now=0.0)
            out = []
            for call in (lambda: kv.peek_prefix(tokens), lambda: kv.match_prefix(tokens, now=1.0).num_tokens):
                try:
                    out.append(call())
                except (TypeError, ValueError) as e:
                    out.append((type(e), str(e)))
            results.append(out)
        assert results[0] == results[1]
        if error is not None:
            assert results[1][0][0] is error
