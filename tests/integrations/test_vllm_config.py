"""SHADOWPREFILL_VLLM parsing and the stats-file tail (the parts of the vLLM integration that need no vLLM)."""
import json

import pytest

from shadowprefill.integrations.vllm.config import ENV_VAR, ShadowSchedulerConfig
from shadowprefill.integrations.vllm.metrics import StatsTail
from shadowprefill.integrations.vllm.stats import StepStatsWriter, read_stats


def from_env(value):
    return ShadowSchedulerConfig.from_env({ENV_VAR: value})


def test_defaults_are_the_papers():
    c = from_env("")
    assert (c.shadow_priority, c.beta, c.margin, c.n_min, c.shadow_fraction, c.cold_age_s) == (1000, 0.5, 0.1, 256,
                                                                                                0.25, 5.0)
    assert c.tpot_slo_s is None and c.ttft_slo_s is None and c.delta is None and c.policy == "harvest-slo"
    assert ShadowSchedulerConfig.from_env({}) == c


def test_json_object_and_file(tmp_path):
    d = {"shadow_priority": 500, "tpot_slo_s": 0.05, "n_min": 32, "stats_path": str(tmp_path / "s.jsonl")}
    assert from_env(json.dumps(d)) == ShadowSchedulerConfig(**d)
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(d))
    assert from_env(str(f)) == ShadowSchedulerConfig(**d)


@pytest.mark.parametrize("raw, named", [
    ('{"shadow_prio": 3}', "shadow_prio"),
    ('{"beta": -1}', "beta"),
    ('{"beta": "x"}', "beta"),
    ('{"tpot_slo_s": 0}', "tpot_slo_s"),
    ('{"ttft_slo_s": true}', "ttft_slo_s"),
    ('{"n_min": 0}', "n_min"),
    ('{"n_min": 2.5}', "n_min"),
    ('{"shadow_fraction": 1.5}', "shadow_fraction"),
    ('{"margin": 1}', "margin"),
    ('{"delta": -0.1}', "delta"),
    ('{"policy": "eager"}', "policy"),
    ('{"shadow_priority": 0}', "routed_priority"),
    ('{"cold_age_s": NaN}', "cold_age_s"),
    ('{"warmup_steps": -1}', "warmup_steps"),
    ('{"stats_path": "/no/such/dir/s.jsonl"}', "stats_path"),
    ('[1, 2]', ENV_VAR),
    ('{"beta": ', "invalid JSON"),
    ("/no/such/file.json", "not a JSON object"),
])
def test_bad_keys_and_values_name_the_culprit(raw, named):
    with pytest.raises(ValueError, match=named):
        from_env(raw)


def test_stats_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    tail = StatsTail(str(path))
    assert tail.read() == []                                 # no file yet
    w = StepStatsWriter(str(path))
    w.write({"step": 1, "shadow_tokens": 64})
    assert tail.read() == [{"step": 1, "shadow_tokens": 64}]
    with open(path, "a") as f:                               # a half-written line is kept for later
        f.write('{"step": 2, "shad')
    assert tail.read() == []
    with open(path, "a") as f:
        f.write('ow_tokens": 32}\n')
    assert tail.read() == [{"step": 2, "shadow_tokens": 32}]
    w.close()
    assert [r["step"] for r in read_stats(path)] == [1, 2]
