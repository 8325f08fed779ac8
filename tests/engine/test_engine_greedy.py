"""Whole-engine exactness on the tiny model: the tokens the engine generates (chunked prefill, mixed
batches, preemption, prefix-cache hits, host-tier reloads, shadow KV) equal greedy decoding of the dense
no-cache reference forward."""
import random

import pytest

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.llm_engine import LLMEngine
from shadowprefill.kv.host_tier import HostTier

from .conftest import assert_greedy_equal

VOCAB = 512


def rand_tokens(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


def record_batches(engine, kinds=None):
    """Wrap the executor to record (decodes, routed/normal prefill chunks, shadow chunks) of every iteration;
    `kinds`: a list to which each prefill entry's (request type, priority) is added."""
    seen = []
    execute = engine.executor.execute

    def wrapped(batch):
        seen.append((len(batch.decodes), len(batch.prefills) - batch.num_shadow, batch.num_shadow))
        if kinds is not None:
            kinds.extend((type(r).__name__, r.priority.name) for r, _ in batch.prefills)
        return execute(batch)

    engine.executor.execute = wrapped
    return seen


def run_to_completion(engine, max_steps=2000):
    outs = {}
    steps = 0
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] = o
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return outs


def test_chunked_prefill_and_mixed_batches_match_reference(tiny_model):
    rng = random.Random(1)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, token_budget=24, max_seqs=8))
    seen = record_batches(engine)
    prompts = {f"r{i}": rand_tokens(rng, rng.randrange(3, 70)) for i in range(6)}
    prompts["long"] = rand_tokens(rng, 70)
    max_tokens = {rid: rng.randrange(4, 10) for rid in prompts}
    arrivals = {0: ["r0", "r1", "r2"], 2: ["r3"], 4: ["long"], 6: ["r4", "r5"]}   # step -> requests
    outs = {}
    for step in range(500):
        for rid in arrivals.get(step, []):
            engine.add_request(rid, prompts[rid], max_tokens[rid], priority="routed" if rid == "r3" else "normal")
        if step > max(arrivals) and not engine.has_work():
            break
        for o in engine.step():
            outs[o.request_id] = o
    assert set(outs) == set(prompts)
    for rid, prompt in prompts.items():
        assert outs[rid].finished and len(outs[rid].token_ids) == max_tokens[rid]
        assert outs[rid].num_cached_tokens == 0
        assert_greedy_equal(tiny_model, prompt, outs[rid].token_ids)
    assert any(d and p for d, p, _ in seen), "no iteration mixed decodes with prefill chunks"
    assert max(p for _, p, _ in seen) >= 2, "no iteration carried two prefill chunks"
    st = engine.stats
    assert st.prefill_tokens_normal + st.prefill_tokens_routed == sum(map(len, prompts.values()))
    assert st.iterations >= 70 // 24 + max(max_tokens.values())


def test_preemption_recompute_matches_reference(tiny_model):
    rng = random.Random(2)
    # 10 pages of 16 tokens; 4 sequences of ~40 + 24 tokens need 16 pages: preemption is forced.
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=10, token_budget=64, max_seqs=8))
    prompts = {f"r{i}": rand_tokens(rng, 36 + i) for i in range(4)}
    for i, (rid, p) in enumerate(prompts.items()):
        engine.add_request(rid, p, 24, priority="routed" if i == 3 else "normal")
    outs = run_to_completion(engine)
    assert engine.stats.preemptions > 0
    for rid, p in prompts.items():
        assert len(outs[rid].token_ids) == 24
        assert_greedy_equal(tiny_model, p, outs[rid].token_ids)


def test_preemption_takes_normal_before_routed(tiny_model):
    rng = random.Random(3)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=8, token_budget=128, max_seqs=8))
    routed = engine.add_request("routed", rand_tokens(rng, 40), 30, priority="routed")
    normal = engine.add_request("normal", rand_tokens(rng, 40), 30, priority="normal")
    run_to_completion(engine)
    assert normal.num_preemptions > 0
    assert routed.num_preemptions == 0


def test_extension_of_finished_request_reports_cache_and_same_output(tiny_model):
    rng = random.Random(4)
    bs = 16
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, token_budget=32))
    first = rand_tokens(rng, 45)
    engine.add_request("a", first, 7, priority="routed", session_id="s")
    out_a = run_to_completion(engine)["a"]
    assert out_a.num_cached_tokens == 0
    history = first + out_a.token_ids
    second = history + rand_tokens(rng, 9)
    engine.add_request("b", second, 6, priority="routed", session_id="s")
    out_b = run_to_completion(engine)["b"]
    # Every full page of the computed history (the last sampled token was never fed) is reused.
    assert out_b.num_cached_tokens == (len(history) - 1) // bs * bs
    assert out_b.num_cached_tokens > 0
    cold = LLMEngine(tiny_model, EngineConfig(num_blocks=64, token_budget=32))
    cold.add_request("b", second, 6)
    out_cold = run_to_completion(cold)["b"]
    assert out_cold.num_cached_tokens == 0
    assert out_b.token_ids == out_cold.token_ids
    assert_greedy_equal(tiny_model, second, out_b.token_ids)


def test_host_tier_reload_matches_reference(tiny_model):
    rng = random.Random(5)
    bs = 16
    host = HostTier(num_pages=64, spec=tiny_model.kv_spec(bs))
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=12, token_budget=64), host_tier=host)
    first = rand_tokens(rng, 70)
    engine.add_request("a", first, 5)
    out_a = run_to_completion(engine)["a"]
    # Other traffic takes the whole device pool: a's pages are evicted and spilled to the host.
    for i in range(3):
        engine.add_request(f"x{i}", rand_tokens(rng, 150), 3)
        run_to_completion(engine)
    assert engine.kv_stats.spills > 0
    second = first + out_a.token_ids + rand_tokens(rng, 11)
    engine.add_request("b", second, 8)
    out_b = run_to_completion(engine)["b"]
    assert out_b.num_host_cached_tokens > 0
    assert out_b.num_cached_tokens >= out_b.num_host_cached_tokens
    assert engine.kv_stats.reloads > 0
    assert_greedy_equal(tiny_model, second, out_b.token_ids)


@pytest.mark.parametrize("mode", ["harvest-slo", "harvest"])
def test_shadow_on_idle_engine_serves_switch_call(tiny_model, mode):
    rng = random.Random(6)
    bs = 16
    cfg = dict(num_blocks=64, token_budget=32, n_min=16, idle_cap_s=10.0)
    engine = LLMEngine(tiny_model, EngineConfig(shadow_mode=mode, **cfg))
    engine.predictor.warm_steps, engine.predictor.growth = 0, None    # t̂ trusted: no n_min probes first
    kinds = []
    seen = record_batches(engine, kinds)
    history = rand_tokens(rng, 100)
    engine.add_shadow("s", history, switch_prob=0.9)
    assert engine.has_work()
    run_to_completion(engine)
    assert engine.stats.shadow_tokens == 96                    # whole pages only
    assert all(d == 0 and p == 0 and s == 1 for d, p, s in seen)   # shadow-only iterations, no tokens
    assert len(seen) == 3                                       # 32-token chunks (token budget)
    assert kinds == [("ShadowRequest", "SHADOW")] * 3           # prefill entries of the shadow request
    # The session's history grows (routed call elsewhere): only the delta is prefilled.
    history2 = history + rand_tokens(rng, 40)
    engine.add_shadow("s", history2)
    run_to_completion(engine)
    assert engine.stats.shadow_tokens == 128
    # The switch call.
    prompt = history2 + rand_tokens(rng, 7)
    engine.add_request("switch", prompt, 6, priority="routed", session_id="s")
    out = run_to_completion(engine)["switch"]
    assert out.num_cached_tokens == 128
    assert engine.stats.routed_shadow_hit_tokens == 128
    assert engine.kv_stats.shadow_blocks_promoted == 8
    cold = LLMEngine(tiny_model, EngineConfig(**cfg))
    cold.add_request("switch", prompt, 6, priority="routed")
    out_cold = run_to_completion(cold)["switch"]
    assert out_cold.num_cached_tokens == 0
    assert out.token_ids == out_cold.token_ids
    assert_greedy_equal(tiny_model, prompt, out.token_ids)


def test_shadow_rewritten_history_keeps_common_prefix(tiny_model):
    rng = random.Random(7)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, token_budget=64, n_min=16, idle_cap_s=10.0,
                                                shadow_mode="harvest-slo"))
    history = rand_tokens(rng, 64)
    engine.add_shadow("s", history)
    run_to_completion(engine)
    assert engine.stats.shadow_tokens == 64
    rewritten = history[:40] + rand_tokens(rng, 40)            # compacted context: LCP 40 -> 32 cached
    engine.add_shadow("s", rewritten)
    run_to_completion(engine)
    assert engine.stats.shadow_tokens == 64 + 48               # pages 32..80 recomputed
    prompt = rewritten + rand_tokens(rng, 5)
    engine.add_request("switch", prompt, 5, priority="routed", session_id="s")
    out = run_to_completion(engine)["switch"]
    assert out.num_cached_tokens == 80
    assert_greedy_equal(tiny_model, prompt, out.token_ids)


def test_eager_mode_runs_shadow_as_normal_requests(tiny_model):
    rng = random.Random(8)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, token_budget=32, shadow_mode="eager"))
    kinds = []
    seen = record_batches(engine, kinds)
    history = rand_tokens(rng, 50)
    engine.add_shadow("s", history)
    assert len(engine.jobs) == 0 and engine.scheduler.num_waiting() == 1
    outs = run_to_completion(engine)
    assert outs == {}                                           # shadow requests emit nothing
    assert engine.stats.eager_shadow_tokens == 50
    assert all(s == 0 for _, _, s in seen)                      # no controller chunks in Eager
    assert set(kinds) == {("ShadowRequest", "NORMAL")}          # the same request type, normal priority
    prompt = history + rand_tokens(rng, 5)
    engine.add_request("switch", prompt, 4, priority="routed", session_id="s")
    out = run_to_completion(engine)["switch"]
    assert out.num_cached_tokens == 48
    assert_greedy_equal(tiny_model, prompt, out.token_ids)


def test_routed_first_token_not_delayed_by_pending_shadow(tiny_model):
    """A routed call's first token comes in the same number of iterations whether or not shadow jobs
    are pending (at most one capped shadow iteration more, by the spec)."""
    rng = random.Random(9)
    prompt = rand_tokens(rng, 60)

    def iterations_to_first_token(mode):
        engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, token_budget=32, n_min=16,
                                                    idle_cap_s=10.0, shadow_mode=mode))
        engine.add_request("bg", rand_tokens(random.Random(10), 40), 20)
        for i in range(4):
            engine.add_shadow(f"s{i}", rand_tokens(random.Random(20 + i), 200), switch_prob=0.5)
        for _ in range(3):
            engine.step()
        engine.add_request("call", prompt, 3, priority="routed")
        steps = 0
        while True:
            steps += 1
            outs = {o.request_id: o for o in engine.step()}
            if "call" in outs:
                return steps, outs["call"].token_ids[0], engine

    base, tok_base, _ = iterations_to_first_token("none")
    with_shadow, tok_shadow, engine = iterations_to_first_token("harvest-slo")
    assert with_shadow <= base + 1
    assert tok_shadow == tok_base
    assert engine.stats.shadow_tokens > 0


@pytest.mark.parametrize("seed", [11, 13])
def test_random_workload_with_shadow_and_host_tier_matches_reference(tiny_model, seed):
    """Sessions whose calls extend their history, shadowed on this engine in between, with normal traffic,
    a small device pool (evictions, preemption) and a host tier: every output equals the reference."""
    rng = random.Random(seed)
    host = HostTier(num_pages=48, spec=tiny_model.kv_spec(16))
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=24, token_budget=48, max_seqs=4, n_min=16,
                                                idle_cap_s=10.0, shadow_mode="harvest-slo"), host_tier=host)
    histories = {f"s{i}": rand_tokens(rng, rng.randrange(20, 90)) for i in range(3)}
    prompts, outs = {}, {}
    for step in range(60):
        if rng.random() < 0.35:
            rid = f"r{len(prompts)}"
            if rng.random() < 0.6:
                sid = rng.choice(list(histories))
                prompts[rid] = histories[sid] + rand_tokens(rng, rng.randrange(1, 12))
                engine.add_request(rid, prompts[rid], rng.randrange(1, 8), priority="routed", session_id=sid)
            else:
                prompts[rid] = rand_tokens(rng, rng.randrange(5, 80))
                engine.add_request(rid, prompts[rid], rng.randrange(1, 8))
        if rng.random() < 0.3:
            sid = rng.choice(list(histories))
            histories[sid] = (histories[sid] + rand_tokens(rng, rng.randrange(5, 40)))[-200:]
            engine.add_shadow(sid, histories[sid], switch_prob=rng.random())
        for o in engine.step():
            outs[o.request_id] = o
    outs.update(run_to_completion(engine))
    assert set(outs) == set(prompts)
    st = engine.stats
    assert st.shadow_tokens > 0 and st.cached_prompt_tokens > 0
    for rid, prompt in prompts.items():
        assert outs[rid].finished
        assert_greedy_equal(tiny_model, prompt, outs[rid].token_ids)


def test_engine_over_a_ready_model_executor(tiny_model):
    """An engine built from an Executor (ModelExecutor over a caller's cache) behaves like one built from
    the model; the host tier is sized from the cache's page layout."""
    from shadowprefill.engine.executor import ModelExecutor

    cache = tiny_model.kv_spec(16).allocate(32, "cpu")
    engine = LLMEngine(ModelExecutor(tiny_model, cache), EngineConfig(num_blocks=32, token_budget=32,
                                                                      host_tier_gib=1e-3))
    assert engine.kv.host_tier is not None and engine.kv.host_tier.num_pages > 0
    prompt = rand_tokens(random.Random(14), 40)
    engine.add_request("a", prompt, 5)
    out = run_to_completion(engine)["a"]
    assert_greedy_equal(tiny_model, prompt, out.token_ids)
