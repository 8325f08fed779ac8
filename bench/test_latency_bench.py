"""Benchmark of the latency model's hot path (issue 6): `LatencyModel.iteration_time` is called once per
simulated iteration by the SimulatedExecutor and repeatedly by the shadow controller's predictor, so it must
cost about 20 µs for a full batch (256 sequences) on one core.

Cases: 255 decodes + one 512-token prefill chunk on 3,000 cached tokens, decode contexts as a Python list
and as a numpy array, for a dense model (Llama-3.1-8B), a sliding-window model (Gemma-2-9B, contexts on
both sides of the 4,096-token window: the slow path) and an MoE (Mixtral-8x7B, TP 4); plus the scalar
`linear_ops_ms`. The dense part is memoised per token count, as in a simulation (warm cache).

    pytest bench/test_latency_bench.py --benchmark-only        # or: python bench/test_latency_bench.py
"""
import random
import time

import numpy as np
import pytest

from shadowprefill.model.latency import LatencyModel, linear_ops_ms

CASES = {"dense-list": ("Llama-3.1-8B", False), "dense-array": ("Llama-3.1-8B", True),
         "sliding-list": ("Gemma-2-9B", False), "moe-list": ("Mixtral-8x7B", False)}


def _batch(as_array: bool):
    rng = random.Random(0)
    ctx = [rng.randint(200, 9000) for _ in range(255)]
    return [(512, 3000)], (np.array(ctx) if as_array else ctx)


@pytest.mark.parametrize("case", sorted(CASES))
def test_iteration_time_full_batch(benchmark, case):
    name, as_array = CASES[case]
    model = LatencyModel(name)
    prefill, ctx = _batch(as_array)
    model.iteration_time(prefill, ctx)                                   # warm the per-T memo
    t = benchmark(model.iteration_time, prefill, ctx)
    assert t > 0


def test_linear_ops_ms(benchmark):
    assert benchmark(linear_ops_ms, 4096, 14336, 32, 8, 2048) > 0


def main() -> None:
    for case, (name, as_array) in sorted(CASES.items()):
        model = LatencyModel(name)
        prefill, ctx = _batch(as_array)
        model.iteration_time(prefill, ctx)
        reps = 20000
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                model.iteration_time(prefill, ctx)
            best = min(best, (time.perf_counter() - start) / reps)
        print(f"iteration_time {case:13s} ({name}, 256 sequences): {best * 1e6:6.1f} µs")


if __name__ == "__main__":
    main()
