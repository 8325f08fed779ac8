"""bench/budget_check.py on a short run: it classifies every iteration that had shadow work queued, finds the
filled iterations within their budget, counts per model what the engines count, and leaves the engine as it
found it."""
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
    # the per-model table: shares are shares, and the chunk tokens it saw admitted in the measured window add up
    # to the engines' own count of shadow tokens computed in it (up to the chunks in flight at its two ends)
    rows = {r["model"]: r for r in out["by_model"]}
    assert set(rows) <= {"Qwen2.5-7B", "Llama-3.1-70B"} and rows
    seen = 0.0
    for r in rows.values():
        assert r["iterations_with_work"] > 0 and abs(sum(r["branch_share"].values()) - 1.0) < 1e-9
        assert 0.0 <= r["took_chunks"] <= 1.0 and r["tpot_slo_ms"] > 0 and r["front_chunk_ms_median"] > 0
        if r["slo_room_ms_median"] is not None:
            assert 0.0 <= r["slo_front_chunk_fits"] <= 1.0 and 0.0 < r["slo_base_over_T_median"]
        seen += r["shadow_tok_per_s_per_instance"] * 30.0 * r["instances"]
        assert r["run_shadow_tokens"] >= r["run_shadow_tokens_used"] >= 0 and r["run_shadow_pages"] >= 0
        assert r["run_shadow_pages_lost"] is None or 0.0 <= r["run_shadow_pages_lost"] <= 1.0
    assert out["shadow_tokens_window"] > 0
    assert abs(seen - out["shadow_tokens_window"]) <= 0.05 * out["shadow_tokens_window"] + 4096, \
        (seen, out["shadow_tokens_window"])
    costs = budget_check.chunk_costs()
    for model, by_context in costs.items():
        values = list(by_context.values())
        assert all(b > a > 0 for a, b in zip(values, values[1:])), (model, by_context)


def test_block_steps_follow_the_query_rows():
    """The FA3 model rounds a partial 128-row query block up, so a chunk's cost steps every 128 / rows tokens:
    largest for MHA Gemma-7B (1 row per token), none where a step is at most a page (>= 8 rows, 16 tokens)."""
    steps = budget_check.block_steps()
    rows = {m: r for m, (r, _) in steps.items()}
    assert rows["Gemma-7B"] == 1 and rows["Gemma-2-9B"] == 2 and rows["Llama-3.1-70B"] == 8
    worst = {m: max(c for c, _ in by_ctx.values()) for m, (_, by_ctx) in steps.items()}
    assert all(w >= 1.0 - 1e-9 for w in worst.values())
    assert max(worst, key=worst.get) == "Gemma-7B" and worst["Gemma-7B"] > 1.1
    assert all(abs(worst[m] - 1.0) < 1e-9 for m in worst if rows[m] >= 8)
    for m, (_, by_ctx) in steps.items():       # the step weighs more at longer cached contexts
        assert by_ctx[40960][0] >= by_ctx[16384][0] - 1e-9, m
