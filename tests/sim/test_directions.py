"""The paper's qualitative results hold on a small seeded study (§5.2, Table 2, FCFS admission).

One instance per model of the paper's pair (Q2.5-7B / L3.1-70B), normal traffic at ρ = 0.7 of the shipped
capacities, a session rate high enough for tens of switch calls per run, short runs
(`bench/direction_seeds.py` holds the sizes). Per workload family the same seeds run No Shadow,
Host Tier, Harvest-SLO, Harvest-SLO+Host, Oracle+Host and Eager; each effect is the mean over the seeds of a per-run
(paired: same seed, same calls) quantity and must exceed its standard error:

- Harvest-SLO+Host cuts switch-call latency, switch-call TTFT and token cost against No Shadow;
- Oracle+Host bounds it (its switch-call latency reduction minus Harvest-SLO+Host's);
- the host tier matters (Harvest-SLO+Host minus Harvest-SLO), on GHCP's long contexts as on FusionBench;
- Eager, shadow work as normal-priority requests in the FCFS queue, slows LLM calls;
- normal-traffic SLO attainment: the shadow work costs at most 0.5 pp (Harvest-SLO+Host against Host Tier,
  the same cluster without shadows), and on FusionBench Harvest-SLO+Host against No Shadow too.

Why not against No Shadow on GHCP: one instance per model at this session rate is saturated by GHCP's
30K-60K-token switch calls (No Shadow: Llama-3.1-70B meets no normal SLO, Qwen2.5-7B about half), and there
the host tier alone moves normal attainment by about -0.9 pp: routed calls finish earlier, so their
sessions' next long prefills land on the measured window's normal traffic. That is the host tier shifting
load in time, not shadow work spending more than its slack; the paper's regime (4 instances, its session
rate) is the README's paper-length GHCP study, which reports the change against No Shadow.

How the sizes and seeds were checked: `python bench/direction_seeds.py --seeds 0-11` runs the same study
on twelve seeds and prints each effect's mean ± SE over all of them beside the test's seeds (README,
"Tests of direction").
"""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import direction_seeds  # noqa: E402

SIGNED = ("switch latency cut", "switch TTFT cut", "token cost cut", "oracle bound", "host tier gain",
          "eager LLM-call slowdown")


@pytest.fixture(scope="module", params=sorted(direction_seeds.SIZES))
def study(request):
    workload = request.param
    summaries = direction_seeds.run(workload)
    assert len(summaries) == len(direction_seeds.SIZES[workload][3])
    assert all(s["no-shadow"]["num_switch_calls"] >= 8 for s in summaries)
    return workload, direction_seeds.effects(summaries), summaries


@pytest.mark.parametrize("effect", SIGNED)
def test_effect_holds_by_more_than_its_standard_error(study, effect):
    workload, found, _ = study
    m, se = found[effect]
    assert m > se > 0, f"{workload}, {effect}: mean {m:.2f} not above its SE {se:.2f}"


def test_shadow_work_costs_normal_traffic_at_most_half_a_point(study):
    workload, found, _ = study
    m, se = found["normal SLO cost of shadows (pp)"]
    assert m >= -0.5, f"{workload}: normal SLO attainment, Harvest-SLO+Host - Host Tier: {m:.2f} ± {se:.2f} pp"
    if workload == "fusionbench":
        m, se = found["normal SLO change (pp)"]
        assert m >= -0.5, f"{workload}: normal SLO attainment change vs No Shadow {m:.2f} ± {se:.2f} pp"


def test_filled_iterations_stay_within_their_budget(study):
    """Alg. 1 line 10: an iteration given shadow chunks under a whole-iteration budget b (SLO-slack or idle
    branch) runs no longer than b, up to t̂'s error (the simulated executor is the latency model t̂ learns
    online). The bound that a t̂ which under-predicts breaks: before wave 2, RLS wound up and these
    iterations ran a median 1.9x their b on GHCP (README, "The GHCP regression, isolated")."""
    workload, _, runs = study
    for summaries in runs:
        for policy in ("harvest-slo", "harvest-slo+host"):
            s = summaries[policy]
            assert s["shadow_tokens"] > 0
            assert s["shadow_budget_ratio_max"] <= 1.10, (workload, policy, s["shadow_budget_ratio_max"])
            assert s["shadow_over_budget_fraction"] <= 0.10, (workload, policy, s["shadow_over_budget_fraction"])
