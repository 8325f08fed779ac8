"""The scheduler's kept steady decodes (engine/decode_batch.py) against a reference computed here from the
requests' own fields before every iteration: random workloads on small pools (preemptions, both admission
orders, tight caps that take the per-request scan), Eager shadow requests and aborts."""
import random

import pytest

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.engine.request import RequestStatus
from shadowprefill.model.latency import LatencyModel

BS = 16


def steady(r) -> bool:
    """The reference: running, past its first token, exactly one uncomputed token."""
    return (r.status is RequestStatus.RUNNING and r.first_token_time is not None
            and r.num_tokens - r.num_computed_tokens == 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("admission", ["fcfs", "routed-first"])
def test_decodes_match_a_scan_of_the_running_requests(seed, admission):
    rng = random.Random(seed)
    max_seqs = rng.choice([3, 8, 64])             # 3: more decodes than the cap (the per-request scan)
    engine = LLMEngine(SimulatedExecutor(LatencyModel("Llama-3.1-8B")),
                       EngineConfig(num_blocks=rng.choice([24, 40, 200]), block_size=BS, token_budget=rng.choice([32, 96]),
                                    max_seqs=max_seqs, admission=admission, shadow_mode=rng.choice(["harvest-slo", "eager"])))
    sched = engine.scheduler
    n = 0
    for step in range(400):
        if rng.random() < 0.3 and n < 60:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 70))]
            engine.add_request(f"r{n}", prompt, rng.randrange(1, 40), priority=rng.choice(["routed", "normal"]),
                               session_id=f"s{n % 5}")
            n += 1
        if rng.random() < 0.1:
            engine.add_shadow(f"s{rng.randrange(5)}", [rng.randrange(10, 500) for _ in range(rng.randrange(16, 90))])
        if rng.random() < 0.03 and sched.running:
            engine.abort_request(rng.choice(sched.running).request_id)
        # the reference, read before the iteration: steady decodes in rank order, up to the cap
        expected = [r for r in sched.running if steady(r)]
        assert sched.decoding.reqs == expected
        assert sched.decoding.num_routed == sum(r.priority.name == "ROUTED" for r in expected)
        it = engine.schedule_step()
        if it is None:
            if not engine.has_work():
                continue
            break
        batch = it.batch
        cap = min(engine.config.token_budget, max_seqs)
        if not batch.preempted:
            assert batch.decodes == expected[:cap]
        else:                                     # victims leave; the rest keep their order
            kept = [r for r in expected[:cap] if r.status is RequestStatus.RUNNING]
            assert batch.decodes == [r for r in kept if r in batch.decodes]
            assert all(r.status is not RequestStatus.RUNNING for r in expected[:cap] if r not in batch.decodes)
        for r in batch.decodes:                   # each has a page for its next token
            assert r.num_computed_tokens < len(r.block_ids) * BS
        assert batch.has_routed == any(r.priority.name == "ROUTED" for r in batch.decodes + [q for q, _ in batch.prefills])
        engine.clock.advance(it.duration)
        engine.complete_step(it)
    assert sched.decoding.reqs == [r for r in sched.running if steady(r)]
