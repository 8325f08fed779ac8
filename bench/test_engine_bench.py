"""Engine benchmarks (CPU; speed is measured here, never asserted).

1. Per-iteration CPU overhead of scheduler + shadow controller + block pool + engine bookkeeping, with
   the SimulatedExecutor (a linear latency model, so the executor itself costs ~nothing) at 256 running
   decodes and 64 pending shadow jobs of 4K tokens — issue 5's goal is <= 0.5 ms median on the
   development machine. max_seqs is 320 so that a shadow chunk (which takes a sequence slot) fits next
   to the 256 decodes; the "slack" case puts a shadow chunk into about one iteration in three.
2. Tiny-model engine steps per second on CPU (real forward, 8 decoding sequences).

Run: PYTHONPATH=. .venv/bin/python -m pytest bench/test_engine_bench.py --benchmark-only -q
"""
import random

import pytest
import torch

from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import SimulatedExecutor
from shadowprefill.engine.llm_engine import LLMEngine


class LinearLatency:
    """An H100-like linear iteration-time model (seconds); cheap to evaluate."""

    def iteration_time(self, prefill, decode_contexts):
        p = pc = 0
        for n, c in prefill:
            p += n
            pc += n * (c + n)
        return 4e-3 + 2e-5 * p + 1e-9 * pc + 1e-5 * len(decode_contexts) + 1e-9 * sum(decode_contexts)


def build_loaded_engine(mode="harvest-slo", num_seqs=256, num_jobs=64, seed=0, routed_every=16):
    rng = random.Random(seed)
    # max_seqs 320: room for shadow chunks next to the 256 decodes (a chunk takes a sequence slot)
    cfg = EngineConfig(num_blocks=64 * 1024, shadow_mode=mode, max_seqs=320)
    engine = LLMEngine(SimulatedExecutor(LinearLatency()), cfg)
    for i in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(rng.randrange(200, 2000))]
        engine.add_request(f"r{i}", prompt, 100000, priority="routed" if routed_every and i % routed_every == 0 else "normal")
    for j in range(num_jobs):
        engine.add_shadow(f"s{j}", [rng.randrange(32000) for _ in range(4096)], switch_prob=rng.random())
    while any(r.first_token_time is None for r in engine.scheduler.running) or engine.scheduler.num_waiting():
        engine.step()                                             # admit and prefill everything
    return engine


@pytest.mark.parametrize("mode,routed_every", [("none", 16), ("harvest-slo", 16), ("harvest-slo", 0)],
                         ids=["no-shadow", "harvest-slo-credit", "harvest-slo-slack"])
def test_iteration_overhead_256_seqs_64_jobs(benchmark, mode, routed_every):
    """routed_every=16: every 16th sequence is a routed call (the credit branch); 0: normal traffic
    only (the SLO-slack branch adds a shadow chunk to most iterations)."""
    engine = build_loaded_engine(mode, routed_every=routed_every)
    for _ in range(20):
        engine.step()
    assert len(engine.scheduler.running) == 256
    chunks_before = engine.stats.shadow_chunks
    benchmark.pedantic(engine.step, rounds=300, iterations=1, warmup_rounds=10)
    benchmark.extra_info["running"] = len(engine.scheduler.running)
    benchmark.extra_info["shadow_jobs"] = len(engine.jobs)
    benchmark.extra_info["shadow_chunks_measured"] = engine.stats.shadow_chunks - chunks_before
    benchmark.extra_info["budget_branches"] = engine.stats.budget_branches


def test_tiny_model_steps_per_second(benchmark):
    from shadowprefill.model.config import ModelConfig
    from shadowprefill.model.llama import Llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Llama(ModelConfig.tiny(), seed=0)
        engine = LLMEngine(model, EngineConfig(num_blocks=512, token_budget=256))
        rng = random.Random(0)
        for i in range(8):
            engine.add_request(f"r{i}", [rng.randrange(512) for _ in range(64)], 400)
        for _ in range(5):
            engine.step()
        benchmark.pedantic(engine.step, rounds=100, iterations=1, warmup_rounds=5)
        benchmark.extra_info["decodes_per_step"] = 8
    finally:
        torch.set_num_threads(threads)
