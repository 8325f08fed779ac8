"""bench/budget_check.py on a short run: it classifies every iteration that had shadow work queued, finds the
filled iterations within their budget, and leaves the engine as it found it."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import budget_check  # noqa: E402

import shadowprefill.engine.llm_engine as llm_engine  # noqa: E402
import shadowprefill.engine.shadow_work as shadow_work  # noqa: E402


def test_budget_check_classifies_and_restores():
    take, step = shadow_work.take, llm_engine.LLMEngine.schedule_step
    out = budget_check.run("fusionbench", "peak", duration=30.0, policy="harvest-slo", warmup=10.0, instances=1,
                           session_rate=0.5)
    assert shadow_work.take is take and llm_engine.LLMEngine.schedule_step is step
    reasons = out["reasons"]
    assert reasons["took chunks"] > 0 and sum(reasons.values()) > reasons["took chunks"]
    assert out["filled_over_b"] and max(out["filled_over_b"]) <= 1.10
    assert set(out["iteration_over_T"]) == {"Qwen2.5-7B", "Llama-3.1-70B"}
    assert sum(out["branches"].values()) >= sum(len(v) for v in out["iteration_over_T"].values())
    costs = budget_check.chunk_costs()
    for model, by_context in costs.items():
        values = list(by_context.values())
        assert all(b > a > 0 for a, b in zip(values, values[1:])), (model, by_context)
