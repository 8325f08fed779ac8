"""Scheduler order, limits and preemption, on the engine with a SimulatedExecutor (no tensors)."""
import pytest

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.decode_batch import BATCH_FROM
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.model.latency import LatencyModel
from shadowprefill.engine.request import RequestStatus


def sim_engine(**cfg):
    return LLMEngine(SimulatedExecutor(LatencyModel("Llama-3.1-8B")), EngineConfig(**cfg))


def toks(n, salt):
    return [(salt * 31 + 7 * i) % 1000 for i in range(n)]


def one_step(engine):
    it = engine.schedule_step()
    if it is None:
        return None
    engine.clock.advance(it.duration)
    engine.complete_step(it)
    return it.batch


def ids(reqs):
    return [r.request_id for r in reqs]


def test_default_admission_is_fcfs():
    assert EngineConfig(num_blocks=8).admission == "fcfs"


def test_fcfs_admits_routed_and_normal_by_arrival_under_budget():
    e = sim_engine(num_blocks=256, token_budget=100)
    for i, (rid, prio) in enumerate([("n1", "normal"), ("r1", "routed"), ("n2", "normal"), ("r2", "routed")]):
        e.add_request(rid, toks(30, i), 5, priority=prio)
    b = one_step(e)
    assert [(r.request_id, n) for r, n in b.prefills] == [("n1", 30), ("r1", 30), ("n2", 30), ("r2", 10)]
    assert b.has_routed and not b.waiting_nonempty
    assert ids(b.samples) == ["n1", "r1", "n2"]                 # r2's chunk does not finish its prompt
    e.add_request("r3", toks(50, 9), 5, priority="routed")
    e.add_request("n3", toks(10, 8), 5)
    b = one_step(e)
    assert ids(b.decodes) == ["n1", "r1", "n2"]                 # decodes in arrival order
    assert [(r.request_id, n) for r, n in b.prefills] == [("r2", 20), ("r3", 50), ("n3", 10)]


def test_fcfs_routed_admission_waits_and_preempts_newest_first():
    # the pool is full with an older normal request: a routed call waits (no priority), and when pages run
    # out the newest arrival is the victim whatever its class
    e = sim_engine(num_blocks=6, token_budget=1000)
    n = e.add_request("n", toks(90, 1), 6)                     # 6 pages: the whole pool
    one_step(e)
    r = e.add_request("r", toks(20, 2), 5, priority="routed")
    b = one_step(e)
    assert not b.preempted and b.admission_blocked and ids(b.decodes) == ["n"]
    assert r.status is RequestStatus.WAITING
    while not n.is_finished:
        one_step(e)
    while e.has_work():
        one_step(e)
    assert r.is_finished and n.num_preemptions == 0

    e = sim_engine(num_blocks=6, token_budget=1000)
    old = e.add_request("old", toks(30, 1), 10, priority="routed")
    new = e.add_request("new", toks(30, 2), 10)
    mid = e.add_request("mid", toks(30, 3), 10, priority="routed")   # arrives after `new`
    preempted = []
    while e.has_work():
        preempted += ids(one_step(e).preempted)
    assert preempted[0] == "mid" and old.num_preemptions == 0
    assert all(q.is_finished and len(q.output_token_ids) == 10 for q in (old, new, mid))


def test_admission_order_routed_then_arrival_under_budget():
    e = sim_engine(num_blocks=256, token_budget=100, admission="routed-first")
    for i, (rid, prio) in enumerate([("n1", "normal"), ("n2", "normal"), ("r1", "routed"), ("r2", "routed")]):
        e.add_request(rid, toks(30, i), 5, priority=prio)
    b = one_step(e)
    assert [(r.request_id, n) for r, n in b.prefills] == [("r1", 30), ("r2", 30), ("n1", 30), ("n2", 10)]
    assert b.num_tokens == 100 and b.has_routed and not b.waiting_nonempty
    assert ids(b.samples) == ["r1", "r2", "n1"]                 # n2's chunk does not finish its prompt
    # next iteration: decodes first, then the in-flight chunk, then admissions
    e.add_request("r3", toks(50, 9), 5, priority="routed")
    b = one_step(e)
    assert ids(b.decodes) == ["r1", "r2", "n1"]
    assert [(r.request_id, n) for r, n in b.prefills] == [("n2", 20), ("r3", 50)]
    assert b.num_tokens == 73


def test_in_flight_prefill_before_admission_and_budget_exhaustion():
    e = sim_engine(num_blocks=256, token_budget=32)
    e.add_request("long", toks(100, 1), 3)
    b = one_step(e)
    assert [(r.request_id, n) for r, n in b.prefills] == [("long", 32)]
    e.add_request("routed", toks(10, 2), 3, priority="routed")
    b = one_step(e)
    assert [(r.request_id, n) for r, n in b.prefills] == [("long", 32)]   # in-flight chunk takes the budget
    assert b.waiting_nonempty and not b.admission_blocked


def test_max_seqs():
    e = sim_engine(num_blocks=256, token_budget=1000, max_seqs=2)
    for i in range(4):
        e.add_request(f"r{i}", toks(10, i), 3)
    b = one_step(e)
    assert ids(r for r, _ in b.prefills) == ["r0", "r1"]
    assert b.waiting_nonempty
    b = one_step(e)
    assert ids(b.decodes) == ["r0", "r1"] and not b.prefills


def test_kv_exhaustion_preempts_normal_newest_first_never_routed():
    # 6 pages; three 30-token requests hold 2 pages each; their 3rd page forces preemption
    e = sim_engine(num_blocks=6, token_budget=1000, admission="routed-first")
    n_old = e.add_request("n_old", toks(30, 1), 10)
    r = e.add_request("r", toks(30, 2), 10, priority="routed")
    n_new = e.add_request("n_new", toks(30, 3), 10)
    one_step(e)
    preempted = []
    while e.has_work():
        preempted += ids(one_step(e).preempted)
    assert preempted[0] == "n_new"
    assert r.num_preemptions == 0 and n_new.num_preemptions >= 1
    assert all(q.is_finished and len(q.output_token_ids) == 10 for q in (n_old, r, n_new))


def test_lowest_ranked_request_preempts_itself():
    e = sim_engine(num_blocks=4, token_budget=1000)
    a = e.add_request("a", toks(20, 1), 8)                     # 2 pages, room up to 32 tokens
    b = e.add_request("b", toks(30, 2), 8)                     # 2 pages, needs a 3rd at token 32
    one_step(e)
    preempted = []
    while e.has_work():
        preempted += ids(one_step(e).preempted)
    assert preempted[0] == "b" and a.num_preemptions == 0
    assert a.is_finished and b.is_finished and len(b.output_token_ids) == 8



def test_decodes_due_a_page_grow_in_one_call_and_a_refusal_preempts_once():
    """Four decodes (BATCH_FROM) reach a page boundary together with two pages free: the one batched call
    serves a and b and refuses c, which then preempts the lowest-ranked d and takes its page without asking
    the pool twice; d is skipped. Two allocation failures, as when each decode asked on its own (c's growth,
    then d's re-admission in the same pass, which finds no page for its 17 tokens)."""
    assert BATCH_FROM == 4
    e = sim_engine(num_blocks=6, block_size=16, token_budget=1000)
    reqs = [e.add_request(rid, toks(15, i + 1), 20) for i, rid in enumerate("abcd")]   # one page each
    one_step(e)                                                # prefill: 15 tokens, the first sampled
    one_step(e)                                                # decode: 16 tokens fill the page
    assert e.kv.num_free_blocks == 2 and e.kv.stats.allocation_failures == 0
    batch = one_step(e)                                        # all four due a page, two free
    assert ids(batch.preempted) == ["d"] and ids(batch.decodes) == ["a", "b", "c"]
    assert [len(r.block_ids) for r in reqs] == [2, 2, 2, 0] and reqs[3].status is RequestStatus.WAITING
    assert e.kv.stats.allocation_failures == 2 and e.stats.preemptions == 1


def test_routed_admission_preempts_running_normal():
    e = sim_engine(num_blocks=6, token_budget=1000, admission="routed-first")
    n = e.add_request("n", toks(90, 1), 6)                     # 6 pages: the whole pool
    one_step(e)
    r = e.add_request("r", toks(20, 2), 5, priority="routed")
    b = one_step(e)
    assert ids(b.preempted) == ["n"] and ids(rq for rq, _ in b.prefills) == ["r"]
    assert n.status is RequestStatus.WAITING
    assert b.waiting_nonempty                                  # n waits again


def test_normal_admission_never_preempts_and_blocks_shadow():
    e = sim_engine(num_blocks=4, token_budget=1000, shadow_mode="harvest-slo", n_min=16, idle_cap_s=1.0)
    e.add_request("a", toks(60, 1), 4)                         # 4 pages: the whole pool
    one_step(e)
    e.add_request("b", toks(30, 2), 5)
    e.add_shadow("s", toks(500, 3))
    b = one_step(e)
    assert b.admission_blocked and not b.preempted and b.num_shadow == 0
    assert e.controller.last_branch == "blocked"


def test_shadow_pages_never_cause_preemption():
    e = sim_engine(num_blocks=64, token_budget=256, shadow_mode="harvest-slo", n_min=16, idle_cap_s=1.0)
    for i in range(4):
        e.add_shadow(f"s{i}", toks(300, 10 + i))
    while e.has_work():
        one_step(e)
    assert e.kv_stats.shadow_cached_blocks == 16             # the capped shadow class is full
    reqs = [e.add_request(f"r{i}", toks(200, i), 40, priority="normal") for i in range(4)]   # 4 x 15 pages
    while e.has_work():
        one_step(e)
    assert e.stats.preemptions == 0
    assert e.kv_stats.shadow_evictions > 0
    assert all(len(r.output_token_ids) == 40 for r in reqs)


def test_eq1_bookkeeping_f_r_and_k_r():
    """The scheduler keeps what Eq. 1 reads: f_r (time of the first token) and k_r (iterations since)."""
    e = sim_engine(num_blocks=256, token_budget=64, margin=0.2)
    reqs = [e.add_request(f"r{i}", toks(20 + 30 * i, i), 12, tpot_slo=0.03 + 0.01 * i) for i in range(3)]
    firsts = {}
    for _ in range(8):
        it = e.schedule_step()
        e.clock.advance(it.duration)
        for out in e.complete_step(it):
            if out.num_output_tokens == 1:
                firsts[out.request_id] = e.clock.now()
        for r in reqs:
            if r.first_token_time is not None and not r.is_finished:
                assert r.first_token_time == firsts[r.request_id]
                assert r.num_decode_iters == len(r.output_token_ids) - 1


def test_abort_releases_pages():
    e = sim_engine(num_blocks=32, token_budget=64)
    e.add_request("a", toks(100, 1), 5)
    e.add_request("b", toks(10, 2), 5)
    one_step(e)
    e.abort_request("a")
    e.abort_request("b")
    assert not e.has_work()
    assert e.kv_stats.normal_in_use_blocks == 0
    with pytest.raises(KeyError):
        e.abort_request("a")


def test_add_request_validation():
    e = sim_engine(num_blocks=8)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        e.add_request("x", [], 3)
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request("x", [1], 0)
    with pytest.raises(ValueError, match="priority"):
        e.add_request("x", [1], 1, priority="urgent")
    with pytest.raises(ValueError, match="priority"):
        e.add_request("x", [1], 1, priority="shadow")
    with pytest.raises(ValueError, match="ttft_slo"):
        e.add_request("x", [1], 1, ttft_slo=-1.0)
    with pytest.raises(TypeError, match="request_id"):
        e.add_request(3, [1], 1)
    with pytest.raises(ValueError, match="KV pool"):                 # 8 pages of 16 tokens
        e.add_request("x", [1] * 100, 29)
    e.add_request("x", [1], 1)
    with pytest.raises(ValueError, match="already"):
        e.add_request("x", [1], 1)
    with pytest.raises(TypeError, match="config"):
        LLMEngine(SimulatedExecutor(LatencyModel("Llama-3.1-8B")), {"num_blocks": 8})
    with pytest.raises(TypeError, match="model_or_executor"):
        LLMEngine(object(), EngineConfig(num_blocks=8))


def test_config_validation():
    with pytest.raises(ValueError, match="shadow_mode"):
        EngineConfig(num_blocks=8, shadow_mode="lazy")
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=0)
    with pytest.raises(TypeError, match="beta"):
        EngineConfig(num_blocks=8, beta="half")
    with pytest.raises(ValueError, match="margin"):
        EngineConfig(num_blocks=8, margin=1.0)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(num_blocks=8, admission="lifo")
    assert EngineConfig(num_blocks=8).shadow_mode == "harvest-slo"
    assert sim_engine(num_blocks=8, shadow_mode="harvest").controller.delta == 0.1
    assert sim_engine(num_blocks=8, shadow_mode="harvest-slo").controller.delta == 0.025
    assert sim_engine(num_blocks=8, shadow_mode="harvest", delta=0.3).controller.delta == 0.3


@pytest.mark.parametrize("stream", [False, True])
def test_abort_of_a_decode_in_flight(stream):
    """A decode aborted between schedule and postprocess (mid-page, where the decode loop only counts) gets no
    token, no output and no page; the other decodes of the batch go on as if it never ran."""
    e = sim_engine(num_blocks=64, token_budget=256)
    reqs = [e.add_request(f"r{i}", toks(40 + 3 * i, i), 60, stream=stream) for i in range(3)]
    for _ in range(4):                           # the prefills (one step), then steady decodes
        one_step(e)
    assert all(r.status is RequestStatus.RUNNING and r.num_output_tokens == 4 for r in reqs)
    before = {r.request_id: r.num_tokens for r in reqs}
    if not stream:                               # r1's next token is one the decode loop only counts
        assert before["r1"] + 1 < reqs[1].check_at
    it = e.schedule_step()
    assert set(ids(it.batch.decodes)) == {"r0", "r1", "r2"}
    e.abort_request("r1")
    e.clock.advance(it.duration)
    outs = e.complete_step(it)
    assert "r1" not in {o.request_id for o in outs}
    assert {o.request_id for o in outs} == ({"r0", "r2"} if stream else set())
    assert reqs[1].num_tokens == before["r1"] and reqs[1].status is RequestStatus.FINISHED
    assert [r.num_tokens for r in (reqs[0], reqs[2])] == [before["r0"] + 1, before["r2"] + 1]
    while e.has_work():
        one_step(e)
    assert [r.num_output_tokens for r in (reqs[0], reqs[2])] == [60, 60]
    assert e.kv_stats.normal_in_use_blocks == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pool", ["tight", "roomy"])
def test_batched_kv_calls_match_the_calls_one_request_at_a_time(pool, seed):
    """The scheduler's one-call-per-iteration KV calls (allocate_slots_many for the decodes due a page,
    cache_many for the pages filled, from BATCH_FROM requests on) against the same engine making every call
    on its own at its moment (batching out of reach): the same pool page by page, the same preemptions and
    outputs, every step. 4-token pages, so that many decodes are due a page at once; a tight
    pool refuses part of a batch (preemption from inside it), a roomy one holds enough decodes for their
    filled pages to register in one call."""
    import random
    rng = random.Random(seed)
    cfg = dict(num_blocks=rng.choice([90, 120, 150] if pool == "tight" else [600, 800]), block_size=4,
               token_budget=128, max_seqs=64, admission=rng.choice(["fcfs", "routed-first"]), shadow_mode="none")
    batched, single = sim_engine(**cfg), sim_engine(**cfg)
    single.scheduler.batch_from = 10**9                   # the reference: every call on its own, at its moment
    real_allocate, real_cache, refused, cached = batched.kv.allocate_slots_many, batched.kv.cache_many, [], []

    def allocate_counted(requests, num_new_tokens, **kw):  # (the real calls, counted)
        served = real_allocate(requests, num_new_tokens, **kw)
        refused.append(served < len(requests))
        return served

    def cache_counted(requests, **kw):
        cached.append(len(requests))
        return real_cache(requests, **kw)
    batched.kv.allocate_slots_many, batched.kv.cache_many = allocate_counted, cache_counted
    prompts = [[rng.randrange(10, 60) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    for step in range(300):
        # few prompts, some arriving twice at once: the same pages filled in the same iteration by a request
        # that finishes there and one that goes on (which of the two pages is cached depends on call order)
        for k in range(rng.choice([0, 0, 1, 1, 2])):
            prompt = rng.choice(prompts)[:rng.randrange(1, 41)]
            prio = rng.choice(["routed", "normal"])
            for copy in range(rng.choice([1, 1, 2])):
                args = (f"r{step}.{k}.{copy}", prompt, rng.randrange(1, 80))
                for e in (batched, single):
                    e.add_request(*args, priority=prio)
        outs = []
        for e in (batched, single):
            outs.append([(o.request_id, o.num_output_tokens, o.finished) for o in e.step()])
        assert outs[0] == outs[1]
        assert batched.kv.snapshot() == single.kv.snapshot()
        assert batched.kv.stats.as_dict() == single.kv.stats.as_dict()
        assert batched.stats.preemptions == single.stats.preemptions
    if pool == "tight":
        assert batched.stats.preemptions > 0 and any(refused)
    else:
        assert len(cached) > 10 and refused
