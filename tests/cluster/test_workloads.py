"""Session generators vs the paper's Table 1, session semantics, JSONL round trip, Azure normal traffic."""
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from shadowprefill.cluster import traces
from shadowprefill.cluster.traces import (AZURE_LENGTHS, load_azure_trace, load_sessions, normal_traffic,
                                          replay_trace, save_sessions, session_from_dict)
from shadowprefill.cluster.workloads import (FIRST_TOKEN_ID, TABLE1, VOCAB_LIMIT, WORKLOADS, Call, Session,
                                             generate_sessions, session_stats)

AZURE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "azure-llm-2023"
needs_azure = pytest.mark.skipif(not AZURE.is_dir(), reason=f"Azure LLM traces not found at {AZURE}")
PAIR = ("Qwen2.5-7B", "Llama-3.1-70B")


# Tolerances against Table 1 (2,000 sessions; 700 for SWE-bench's ~42-call sessions): switch rate +-0.02
# absolute, switches per session +-8%, mean prompt +-12%, p99 prompt +-25% (a tail statistic; seed-to-seed
# spread at this size is about +-15%).
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_generated_statistics_match_table1(workload):
    sessions = generate_sessions(workload, PAIR, num_sessions=700 if workload == "swe-bench" else 2000, seed=0)
    st, row = session_stats(sessions), TABLE1[workload]
    assert abs(st["switch_rate"] - row.switch_rate) <= 0.02
    assert st["switches_per_session"] == pytest.approx(row.switches_per_session, rel=0.08)
    assert st["prompt_mean"] == pytest.approx(row.prompt_mean, rel=0.12)
    assert st["prompt_p99"] == pytest.approx(row.prompt_p99, rel=0.25)
    # an unbounded per-model cache hits at least what the paper's simulator measured with eviction
    assert st["hit_rate"] > row.hit_rate - 0.03 and st["switch_hit_rate"] > row.switch_hit_rate - 0.03


def test_tool_outputs_and_gaps_follow_the_paper():
    spec = dataclasses.replace(WORKLOADS["fusionbench"], tool_prob=1.0, step=(1, 0.0))
    sessions = generate_sessions(spec, PAIR, num_sessions=300, seed=1)
    later = [(c.new_input_tokens - 1, c.gap_s) for s in sessions for c in s.calls[1:] if c.append_only]
    tools, gaps = np.array(later).T
    assert np.median(tools) == pytest.approx(1000, rel=0.05)                 # lognormal, median 1K tokens
    assert np.median(gaps) == pytest.approx(2.0, rel=0.05)                   # lognormal, median 2 s
    assert all(s.calls[0].gap_s == 0 for s in sessions)


def test_sessions_are_append_only_with_deterministic_ids():
    a = generate_sessions("router-r1", PAIR, num_sessions=20, seed=5)
    b = generate_sessions("router-r1", PAIR, num_sessions=20, seed=5)
    c = generate_sessions("router-r1", PAIR, num_sessions=20, seed=6)
    for s, t in zip(a, b):
        assert s == t and s.models == t.models
        assert all(set(m) <= set(PAIR) for m in [s.models])
        for k in range(1, len(s.calls)):
            prev = np.concatenate([s.prompt_ids(k - 1), s.output_ids(k - 1)])
            prompt = s.prompt_ids(k)
            assert len(prompt) == s.prompt_len(k) and np.array_equal(prompt, t.prompt_ids(k))
            assert np.array_equal(prompt[:len(prev)], prev)                   # extends the history
            assert prompt.min() >= FIRST_TOKEN_ID and prompt.max() < VOCAB_LIMIT
    assert not np.array_equal(a[0].prompt_ids(0), c[0].prompt_ids(0))


def test_compaction_keeps_the_initial_context_only():
    spec = dataclasses.replace(WORKLOADS["ghcp-coding"], context_window=40000)
    sessions = generate_sessions(spec, PAIR, num_sessions=200, seed=2)
    compacted = [(s, k) for s in sessions for k, c in enumerate(s.calls) if not c.append_only]
    assert compacted
    for s, k in compacted[:20]:
        prompt = s.prompt_ids(k)
        assert s.prompt_len(k) <= 40000 + 20000                              # window + one step's input
        assert np.array_equal(prompt[:s.calls[k].prefix_tokens], s.prompt_ids(0))


def test_prompt_ids_use_actual_outputs():
    s = generate_sessions("fusionbench", PAIR, num_sessions=1, seed=3)[0]
    assert len(s.calls) >= 2
    actual = [np.arange(c.output_tokens) + 100 for c in s.calls]
    p1 = s.prompt_ids(1, outputs=actual)
    start = s.prompt_len(0)
    assert np.array_equal(p1[start:start + s.calls[0].output_tokens], actual[0])


def _reference_hits(sessions):
    """Token-weighted hit rates by brute force on token ids: each model keeps its last prompt + output."""
    hit = tot = sw_hit = sw_tot = 0
    for s in sessions:
        last = {}
        for k, c in enumerate(s.calls):
            prompt = s.prompt_ids(k)
            cached = 0
            if c.model in last:
                seq = last[c.model]
                n = min(len(seq), len(prompt) - 1)
                diff = np.nonzero(seq[:n] != prompt[:n])[0]
                cached = int(diff[0]) if len(diff) else n
            hit, tot = hit + cached, tot + len(prompt)
            if k and c.model != s.calls[k - 1].model:
                sw_hit, sw_tot = sw_hit + cached, sw_tot + len(prompt)
            last[c.model] = np.concatenate([prompt, s.output_ids(k)])
    return hit / tot, sw_hit / sw_tot


def test_stats_hit_rates_match_brute_force_on_token_ids():
    spec = dataclasses.replace(WORKLOADS["fusionbench"], context_window=12000)   # include compactions
    sessions = generate_sessions(spec, PAIR, num_sessions=40, seed=4)
    assert any(not c.append_only for s in sessions for c in s.calls)
    st = session_stats(sessions)
    ref_all, ref_switch = _reference_hits(sessions)
    assert st["hit_rate"] == pytest.approx(ref_all, abs=1e-12)
    assert st["switch_hit_rate"] == pytest.approx(ref_switch, abs=1e-12)


def test_duration_mode_is_poisson_at_the_session_rate():
    sessions = generate_sessions("fusionbench", PAIR, duration_s=20000, seed=7, start_s=100.0, tenants=3)
    arrivals = np.array([s.arrival_s for s in sessions])
    expected = 0.05 * 20000
    assert abs(len(sessions) - expected) < 5 * math.sqrt(expected)
    assert arrivals.min() > 100.0 and arrivals.max() <= 20100.0 and np.all(np.diff(arrivals) > 0)
    assert {s.tenant for s in sessions} == {"tenant0", "tenant1", "tenant2"}
    assert len({s.session_id for s in sessions}) == len(sessions)


def test_generator_and_dataclass_validation():
    with pytest.raises(ValueError, match="exactly one"):
        generate_sessions("fusionbench", PAIR)
    with pytest.raises(ValueError, match="unknown workload"):
        generate_sessions("nope", PAIR, num_sessions=1)
    with pytest.raises(ValueError, match="models"):
        generate_sessions("fusionbench", [], num_sessions=1)
    with pytest.raises(ValueError, match="output_tokens"):
        Call("m", 10, 0)
    with pytest.raises(ValueError, match="gap_s"):
        Call("m", 10, 5, gap_s=-1.0)
    with pytest.raises(ValueError, match="prefix_tokens"):
        Session("s", "t", "x", 0.0, [Call("m", 10, 5), Call("m", 3, 5, prefix_tokens=16)])
    with pytest.raises(ValueError, match="calls"):
        Session("s", "t", "x", 0.0, [])


# ---- JSONL ---------------------------------------------------------------------------------------------
def test_jsonl_round_trip(tmp_path):
    spec = dataclasses.replace(WORKLOADS["ghcp-coding"], context_window=40000)
    sessions = generate_sessions(spec, PAIR, num_sessions=15, seed=8)
    sessions.append(Session("explicit", "acme", "t", 3.0, [Call("m", 3, 2, input_ids=(11, 12, 13)),
                                                           Call("m", 4, 2, gap_s=1.5)]))
    path = tmp_path / "sessions.jsonl"
    save_sessions(path, sessions)
    loaded = load_sessions(path)
    assert loaded == sessions
    for s, t in zip(sessions, loaded):
        for k in range(len(s.calls)):
            assert np.array_equal(s.prompt_ids(k), t.prompt_ids(k))


def test_jsonl_user_format_with_new_input_tokens(tmp_path):
    path = tmp_path / "user.jsonl"
    path.write_text(json.dumps({"session_id": "u1", "arrival_s": 0, "calls": [
        {"model": "Q2.5-7B", "new_input_tokens": 100, "output_tokens": 10},
        {"model": "L3.1-70B", "prompt_tokens": 300, "output_tokens": 20, "gap_s": 2},
        {"model": "L3.1-70B", "new_input_tokens": 50, "prefix_tokens": 40, "output_tokens": 5}]}) + "\n\n")
    (s,) = load_sessions(path)
    assert [s.prompt_len(k) for k in range(3)] == [100, 300, 90]
    assert s.calls[1].new_input_tokens == 190 and s.calls[2].prefix_tokens == 40
    assert s.tenant == "default" and s.token_seed is not None


@pytest.mark.parametrize("line, message", [
    ("{not json", r"user.jsonl:2: invalid JSON"),
    ('{"arrival_s": 0, "calls": []}', r"user.jsonl:2: missing field 'session_id'"),
    ('{"session_id": "a", "arrival_s": 0, "calls": []}', r"user.jsonl:2.calls: expected a non-empty list"),
    ('{"session_id": "a", "arrival_s": -1, "calls": [{"model": "m", "prompt_tokens": 5, "output_tokens": 1}]}',
     r"user.jsonl:2.arrival_s: expected a finite number >= 0"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 5, "output_tokens": 0}]}',
     r"user.jsonl:2.calls\[0\].output_tokens: must be >= 1"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 5, "output_tokens": 2}, '
     '{"model": "m", "prompt_tokens": 6, "output_tokens": 2}]}',
     r"user.jsonl:2.calls\[1\].prompt_tokens: 6 is shorter than the kept prefix of 7 tokens"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 5, "output_tokens": 2}, '
     '{"model": "m", "prompt_tokens": 9, "prefix_tokens": 8, "output_tokens": 2}]}',
     r"user.jsonl:2.calls\[1\].prefix_tokens: 8 exceeds the 7 tokens of history"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 5, "new_input_tokens": 5, '
     '"output_tokens": 2}]}', r"user.jsonl:2.calls\[0\]: give exactly one of"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"modle": "m", "prompt_tokens": 5, "output_tokens": 2}]}',
     r"user.jsonl:2.calls\[0\]: unknown field\(s\) \['modle'\]"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 2, "output_tokens": 2, '
     '"input_ids": [1]}]}', r"user.jsonl:2.calls\[0\].input_ids: 1 ids for 2 new input tokens"),
    ('{"session_id": "s0", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 2, "output_tokens": 2}]}',
     r"user.jsonl:2.session_id: duplicate session id 's0'"),
    ('{"session_id": "a", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 2.5, "output_tokens": 2}]}',
     r"user.jsonl:2.calls\[0\].prompt_tokens: expected an integer"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, line, message):
    good = '{"session_id": "s0", "arrival_s": 0, "calls": [{"model": "m", "prompt_tokens": 3, "output_tokens": 1}]}'
    path = tmp_path / "user.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_sessions(path)


def test_session_from_dict_rejects_non_objects():
    with pytest.raises(ValueError, match="expected a JSON object"):
        session_from_dict([1, 2])


# ---- normal traffic -----------------------------------------------------------------------------------
def test_normal_traffic_rate_and_lengths():
    reqs = normal_traffic(4.0, 3000.0, seed=1, start_s=50.0)
    assert abs(len(reqs) - 12000) < 5 * math.sqrt(12000)
    ins = np.array([r.prompt_tokens for r in reqs])
    outs = np.array([r.output_tokens for r in reqs])
    assert ins.mean() == pytest.approx(1154, rel=0.05) and outs.mean() == pytest.approx(211, rel=0.05)
    assert ins.max() <= 8192 and outs.max() <= 1024 and ins.min() >= 1
    assert np.median(ins) == pytest.approx(1020, rel=0.05)
    assert min(r.arrival_s for r in reqs) >= 50.0
    assert len(reqs[0].prompt_ids()) == reqs[0].prompt_tokens
    code = normal_traffic(4.0, 3000.0, seed=1, lengths="code", process="gamma")
    gaps = np.diff([r.arrival_s for r in code])
    assert gaps.std() / gaps.mean() > 3.0                                    # bursty like the code trace
    assert np.mean([r.output_tokens for r in code]) == pytest.approx(27.8, rel=0.1)
    with pytest.raises(ValueError, match="lengths"):
        normal_traffic(1.0, 10.0, lengths="chat")
    with pytest.raises(ValueError, match="process"):
        normal_traffic(1.0, 10.0, process="uniform")


@needs_azure
@pytest.mark.parametrize("kind", ["conv", "code"])
def test_length_tables_are_the_trace_percentiles(kind):
    records = load_azure_trace(AZURE / f"AzureLLMInferenceTrace_{kind}.csv")
    assert len(records) == {"conv": 19366, "code": 8819}[kind]
    assert records[0].time_s == 0 and all(a.time_s <= b.time_s for a, b in zip(records, records[1:]))
    assert max(r.prompt_tokens for r in records) <= 8192 and max(r.output_tokens for r in records) <= 1024
    assert traces.fit_length_quantiles(records) == AZURE_LENGTHS[kind]
    replay = replay_trace(records, rate=10.0, duration_s=7200.0, start_s=5.0)
    assert len(replay) == pytest.approx(72000, rel=0.02)                      # rescaled and looped
    assert replay[0].arrival_s == 5.0 and replay[-1].arrival_s < 7205.0
    assert len(replay_trace(records)) == len(records)


def test_load_azure_trace_errors(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n")
    with pytest.raises(ValueError, match="missing column"):
        load_azure_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,x\n")
    with pytest.raises(ValueError, match=r"t.csv:2: GeneratedTokens 'x' is not an integer"):
        load_azure_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,20000,44\n"
                    "2023-11-16 18:15:45.00,10,2000\n")
    recs = load_azure_trace(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in recs] == [(10, 1024), (8192, 44)]
    assert recs[1].time_s == pytest.approx(1.68)
    replay = replay_trace(recs, rate=2.0, duration_s=10.0)
    assert [r.arrival_s for r in replay] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5,
                                                           5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5, 9.0, 9.5])
    assert [r.prompt_tokens for r in replay[:4]] == [10, 8192, 10, 8192]
    single = [recs[0]]
    assert len(replay_trace(single)) == 1
    with pytest.raises(ValueError, match="two distinct timestamps"):
        replay_trace(single, rate=1.0)


def test_token_list_is_deterministic_in_range_and_equals_token_ids():
    from shadowprefill.cluster.workloads import FIRST_TOKEN_ID, VOCAB_LIMIT, token_ids, token_list
    from shadowprefill.shadow.jobs import CheckedTokenIds, check_token_ids
    for n in (0, 1, 3, 4, 5, 2000, (1 << 18) + 37):          # the last wraps around the shared pool
        a = token_list(123456789, 7, 1, n)
        assert type(a) is CheckedTokenIds and len(a) == n and a == token_list(123456789, 7, 1, n)
        assert all(type(t) is int and FIRST_TOKEN_ID <= t < VOCAB_LIMIT for t in a)
        arr = token_ids(123456789, 7, 1, n)
        assert arr.dtype == np.int32 and arr.tolist() == a
        got = check_token_ids("x", a)
        assert got == a and type(got) is list and got is not a     # a plain copy, no per-id check


def test_token_list_sequences_differ_from_their_first_id():
    """A prefix cache sees only equal prefixes: sequences of other (seed, call, kind) must differ at once."""
    from shadowprefill.cluster.workloads import token_list
    firsts = {}
    for seed in range(40):
        for k in range(25):
            for kind in (0, 1):
                head = tuple(token_list(seed * 2**40 + 5, k, kind, 4))
                assert head not in firsts, (seed, k, kind, firsts.get(head))
                firsts[head] = (seed, k, kind)
    bodies = {tuple(token_list(s, 0, 0, 64)[4:20]) for s in range(200)}
    assert len(bodies) > 190                                       # the pool offsets spread too


def test_token_list_rejects_bad_arguments():
    from shadowprefill.cluster.workloads import token_list
    for args in ((-1, 0, 0, 4), (1, -2, 0, 4), (1, 0, 0, -1), (1.5, 0, 0, 4), (True, 0, 0, 4)):
        with pytest.raises(ValueError):
            token_list(*args)
