"""The `make demo` workload on a reduced size: every call completes under both policies, and shadow
prefill (Harvest-SLO) serves switch calls from cache where no shadow cannot."""
from shadowprefill.engine_demo import DemoConfig, make_sessions, run_policy


def test_demo_sessions_are_routed_and_in_vocabulary():
    cfg = DemoConfig(sessions=4, calls=5)
    sessions = make_sessions(cfg, vocab=512)
    assert len(sessions) == 4 and all(len(s.calls) == 5 for s in sessions)
    assert {c.model for s in sessions for c in s.calls} == {"small", "large"}
    for s in sessions:
        outputs = [[5] * c.output_tokens for c in s.calls]  # the demo feeds back the models' real outputs
        ids = s.prompt_ids(4, outputs=outputs)
        assert ids.min() >= 3 and ids.max() < 512


def test_demo_shadow_raises_switch_hit_rate():
    cfg = DemoConfig(sessions=3, calls=4, first_input=256, tool_output=48, output_tokens=4, gap_s=0.3,
                     normal_rate=2.0, normal_prompt=64, normal_output=2, seed=3)
    base = run_policy("none", cfg)
    shadow = run_policy("harvest-slo", cfg)
    assert base["num_calls"] == shadow["num_calls"] == 12
    assert base["num_switch_calls"] == shadow["num_switch_calls"] > 0
    assert base["shadow_tokens"] == 0
    assert shadow["shadow_tokens"] > 0 and shadow["shadow_tokens_used"] > 0
    assert shadow["shadow_tokens_used"] + shadow["shadow_tokens_wasted"] <= shadow["shadow_tokens"] + 16
    # a switch call after a 0.3 s tool gap finds the history (first call's prompt at least) on the target
    assert shadow["switch_hit_rate"] > base["switch_hit_rate"]
