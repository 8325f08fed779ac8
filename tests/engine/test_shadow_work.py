"""Shadow jobs as requests (engine/shadow_work.py): a session's ShadowRequest keeps incremental progress, its
prompt grows by appends, a superseding history keeps the whole pages of the longest common prefix; the
shadow class of the queue orders them by switch probability and defers those below n_min; input
validation; chunks admitted and completed through the request-shaped KV calls."""
import random

import pytest

from shadowprefill.engine.request import Priority
from shadowprefill.engine.shadow_work import ShadowQueue, ShadowRequest

BS = 16


def first_difference(a, b):
    """The longest common prefix's length, as the first index where the lists differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_append_keeps_progress():
    q = ShadowQueue(BS)
    job = q.upsert("s", list(range(100)), now=0.0)
    assert isinstance(job, ShadowRequest) and job.priority is Priority.SHADOW and job.prefill_only
    assert job.num_prompt_tokens == job.num_tokens == 100 and job.max_tokens == 0
    assert job.shadowable_tokens(BS) == 96 and job.pending_tokens(BS) == 96
    job.num_cached = 64
    q.upsert("s", list(range(150)), now=1.0)                # the new call's input: an extension
    assert job.num_cached == 64 and job.pending_tokens(BS) == 144 - 64 and job.version == 0
    q.extend("s", [7] * 30, now=2.0)                         # streamed output tokens
    assert len(job.token_ids) == 180 and job.pending_tokens(BS) == 176 - 64
    assert job.num_prompt_tokens == job.num_tokens == 180 and job.all_token_ids[150:] == [7] * 30   # the prompt grew
    assert job.updated_at == 2.0


def test_rewrite_keeps_whole_pages_of_common_prefix():
    q = ShadowQueue(BS)
    old = list(range(200))
    job = q.upsert("s", old, now=0.0)
    job.num_cached = 192
    new = old[:70] + [999] * 50                              # LCP 70 -> 64 cached tokens survive
    q.upsert("s", new, now=1.0)
    assert job.token_ids == new
    assert job.num_cached == 64 and job.version == 1
    assert job.pending_tokens(BS) == 112 - 64
    job.num_cached = 16                                      # a rewrite never raises the belief
    q.upsert("s", new[:50] + [5] * 60, now=2.0)
    assert job.num_cached == 16 and job.version == 2


def test_order_by_switch_probability_then_age():
    q = ShadowQueue(BS, default_switch_prob=0.5)
    for sid, p in [("a", 0.3), ("b", None), ("c", 0.9), ("d", 0.5)]:
        q.upsert(sid, [1] * 64, now=0.0, switch_prob=p)
    assert [j.session_id for j in q.ordered()] == ["c", "b", "d", "a"]
    q.set_switch_prob("a", 1.0)
    assert [j.session_id for j in q.ordered()] == ["a", "c", "b", "d"]
    q.remove("c")
    assert [j.session_id for j in q.ordered()] == ["a", "b", "d"]
    assert [j.session_id for j in q.runnable(0)] == ["a", "b", "d"]


def test_runnable_defers_jobs_below_n_min():
    q = ShadowQueue(BS)
    q.upsert("small", [1] * 200, now=0.0, switch_prob=0.9)   # 192 pending
    q.upsert("big", [2] * 300, now=0.0, switch_prob=0.1)     # 288 pending
    assert [j.session_id for j in q.runnable(256)] == ["big"]
    assert [j.session_id for j in q.runnable(16)] == ["small", "big"]
    q.get("big").num_cached = 288
    assert not q.has_runnable(256)
    assert q.pending_tokens() == 192


def test_random_histories_never_overstate_cache():
    rng = random.Random(0)
    q = ShadowQueue(BS)
    hist = [rng.randrange(4) for _ in range(64)]
    job = q.upsert("s", hist, now=0.0)
    for step in range(200):
        job.num_cached = job.shadowable_tokens(BS)           # pretend everything got computed
        if rng.random() < 0.5:
            hist = hist + [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        else:
            cut = rng.randrange(len(hist) + 1)
            hist = hist[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        before = list(job.token_ids)
        cached_before = job.num_cached
        q.upsert("s", hist, now=float(step))
        lcp = first_difference(before, hist)
        assert job.num_cached == min(cached_before, lcp // BS * BS)   # whole pages of the common prefix
        assert job.token_ids[:job.num_cached] == before[:job.num_cached]


def test_validation():
    q = ShadowQueue(BS)
    with pytest.raises(TypeError, match="session_id"):
        q.upsert("", [1], now=0.0)
    with pytest.raises(ValueError, match="token_ids"):
        q.upsert("s", [1, -2], now=0.0)
    with pytest.raises(TypeError, match="token_ids"):
        q.upsert("s", "abc", now=0.0)
    with pytest.raises(ValueError, match="switch_prob"):
        q.upsert("s", [1], now=0.0, switch_prob=1.5)
    with pytest.raises(ValueError, match="block_size"):
        ShadowQueue(0)
    q.upsert("s", [1], now=0.0, tenant="t1")
    with pytest.raises(ValueError, match="tenant"):
        q.upsert("s", [1, 2], now=0.0, tenant="t2")
    with pytest.raises(KeyError):
        q.extend("missing", [1], now=0.0)


class StubBudget:
    """A token budget of `tokens` per iteration (the parts of controller.ShadowBudget that `take` reads)."""

    def __init__(self, tokens, n_min=BS):
        self.left, self.n_min = tokens, n_min

    @property
    def open(self):
        return self.left >= self.n_min

    def room(self):
        return self.left

    def fits(self, context, extra_s=0.0, reload=None):
        return self.left

    def read_kv_room(self, block_size):
        return self.left

    def take(self, tokens, context, extra_s=0.0, reload=None):
        self.left -= tokens


@pytest.mark.parametrize("backend", ["python", "native"])
def test_chunks_reuse_the_jobs_known_prefix_pages(backend):
    """take/complete keep the job's cached prefix (chain + pages) between chunks: each chunk's pages are the
    job's remembered pages plus new ones, exactly what a fresh lookup finds, also after an eviction."""
    from shadowprefill.kv.manager import KVCacheManager
    from shadowprefill.engine.shadow_work import complete, take
    kv = KVCacheManager(64, BS, backend=backend)
    rng = random.Random(5)
    history = [rng.randrange(1000) for _ in range(40 * BS)]
    pre = kv.allocate(8, now=0.0)
    kv.commit(pre, history, now=0.0)
    kv.free(pre, now=0.0)
    jobs = ShadowQueue(BS)
    job = jobs.upsert("s", history, now=0.0)
    now = 1.0
    for round_ in range(4):
        if round_ == 2:
            evicting = kv.allocate(kv.num_free_blocks + 2, now=now)     # evicts two of the job's shadow pages
            assert kv.stats.shadow_evictions == 2
            kv.free(evicting, now=now)
        chunks = take(jobs, StubBudget(4 * BS), kv, now)
        assert len(chunks) == 1
        r, n = chunks[0]                                                 # a prefill entry of the request
        start, block_ids = r.num_computed_tokens, list(r.block_ids)
        assert r is job and n == 4 * BS and kv.block_table(r) == block_ids and len(block_ids) * BS == start + n
        assert start == (8 + 4 * round_ - (2 if round_ >= 2 else 0)) * BS
        fresh = kv.match_prefix(history, now=now, tenant="", shadow=True, max_tokens=start)   # no chain
        assert fresh.block_ids == block_ids[:start // BS] and fresh.num_tokens == start
        kv.free(fresh.block_ids, now=now)
        assert complete(jobs, chunks, kv, now) == 4 * BS
        assert kv.block_table(r) == [] and r.block_ids == []            # pages held only while in flight
        assert job.page_hashes.pages == block_ids and len(job.page_hashes.pages) * BS == job.num_cached
        now += 1.0


# ---- the scheduler's shadow phase on an engine (virtual clock): chunks in flight meet newer histories ----

class _Linear:
    def iteration_time(self, prefill, decode_contexts):
        return 1e-3 + 2e-5 * sum(n for n, _ in prefill) + 1e-4 * len(decode_contexts)


def _engine(token_budget=64, lost_shadow="recompute"):
    from shadowprefill.engine.config import EngineConfig
    from shadowprefill.engine.executor import SimulatedExecutor
    from shadowprefill.engine.llm_engine import LLMEngine
    e = LLMEngine(SimulatedExecutor(_Linear()), EngineConfig(block_size=BS, num_blocks=128, token_budget=token_budget,
                                                             n_min=BS, idle_cap_s=1.0, shadow_mode="harvest-slo",
                                                             lost_shadow=lost_shadow))
    e.predictor.warm_steps, e.predictor.growth = 0, None     # t̂ trusted as seeded: no n_min probes
    return e


def _rand(rng, n):
    return [rng.randrange(1000) for _ in range(n)]


def _in_flight(e):
    it = e.schedule_step()
    assert it is not None and it.batch.num_shadow == 1 and not it.batch.has_requests
    (r, n), = it.batch.shadow_prefills
    assert it.batch.prefills[-1] == (r, n) and r.status.value == "waiting" and e.kv.block_table(r) == r.block_ids
    return it, r, n


def _finish(e, it):
    e.clock.advance(it.duration)
    e.complete_step(it)


def _peek(e, tokens):
    dev, host = e.cached_prefix_tokens(tokens)
    return dev + host


def _started(seed, n):
    """An engine whose shadow request of `n` random tokens has its first chunk in flight."""
    rng = random.Random(seed)
    e = _engine()
    a = _rand(rng, n)
    e.add_shadow("s", a)
    return (rng, e, a) + _in_flight(e)


def test_rewrite_while_a_chunk_is_in_flight_registers_what_it_computed():
    rng, e, a, it, r, n = _started(11, 160)
    assert (r.num_computed_tokens, n) == (0, 64) and r.all_token_ids == a
    b = a[:40] + _rand(rng, 120)                       # LCP 40: two whole pages survive
    e.add_shadow("s", b)
    assert e.jobs.get("s") is r and r.version == 1 and r.token_ids == b and r.num_prompt_tokens == 160
    _finish(e, it)
    assert _peek(e, a) == 64                            # the chunk's pages hold a's tokens, registered as a's
    assert _peek(e, b) == 32 and r.num_cached == 0      # the belief is not advanced by the old history's chunk
    it, r2, n = _in_flight(e)
    assert r2 is r and r.num_computed_tokens == 32 and r.all_token_ids == b   # the lookup finds the LCP pages
    _finish(e, it)
    while e.has_work():
        e.step()
    assert _peek(e, b) == 160 and r.num_cached == 160 and e.shadow_pending_tokens("s") == 0
    assert e.stats.shadow_tokens == 64 + (160 - 32)


def test_extend_while_a_chunk_is_in_flight_keeps_progress():
    rng, e, a, it, r, n = _started(12, 100)
    more = _rand(rng, 60)
    e.extend_shadow("s", more)                         # routed output streams in meanwhile: the prompt grows
    assert r.num_prompt_tokens == r.num_tokens == 160 and r.version == 0
    _finish(e, it)
    assert r.num_cached == 64 and _peek(e, a + more) == 64
    it, r2, n = _in_flight(e)
    assert r2 is r and (r.num_computed_tokens, n) == (64, 64)
    _finish(e, it)
    while e.has_work():
        e.step()
    assert _peek(e, a + more) == 160 and e.stats.shadow_tokens == 160


def test_cancel_while_a_chunk_is_in_flight_keeps_its_pages_cached():
    _, e, a, it, r, n = _started(13, 200)
    e.cancel_shadow("s")
    assert "s" not in e.jobs
    _finish(e, it)
    assert _peek(e, a) == n == 64 and e.kv.block_table(r) == [] and not e.has_work()
    assert e.kv.num_shadow_blocks == 4                 # cached, shadow class, evict-first


@pytest.mark.parametrize("lost_shadow", ["recompute", "wait"])
def test_a_shadow_whose_prefix_was_evicted_recomputes_or_waits_for_new_history(lost_shadow):
    """lost_shadow="recompute" (the paper's): the next chunk starts again from what is left; "wait": the
    request computes nothing until its session's next history, then tries once more from what is cached."""
    rng = random.Random(13)
    e = _engine(lost_shadow=lost_shadow)
    a = _rand(rng, 160)
    e.add_shadow("s", a)
    it, r, n = _in_flight(e)
    _finish(e, it)
    assert r.num_cached == 64 and _peek(e, a) == 64
    kv = e.kv
    evicting = kv.allocate(kv.num_free_blocks + 4, now=e.clock.now())    # every shadow page goes (evict-first)
    kv.free(evicting, now=e.clock.now())
    assert kv.stats.shadow_evictions == 4 and _peek(e, a) == 0
    computed = e.stats.shadow_tokens
    if lost_shadow == "recompute":
        it, r2, n = _in_flight(e)
        assert r2 is r and r.num_computed_tokens == 0 and n == 64        # from the start again
        _finish(e, it)
        assert e.stats.shadow_tokens == computed + 64
        return
    assert e.schedule_step() is None and r.stalled and r.num_cached == 64   # nothing runs; the belief stays
    assert e.stats.shadow_tokens == computed
    more = _rand(rng, 40)
    e.add_shadow("s", a + more)                          # the session's next history: one more try
    assert not r.stalled and r.num_cached == 0
    for _ in range(100):                                 # (bounded: a stalled request must not hang the test)
        if not e.has_work():
            break
        e.step()
    assert _peek(e, a + more) == 192 and r.num_cached == 192 and e.stats.shadow_tokens == computed + 192


def test_lost_shadow_validation():
    from shadowprefill.engine.config import EngineConfig
    with pytest.raises(ValueError, match="lost_shadow"):
        EngineConfig(num_blocks=8, lost_shadow="drop")
    with pytest.raises(ValueError, match="lost_shadow"):
        ShadowQueue(BS, lost_shadow="later")
