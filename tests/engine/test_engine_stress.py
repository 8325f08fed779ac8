"""Random workloads on the simulated engine: every request finishes with its tokens, no page leaks, routed
calls are never preempted while normal ones could be, shadow never preempts anyone."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.model.latency import LatencyModel


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["none", "harvest", "harvest-slo", "eager"]),
       num_blocks=st.integers(12, 80), token_budget=st.sampled_from([16, 48, 256]),
       host=st.booleans())
def test_random_workload_drains_cleanly(seed, mode, num_blocks, token_budget, host):
    rng = random.Random(seed)
    cfg = EngineConfig(num_blocks=num_blocks, token_budget=token_budget, max_seqs=6, shadow_mode=mode,
                       n_min=16, host_tier_gib=1e-4 if host else 0.0, page_bytes=1024)
    engine = LLMEngine(SimulatedExecutor(LatencyModel("Llama-3.1-8B"), token_fn=lambda r: len(r.all_token_ids) % 97), cfg)
    histories = {f"s{i}": [rng.randrange(50) for _ in range(rng.randrange(20, 200))] for i in range(3)}
    requests = []
    for step in range(120):
        if rng.random() < 0.3 and len(requests) < 20:
            sid = rng.choice(list(histories))
            prompt = histories[sid] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            max_tokens = rng.randrange(1, 20)
            if -(-(len(prompt) + max_tokens) // 16) <= num_blocks:
                prio = rng.choice(["routed", "normal"])
                requests.append(engine.add_request(f"r{len(requests)}", prompt, max_tokens, priority=prio,
                                                   session_id=sid if prio == "routed" else None))
        if rng.random() < 0.3:
            sid = rng.choice(list(histories))
            histories[sid] = histories[sid] + [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
            engine.add_shadow(sid, histories[sid], switch_prob=rng.random())
        engine.step()
    for _ in range(5000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() or not engine.scheduler.has_unfinished()
    for r in requests:
        assert r.is_finished and len(r.output_token_ids) == r.max_tokens
        assert 0 <= r.num_cached_tokens <= r.num_prompt_tokens - 1
        assert r.num_cached_tokens % 16 == 0
    st_ = engine.kv_stats
    assert st_.normal_in_use_blocks == 0 and st_.shadow_in_use_blocks == 0   # no page leaks
    assert st_.shadow_in_use_blocks + st_.shadow_cached_blocks <= st_.shadow_cap_blocks
    if mode in ("none", "eager"):
        assert engine.stats.shadow_tokens == 0
