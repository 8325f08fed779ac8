"""Server-free parts of shadowprefill.serve: shadow content, routing, Prometheus parsing, config, tokenizer."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from shadowprefill.serve import prometheus as prom
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.metrics import ServeCall, summarize, summarize_by_policy
from shadowprefill.serve.sessions import LiveRouter, NextModelPrior, SessionState, extends, shadow_body
from shadowprefill.serve.tokenizer import CHAT_TEMPLATE_JINJA, ByteTokenizer, render_chat

ROOT = Path(__file__).resolve().parents[2]


def test_shadow_body_append_only_and_rewritten():
    ids = [11, 12, 13]
    assert shadow_body("completions", ids, [20, 21], True) == {"prompt": [11, 12, 13, 20, 21]}
    assert shadow_body("completions", ids, [20, 21], False) == {"prompt": [11, 12, 13]}
    assert shadow_body("completions", "abc", "de", True) == {"prompt": "abcde"}
    msgs = [{"role": "user", "content": "hi"}]
    body = shadow_body("chat", msgs, "yo", True)
    assert body["messages"] == msgs + [{"role": "assistant", "content": "yo"}]
    assert body["continue_final_message"] and not body["add_generation_prompt"]


def test_extends_detects_rewrites():
    assert extends([1, 2, 3, 4, 5], [1, 2], [3]) and not extends([1, 9, 3], [1, 2], [3])
    assert extends("abcdef", "ab", "cd") and not extends("abXdef", "ab", "cd")
    m = [{"role": "user", "content": "a"}]
    nxt = m + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert extends(nxt, m, "b") and not extends(nxt, m, "other")
    assert extends([1], None, None)


def test_chat_prefix_of_next_turn():
    m = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    prefix = render_chat(m + [{"role": "assistant", "content": "a"}], False, True)
    nxt = render_chat(m + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}])
    assert nxt.startswith(prefix) and len(nxt) > len(prefix)
    with pytest.raises(ValueError, match="messages"):
        render_chat([])


def test_harness_chat_template_matches_builtin():
    text = (ROOT / "tests/vllm_harness/train_tokenizer.py").read_text()
    assert repr(CHAT_TEMPLATE_JINJA)[1:-1].replace("\\'", "'") in text.replace('"\n    "', "")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512)
    s = "héllo wörld"
    ids = tok.encode(s)
    assert all(3 <= t < 259 for t in ids) and tok.decode(ids) == s
    assert tok.decode(ids + [0, 1, 2, 300, 511]) == s             # non-byte ids decode to nothing
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100)


def test_prometheus_parse_sums_series_and_reads_block_size():
    text = ('# HELP x\nvllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0\n'
            'vllm:cache_config_info{block_size="32",engine="0"} 1.0\n')
    parsed = prom.parse_metrics(text)
    assert prom.metric_sum(parsed, prom.WAITING) == 5.0
    assert prom.block_size_of(parsed) == 32
    assert prom.metric_sum(parsed, prom.RUNNING, default=0.0) == 0.0
    own = prom.parse_metrics(prom.format_metric(prom.WAITING, 7, labels={"model_name": "t"}))
    assert prom.metric_sum(own, prom.WAITING) == 7.0


def test_config_validation():
    cfg = ManagerConfig.from_dict({"models": {"a": ["http://h:1"], "b": [{"url": "http://h:2/",
                                                                          "served_model_name": "B"}]}})
    assert cfg.models["b"][0].url == "http://h:2" and cfg.models["b"][0].served_model_name == "B"
    assert cfg.models["a"][0].served_model_name == "a"
    for bad, match in [({"models": {}}, "models"), ({"models": {"a": ["ftp://x"]}}, "endpoint"),
                       ({"models": {"a": ["http://x"]}, "bogus": 1}, "unknown"),
                       ({"models": {"a": ["http://x"]}, "router": {"type": "oracle"}}, "router"),
                       ({"models": {"a": ["http://x"]}, "shadow": {"targets": "some"}}, "targets")]:
        with pytest.raises(ValueError, match=match):
            ManagerConfig.from_dict(bad)


def test_markov_router_is_deterministic_and_switches_at_rate():
    router = LiveRouter({"type": "markov", "p": 0.3, "seed": 1}, ["a", "b"])
    switches = total = 0
    for s in range(200):
        state = SessionState("t", f"s{s}")
        for _ in range(5):
            m = router.route(state, None)
            assert m == router.route(state, None)                 # same (session, call) -> same model
            if state.history:
                total += 1
                switches += m != state.history[-1]
            state.history.append(m)
    assert 0.2 < switches / total < 0.4
    req = LiveRouter({"type": "request"}, ["a", "b"])
    assert req.route(SessionState("t", "s"), "b") == "b"
    with pytest.raises(ValueError, match="not served"):
        req.route(SessionState("t", "s"), "c")


def test_next_model_prior_ranks_by_counts():
    prior = NextModelPrior()
    for _ in range(3):
        prior.observe("a", "c")
    prior.observe("a", "b")
    assert prior.rank("a", ["b", "c", "d"]) == ["c", "b", "d"]


def test_summary_keys_and_hit_rates():
    rng = random.Random(0)
    calls = []
    for i in range(6):
        calls.append(ServeCall(f"s{i % 2}", i, "t", "m", "u", is_switch=i % 3 == 0, policy="harvest",
                               arrival=0.0, first_token=0.1 * (i + 1), finish=1.0 + i, prompt_tokens=100,
                               cached_tokens=rng.randrange(0, 100), output_tokens=5, stream=True))
    s = summarize(calls)
    switch = [c for c in calls if c.is_switch]
    assert s["num_switch_calls"] == len(switch) == 2
    assert s["switch_hit_rate"] == sum(c.cached_tokens for c in switch) / 200
    assert s["switch_call_ttft_mean_s"] == pytest.approx(sum(c.ttft for c in switch) / 2)
    assert s["num_sessions"] == 2
    failed = ServeCall("x", 0, "t", "m", "u", False, "no-shadow", 0.0, None, 1.0, None, None, None, False, 503, "down")
    by = summarize_by_policy(calls + [failed])
    assert by["no-shadow"]["num_calls"] == 0 and by["no-shadow"]["num_failed_calls"] == 1
