"""Server-free parts of shadowprefill.serve: shadow content, routing, placement over HTTP instances, the
prior learning from idle-ended sessions, Prometheus parsing, config, tokenizer."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shadowprefill.cluster.session import SessionState
from shadowprefill.serve import prometheus as prom
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.manager import Manager
from shadowprefill.serve.metrics import ServeCall, summarize, summarize_by_policy
from shadowprefill.serve.sessions import CHARS_PER_TOKEN, LiveRouter, comparable, extends, shadow_body
from shadowprefill.serve.tokenizer import CHAT_TEMPLATE_JINJA, ByteTokenizer, render_chat
from shadowprefill.serve.upstream import HttpInstance

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
                       ({"models": {"a": ["http://x"]}, "shadow": {"targets": "some"}}, "targets"),
                       ({"models": {"a": ["http://x"]}, "shadow": {"min_switch_prob": 1.5}}, "min_switch_prob"),
                       ({"models": {"a": ["http://x"]}, "session_idle_s": 0}, "session_idle_s")]:
        with pytest.raises(ValueError, match=match):
            ManagerConfig.from_dict(bad)


def test_markov_router_is_deterministic_and_switches_at_rate():
    router = LiveRouter({"type": "markov", "p": 0.3, "seed": 1}, ["a", "b"])
    switches = total = 0
    for s in range(200):
        state = SessionState(f"s{s}", "t")                        # the live session as it is
        for _ in range(5):
            m = router.route(state, None)
            assert m == router.route(state, None)                 # same (session, call) -> same model
            if state.models:
                total += 1
                switches += m != state.models[-1]
            state.models.append(m)
    assert 0.2 < switches / total < 0.4
    req = LiveRouter({"type": "request"}, ["a", "b"])
    assert req.route(SessionState("s", "t"), "b") == "b"
    assert req.route(None, "a") == "a"                            # a stateless call
    with pytest.raises(ValueError, match="not served"):
        req.route(SessionState("s", "t"), "c")


def _manager(**shadow) -> Manager:
    return Manager(ManagerConfig.from_dict({"models": {"a": ["http://h:1"], "b": ["http://h:2"], "c": ["http://h:3"]},
                                            "shadow": shadow, "session_idle_s": 60.0}))


def test_prior_learns_from_idle_ended_sessions_and_picks_the_top1_target():
    mgr = _manager(targets="top1")
    core = mgr.core
    for i in range(6):                                  # finished sessions that went a -> c more than a -> b
        state = core.session(f"s{i}", "t")
        state.models.extend(["a", "c" if i % 3 else "b", "a"])
        state.last_active = 100.0
    busy = core.session("busy", "t")
    busy.models.append("a")
    busy.calls_in_flight, busy.last_active = 1, 100.0
    fresh = core.session("fresh", "t")
    fresh.models.append("a")
    fresh.last_active = 150.0
    assert mgr.end_idle_sessions(now=170.0) == 6        # idle >= 60 s and nothing in flight
    assert set(core.sessions) == {("t", "busy"), ("t", "fresh")}
    probs = mgr.prior.probabilities("", "a", ["b", "c"])
    assert probs["c"] > probs["b"] > 0
    assert core.targets.choose(mgr.prior, "", "a", core.models) == [("c", probs["c"])]
    gate = round((probs["b"] + probs["c"]) / 2, 3)      # the Predictive gate over HTTP, between b and c
    gated = _manager(min_switch_prob=gate)
    assert [m for m, _ in gated.core.targets.choose(mgr.prior, "", "a", ["a", "b", "c"])] == ["c"]


def test_http_placement_prefers_the_instance_holding_the_prefix_unless_it_is_busy():
    """Lowest estimated prefill completion (§3.1) over HTTP: uncached tokens of this prompt (by what the
    manager last sent to each server) plus the uncached tokens of calls sent there and not answered."""
    i0, i1 = HttpInstance("m", "http://h:1", "m", 0), HttpInstance("m", "http://h:2", "m", 1)
    session = SessionState("s", "t")
    rng = random.Random(0)
    history = [rng.randrange(10, 500) for _ in range(400)]
    prompt = history + [rng.randrange(10, 500) for _ in range(40)]
    rate = HttpInstance.prefill_tokens_per_s
    assert i0.estimate_prefill_s(prompt, session) == i1.estimate_prefill_s(prompt, session) == 440 / rate
    i1.holds(session.key, {"prompt": history})
    assert i1.estimate_prefill_s(prompt, session) == pytest.approx(40 / rate)
    assert i1.estimate_prefill_s(prompt, SessionState("s", "other-tenant")) == 440 / rate   # never across tenants
    assert i1.estimate_prefill_s(prompt[:200] + [7] * 240, session) == pytest.approx(240 / rate)
    assert i1.estimate_prefill_s(prompt, session, assume_cached=430) == pytest.approx(10 / rate)
    text = "x" * 800
    i0.holds(session.key, {"prompt": text[:400]})
    assert i0.estimate_prefill_s(text, session) == pytest.approx(400 / CHARS_PER_TOKEN / rate)
    msgs = [{"role": "user", "content": "q" * 80}]
    i0.holds(session.key, {"messages": msgs + [{"role": "assistant", "content": "a" * 40}]})
    nxt = msgs + [{"role": "assistant", "content": "a" * 40}, {"role": "user", "content": "r" * 20}]
    seq, per = comparable(nxt)
    assert per == CHARS_PER_TOKEN and i0.estimate_prefill_s(nxt, session) == pytest.approx(
        (len(seq) - len(comparable(nxt[:2])[0])) / per / rate)

    class Ticket:                                       # what submit_call reads of a CallTicket
        def __init__(self, rid, prompt):
            self.request_id, self.prompt, self.session = rid, prompt, SessionState("o", "t")
            self.payload = ("/v1/completions", {"prompt": prompt}, {})

    import httpx
    i1.client = httpx.Client()
    try:
        busy = Ticket("o#0", [1] * 3000)
        req = i1.submit_call(busy)
        assert str(req.url) == "http://h:2/v1/completions" and json.loads(req.content)["model"] == "m"
        assert i1.estimate_prefill_s(prompt, session) == pytest.approx((3000 + 40) / rate)
        i1.answered(busy)
        assert i1.estimate_prefill_s(prompt, session) == pytest.approx(40 / rate)
    finally:
        i1.client.close()


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
