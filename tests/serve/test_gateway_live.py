"""The live gateway over built-in servers: serve-engine's KV events feed the manager's registry, `auto`
decisions, the decision header / endpoints / metrics, tenancy, faults, and 400s naming the field."""
import json
import random
import socket
import time

import httpx
import pytest

from shadowprefill.serve.app_runner import AppThread
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.engine_server import make_engine_server
from shadowprefill.serve.frontdoor import MANAGER_KEY, make_manager_app

BS = 16


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids(rng, n):
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet():
    """`small` (tiny, publishing KV events to the manager) and `large` (tiny_large, no events)."""
    ep, rep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    small = AppThread(make_engine_server("tiny", model_name="tiny", num_blocks=64,
                                         kv_events={"endpoint": ep, "replay_endpoint": rep, "topic": "kv"}).app).start()
    large = AppThread(make_engine_server("tiny_large", model_name="tiny_large").app).start()
    config = ManagerConfig.from_dict({
        "models": {"small": [{"url": small.url, "served_model_name": "tiny",
                              "kv_events": {"endpoint": ep, "replay_endpoint": rep, "topic": "kv"}}],
                   "large": [{"url": large.url, "served_model_name": "tiny_large"}]},
        "api_keys": {"key-a": "tenant-a", "key-b": "tenant-b"}, "shadow": {"enabled": False},
        "gateway": {"models": {"small": {"quality": 0.7, "price_in": 0.1, "price_out": 0.4},
                               "large": {"quality": 0.9, "price_in": 1.0, "price_out": 4.0}}}})
    assert config.tenant_cache_salt is True                    # > 1 tenant: per-tenant salt by default
    mgr = AppThread(lambda: make_manager_app(config)).start()
    clients = {t: httpx.Client(base_url=mgr.url, timeout=120, headers={"Authorization": f"Bearer key-{t}"})
               for t in "ab"}
    time.sleep(0.3)
    yield mgr.app[MANAGER_KEY], clients, small, large
    for c in clients.values():
        c.close()
    mgr.stop()
    large.stop()
    small.stop()


def call(client, model, prompt, session, headers=None, **extra):
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2, **extra},
                    headers={"X-Session-Id": session, **(headers or {})})
    assert r.status_code == 200, r.text
    dec = dict(kv.split("=", 1) for kv in r.headers["X-Gateway-Decision"].split("; "))
    return r.json(), dec


def wait_for(pred, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and not pred():
        time.sleep(0.02)
    return pred()


def test_engine_events_feed_the_registry_and_predict(fleet):
    mgr, clients, small, _ = fleet
    rng = random.Random(0)
    prompt = ids(rng, 200)
    _, dec = call(clients["a"], "small", prompt, "s1")
    assert dec["source"] == "events" and dec["action"] == "reprefill"
    inst = mgr.instances["small"][0]
    assert wait_for(lambda: inst.view.cached_tokens("tenant-a", prompt) == 192)      # whole pages, within 2 s
    assert inst.view.cached_tokens("tenant-b", prompt) == 0
    body, dec2 = call(clients["a"], "small", prompt + ids(rng, 30), "s1")
    reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert dec2["action"] == "reuse" and int(dec2["predicted_cached_tokens"]) == reported >= 192
    # tenant b, same prompt: nothing predicted, nothing reported beyond one block
    body_b, dec_b = call(clients["b"], "small", prompt, "s1")
    assert int(dec_b["predicted_cached_tokens"]) == 0
    assert body_b["usage"]["prompt_tokens_details"]["cached_tokens"] < BS
    assert [d["tenant"] for d in clients["b"].get("/manager/decisions").json()] == ["tenant-b"]
    rec = clients["a"].get("/manager/decisions").json()[-1]
    assert rec["reported_cached_tokens"] == reported and rec["predicted_cached_tokens"] == reported


def test_eviction_is_seen(fleet):
    mgr, clients, _, _ = fleet
    rng = random.Random(1)
    inst = mgr.instances["small"][0]
    prompt = ids(rng, 300)
    call(clients["a"], "small", prompt, "ev")
    assert wait_for(lambda: inst.view.cached_tokens("tenant-a", prompt) == 288)
    for k in range(3):                                          # 64-block pool: fillers evict it
        call(clients["a"], "small", ids(rng, 600), f"fill{k}")
    assert wait_for(lambda: inst.view.cached_tokens("tenant-a", prompt) < 288)
    body, dec = call(clients["a"], "small", prompt + ids(rng, 10), "ev")
    reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert abs(int(dec["predicted_cached_tokens"]) - reported) <= BS
    guess = inst.guess_cached(prompt, mgr.sessions[("tenant-a", "ev")])
    assert guess >= 288 > reported                              # what the guess-based path would have said


def test_auto_decides_model_instance_and_action(fleet):
    mgr, clients, _, large = fleet
    rng = random.Random(2)
    prompt = ids(rng, 160)
    call(clients["a"], "small", prompt, "j")
    assert wait_for(lambda: mgr.instances["small"][0].view.cached_tokens("tenant-a", prompt) == 160)
    _, dec = call(clients["a"], "auto", prompt + ids(rng, 20), "j")
    assert (dec["model"], dec["action"]) == ("small", "reuse")  # warm and cheaper
    assert (dec["model"], dec["instance"]) == (mgr.calls[-1].model, mgr.calls[-1].instance)
    _, dec_q = call(clients["a"], "auto", prompt + ids(rng, 20), "j", headers={"X-Gateway-Min-Quality": "0.8"})
    assert dec_q["model"] == "large" and dec_q["instance"] == large.url and dec_q["source"] == "guess"
    rec = clients["a"].get("/manager/decisions").json()[-1]
    infeasible = {o["action"]: o["reason"] for o in rec["options"] if not o["feasible"]}
    assert {"transfer", "map", "edge_prefill"} <= set(infeasible) and "analytic only" in infeasible["transfer"]
    assert all("Q=" in o["reason"] for o in rec["options"] if o["model_id"] == "small")
    r = clients["a"].post("/v1/completions", json={"model": "auto", "prompt": prompt, "max_tokens": 1},
                          headers={"X-Gateway-Min-Quality": "0.95"})
    assert r.status_code == 400 and "Q=" in r.json()["error"]["message"]
    r = clients["a"].post("/v1/completions", json={"model": "auto", "prompt": prompt, "max_tokens": 1},
                          headers={"X-Gateway-Max-Latency-S": "soon"})
    assert r.status_code == 400 and "X-Gateway-Max-Latency-S" in r.json()["error"]["message"]
    for d in mgr.gateway.decisions:
        assert d["action"] in ("reuse", "shadow", "reprefill")
    text = clients["a"].get("/metrics").text
    for name in ("shadowprefill_gateway_decisions_total{action=\"reuse\"}", "shadowprefill_gateway_registry_entries",
                 "shadowprefill_gateway_cached_tokens_abs_error_count", "shadowprefill_gateway_event_lag_seconds",
                 "shadowprefill_gateway_stale_instances 0.0", 'source="guess"'):
        assert name in text, name
    summary = clients["a"].get("/manager/summary").json()["instances"]
    assert summary[large.url]["source"] == "guess" and summary[mgr.instances["small"][0].url]["source"] == "events"


@pytest.mark.parametrize("field,value", [("n", 1000), ("temperature", "NaN"), ("temperature", 0.7),
                                         ("logprobs", 5), ("top_p", 0.5), ("best_of", 2), ("stop", ["x"])])
def test_serve_engine_rejects_what_it_cannot_do(fleet, field, value):
    _, _, small, _ = fleet
    raw = f'{{"prompt": [11, 12, 13], "max_tokens": 1, "{field}": {json.dumps(value) if value != "NaN" else "NaN"}}}'
    r = httpx.post(small.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    ok = httpx.post(small.url + "/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 1, "temperature": 0,
                                                          "n": 1, "seed": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("field,value", [("n", 3), ("temperature", "NaN"), ("top_p", 1.5), ("logprobs", "x")])
def test_manager_rejects_malformed_sampling(fleet, field, value):
    _, clients, _, _ = fleet
    raw = f'{{"model": "small", "prompt": [11, 12], "{field}": {json.dumps(value) if value != "NaN" else "NaN"}}}'
    r = clients["a"].post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_startup_report_names_models_instances_and_checks(fleet):
    from shadowprefill.serve.cli import startup_report
    mgr, _, small, large = fleet
    config = ManagerConfig.from_dict({**{"models": {
        "small": [{"url": small.url, "served_model_name": "tiny",
                   "kv_events": {"endpoint": "tcp://127.0.0.1:1", "topic": "kv"}}],
        "large": [{"url": large.url, "served_model_name": "tiny_large"}, "http://127.0.0.1:9"]}}})
    text = startup_report(config, "127.0.0.1", 8000, timeout=1.0)
    lines = text.splitlines()
    assert "models ['large', 'small']" in lines[0] and "gateway off" in lines[0]
    small_line = next(x for x in lines if small.url in x)
    assert "reachable" in small_line and "queue metric ok" in small_line
    assert "KV events on tcp://127.0.0.1:1" in small_line
    assert "no /tokenize" in small_line
    assert "no KV events" in next(x for x in lines if large.url in x)
    assert "unreachable now" in next(x for x in lines if "127.0.0.1:9 " in x)


def test_dead_upstream_drops_its_entries(fleet):
    """The last test on `fleet`: it stops the small server."""
    mgr, clients, small, _ = fleet
    inst = mgr.instances["small"][0]
    assert wait_for(lambda: len(mgr.gateway.entries_at(inst.url)) > 0)
    small.stop()
    r = clients["a"].post("/v1/completions", json={"model": "small", "prompt": [11] * 40, "max_tokens": 1},
                          headers={"X-Session-Id": "dead"})
    assert r.status_code == 503 and "small" in r.json()["error"]["message"]
    assert not mgr.gateway.entries_at(inst.url)


def test_missing_queue_metric_holds_shadows():
    """A server without vllm:num_requests_waiting (e.g. another engine) is never read as idle."""
    import asyncio

    from shadowprefill.serve.shadow_dispatch import ShadowDispatcher, ShadowTask
    from shadowprefill.serve.upstream import HttpInstance

    class Resp:
        def __init__(self, text, status=200):
            self.text, self.status_code = text, status

        def raise_for_status(self):
            pass

    class Client:
        def __init__(self, metrics):
            self.metrics, self.posts = metrics, []

        async def get(self, url, timeout):
            return Resp(self.metrics)

        async def post(self, url, json, timeout, headers):
            self.posts.append(json)
            return Resp("{}")

    async def run(metrics):
        inst = HttpInstance("small", "http://x", "tiny")
        client = Client(metrics)
        d = ShadowDispatcher(inst, client, poll_s=0.01, timeout_s=1.0, dead_retry_s=1.0)
        inst.dispatcher = d
        d.start()
        d.submit(ShadowTask(("t", "s"), "/v1/completions", {"prompt": [1, 2]}, 0.0))
        await asyncio.sleep(0.2)
        await d.stop()
        return inst, client

    inst, client = asyncio.run(run("sglang:num_queue_reqs 0\n"))
    assert not client.posts and inst.stats["shadow_held_no_queue_metric"] > 0 and inst.queue_metric is False
    inst, client = asyncio.run(run("vllm:num_requests_waiting 0\n"))
    assert len(client.posts) == 1 and inst.queue_metric is True


@pytest.mark.parametrize("config, needle", [
    ({"models": {"small": ["http://127.0.0.1:1"]}, "shadow": {"priorty": 5}},
     "config.shadow has unknown keys ['priorty']"),
    ({"models": {"small": ["http://127.0.0.1:1"]}, "router": {"type": "markov", "pp": 1}},
     "config.router has unknown keys ['pp']"),
    ({"models": {"small": [{"url": "http://127.0.0.1:1", "kv_events": {"endpoint": "tcp://h:1", "topik": "kv"}}]}},
     "config.models['small'].kv_events has unknown keys ['topik']"),
    ({"models": {"small": ["http://127.0.0.1:1"]}, "gateway": {"models": {"small": {"price": 1}}}},
     "config.gateway.models['small'] has unknown keys ['price']"),
    ({"models": {"small": ["http://127.0.0.1:1"]}, "gateway": {"min_qualty": 1}}, "config.gateway has unknown keys"),
])
def test_nested_config_keys_one_line(capsys, tmp_path, config, needle):
    from shadowprefill.cli import main
    path = tmp_path / "m.json"
    path.write_text(json.dumps(config))
    rc = main(["serve-manager", "--config", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("shadowprefill serve-manager: error: ")
    assert needle in err[0] and str(path) in err[0]


@pytest.mark.parametrize("text, needle", [("{", "must be JSON"), ('{"enable_kv_cache_events": true, "x": 1}', "['x']"),
                                          ('{"endpoint": "tcp://*:1"}', "enable_kv_cache_events"),
                                          ('{"enable_kv_cache_events": true, "endpoint": "nowhere"}', "ZMQ address")])
def test_serve_engine_kv_events_config_errors(capsys, text, needle):
    from shadowprefill.cli import main
    rc = main(["serve-engine", "--port", "0", "--kv-events-config", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_dispatched_shadows_are_the_planes_decision():
    """Two `large` instances publishing KV events: the plane picks one per call (the other rejected with
    a reason), exactly the chosen ones are dispatched, the chosen one then holds the history per its own
    events, and a history it already holds is not shadowed again."""
    eps = [(f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}") for _ in range(2)]
    small = AppThread(make_engine_server("tiny", model_name="tiny").app).start()
    larges = [AppThread(make_engine_server("tiny_large", model_name="tiny_large", kv_events={
        "endpoint": ep, "replay_endpoint": rep, "topic": "kv"}).app).start() for ep, rep in eps]
    config = ManagerConfig.from_dict({
        "models": {"small": [{"url": small.url, "served_model_name": "tiny"}],
                   "large": [{"url": lg.url, "served_model_name": "tiny_large",
                              "kv_events": {"endpoint": ep, "replay_endpoint": rep, "topic": "kv"}}
                             for lg, (ep, rep) in zip(larges, eps)]},
        "shadow": {"poll_s": 0.02}})
    mgr = AppThread(lambda: make_manager_app(config)).start()
    manager = mgr.app[MANAGER_KEY]
    rng = random.Random(3)
    try:
        with httpx.Client(base_url=mgr.url, timeout=120) as client:
            time.sleep(0.3)
            prompt = ids(rng, 70)
            recs = []
            for turn in range(3):
                body, dec = call(client, "small", prompt, "sh", return_token_ids=True)
                rec = client.get("/manager/decisions").json()[-1]
                recs.append(rec)
                assert client.post("/manager/wait-shadows?timeout=60").json()["idle"]
                chosen = [s["instance"] for s in rec["shadows"]]
                assert dec["shadows"] == (",".join(f"large@{u}" for u in chosen) or "none")
                assert sorted(chosen + [r["instance"] for r in rec["shadows_rejected"]]) == sorted(
                    lg.url for lg in larges)                 # every large instance judged, once
                assert all(r["reason"] for r in rec["shadows_rejected"])
                for u in chosen:                             # the chosen one holds the history per its events
                    inst = next(i for i in manager.instances["large"] if i.url == u)
                    history = prompt + body["choices"][0]["token_ids"]
                    w = len(history) // BS * BS
                    assert wait_for(lambda: inst.view.cached_tokens("", history) >= w, 5.0)
                if turn == 0:
                    prompt = prompt + body["choices"][0]["token_ids"] + ids(rng, 40)
            assert len(recs[0]["shadows"]) == 1 and recs[0]["shadows_rejected"][0]["reason"].endswith(
                "has the larger benefit")
            assert recs[1]["shadows"][0]["instance"] == recs[0]["shadows"][0]["instance"]   # it holds the start
            assert recs[2]["shadows"] == []                  # the same history again: held there
            assert any(r["reason"].startswith("held:") for r in recs[2]["shadows_rejected"])
            for inst in manager.instances["large"]:          # dispatched == decided, per instance
                decided = sum(s["instance"] == inst.url for r in recs for s in r["shadows"])
                assert inst.stats["shadow_submitted"] == inst.stats["shadow_completed"] == decided
    finally:
        mgr.stop()
        for lg in larges:
            lg.stop()
        small.stop()
