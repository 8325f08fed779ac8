"""The live gateway against real vLLM servers publishing KV-cache events (run by run_gateway.sh; issue 22).

Servers (from $SP_GATEWAY_PEERS): `a` and `b` serve `small` (b with an 80-block KV pool), `l` serves `large`;
each publishes KVEventBatch to an endpoint this manager binds. The manager runs in-process with a `gateway`
section; measured numbers go to $SP_GATEWAY_REPORT.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from shadowprefill.serve.app_runner import AppThread
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.frontdoor import MANAGER_KEY, make_manager_app

REPORT: dict = {}


@pytest.fixture(scope="module")
def peers():
    spec = os.environ.get("SP_GATEWAY_PEERS")
    if not spec:
        raise RuntimeError("SP_GATEWAY_PEERS is not set: this suite runs against real vLLM servers with KV "
                           "events; run it with bash tests/vllm_harness/run_gateway.sh")
    return json.loads(Path(spec).read_text())


@pytest.fixture(scope="module")
def gw(peers):
    s = peers["servers"]

    def ep(k):
        return {"url": s[k]["url"], "served_model_name": s[k]["model"],
                "kv_events": {"endpoint": s[k]["events"], "replay_endpoint": s[k]["replay"], "topic": "kv"}}
    config = ManagerConfig.from_dict({
        "models": {"small": [ep("a"), ep("b")], "large": [ep("l")]},
        "api_keys": {"key-a": "tenant-a", "key-b": "tenant-b"},
        "shadow": {"enabled": False}, "read_timeout_s": 120.0, "dead_retry_s": 60.0,
        "gateway": {"models": {"small": {"quality": 0.7, "price_in": 0.1, "price_out": 0.4},
                               "large": {"quality": 0.9, "price_in": 1.0, "price_out": 4.0}}}})
    thread = AppThread(lambda: make_manager_app(config)).start()
    clients = {t: httpx.Client(base_url=thread.url, timeout=180, headers={"Authorization": f"Bearer key-{t}"})
               for t in ("a", "b")}
    time.sleep(0.5)                                             # ZMQ: let the publishers connect
    yield thread.app[MANAGER_KEY], clients, peers
    for c in clients.values():
        c.close()
    thread.stop()
    out = os.environ.get("SP_GATEWAY_REPORT")
    if out:
        Path(out).write_text(json.dumps(REPORT, indent=2))
    print("[gateway]", json.dumps(REPORT))


def ids(rng, n):
    return [rng.randrange(10, 500) for _ in range(n)]


def call(client, model, prompt, session=None, max_tokens=2, headers=None):
    h = dict(headers or {})
    if session:
        h["X-Session-Id"] = session
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "ignore_eos": True, "return_token_ids": True}, headers=h)
    assert r.status_code == 200, r.text
    dec = dict(kv.split("=", 1) for kv in r.headers["X-Gateway-Decision"].split("; "))
    body = r.json()
    return body, dec, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def inst(mgr, url):
    return next(i for i in mgr.all_instances() if i.url == url)


def wait_for(pred, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_registry_follows_a_call_and_predicts_the_next(gw):
    mgr, clients, peers = gw
    rng = random.Random(1)
    prompt = ids(rng, 1000)
    _, dec, _ = call(clients["a"], "small", prompt, "s1")
    here = inst(mgr, dec["instance"])
    other = next(i for i in mgr.instances["small"] if i is not here)
    t0 = time.monotonic()
    assert wait_for(lambda: here.view.cached_tokens("tenant-a", prompt) >= 1000 // 32 * 32, 2.0)
    REPORT["registry_visible_s"] = time.monotonic() - t0
    assert other.view.cached_tokens("tenant-a", prompt) == 0
    _, dec2, reported = call(clients["a"], "small", prompt + ids(rng, 50), "s1")
    assert dec2["instance"] == here.url and dec2["action"] == "reuse" and dec2["source"] == "events"
    assert int(dec2["predicted_cached_tokens"]) == reported > 0


def test_second_tenant_sees_no_cached_tokens(gw):
    mgr, clients, _ = gw
    prompt = ids(random.Random(1), 1000)                          # tenant a's prompt of the first test
    _, dec, reported = call(clients["b"], "small", prompt, "t2")
    assert reported <= 32 and int(dec["predicted_cached_tokens"]) == 0
    assert all(d["tenant"] == "tenant-b" for d in clients["b"].get("/manager/decisions").json())


def test_eviction_seen_and_guess_contrast(gw):
    mgr, clients, peers = gw
    rng = random.Random(2)
    b = inst(mgr, peers["servers"]["b"]["url"])
    prompt = ids(rng, 1200)
    # warm b directly (the manager never sent this): only its events can tell the manager
    r = httpx.post(b.url + "/v1/completions", json={"model": "small", "prompt": prompt, "max_tokens": 1,
                                                     "cache_salt": "tenant-a"}, timeout=120)
    assert r.status_code == 200
    assert wait_for(lambda: b.view.cached_tokens("tenant-a", prompt) >= 1184, 2.0)
    _, dec, reported = call(clients["a"], "small", prompt + ids(rng, 40), "ev")
    assert dec["instance"] == b.url and int(dec["predicted_cached_tokens"]) == reported >= 1184
    for k in range(3):                                            # fillers evict it from the 80-block pool
        httpx.post(b.url + "/v1/completions", json={"model": "small", "prompt": ids(rng, 1500), "max_tokens": 1,
                                                     "cache_salt": "tenant-a"}, timeout=120)
    assert wait_for(lambda: b.view.cached_tokens("tenant-a", prompt) < 1184, 2.0)
    state = mgr.sessions[("tenant-a", "ev")]
    nxt = prompt + ids(rng, 60)
    guess_b = b.guess_cached(nxt, state)                          # what the guess-based path believes b holds
    pred_b, _ = mgr.gateway.predicted_cached(b, "tenant-a", nxt, nxt, state)
    _, dec2, reported2 = call(clients["a"], "small", nxt, "ev")
    assert not (dec2["instance"] == b.url and dec2["action"] == "reuse")   # the next decision: no reuse at b
    assert abs(int(dec2["predicted_cached_tokens"]) - reported2) <= 32
    if dec2["instance"] == b.url:
        reported_b = reported2                                    # the same call measures b
    else:                                                         # b untouched since the eviction: probe it
        r = httpx.post(b.url + "/v1/completions", json={"model": "small", "prompt": nxt, "max_tokens": 1,
                                                         "cache_salt": "tenant-a"}, timeout=120)
        reported_b = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    REPORT["eviction"] = {"manager_call": {"instance": dec2["instance"], "reported": reported2,
                                           "predicted": int(dec2["predicted_cached_tokens"])},
                          "at_b": {"registry_predicted": pred_b, "guess": guess_b, "reported": reported_b}}
    assert abs(pred_b - reported_b) <= 32
    assert guess_b - reported_b > 32 * 10                        # the guess-based path mis-predicts here


def test_joint_choice_auto(gw):
    mgr, clients, peers = gw
    rng = random.Random(3)
    prompt = ids(rng, 800)
    _, dec0, _ = call(clients["a"], "small", prompt, "j1")
    warm = dec0["instance"]
    time.sleep(0.3)
    _, dec, reported = call(clients["a"], "auto", prompt + ids(rng, 30), "j1")
    assert dec["model"] == "small" and dec["instance"] == warm and dec["action"] == "reuse"   # cheaper and warm
    assert (dec["model"], dec["instance"]) == (mgr.calls[-1].model, mgr.calls[-1].instance)
    assert int(dec["predicted_cached_tokens"]) == reported > 0
    _, dec_q, _ = call(clients["a"], "auto", prompt + ids(rng, 30), "j1", headers={"X-Gateway-Min-Quality": "0.8"})
    assert dec_q["model"] == "large"                              # the quality floor excludes small
    assert (dec_q["model"], dec_q["instance"]) == (mgr.calls[-1].model, mgr.calls[-1].instance)
    rec = clients["a"].get("/manager/decisions").json()[-1]
    assert all(not o["feasible"] and "Q=" in o["reason"] for o in rec["options"] if o["model_id"] == "small")
    decisions = clients["a"].get("/manager/decisions").json()
    for d in decisions:
        assert d["action"] in ("reuse", "shadow", "reprefill")    # infeasible actions never chosen
        if d["auto"]:
            assert {o["action"] for o in d["options"] if not o["feasible"]} >= {"transfer", "map", "edge_prefill"}
    # the decision (and its header) names the model and instance /manager/calls records, on every call
    calls = clients["a"].get("/manager/calls").json()
    assert len(calls) == len(decisions) > 0
    for d, c in zip(decisions, calls):
        assert (d["model"], d["instance"], d["session"]) == (c["model"], c["instance"], c["session_id"])


def test_replay_predicts_cached_tokens(gw):
    mgr, clients, _ = gw
    rng = random.Random(4)
    ok = total = 0
    prompts = {s: ids(rng, 100 + 40 * s) for s in range(8)}
    for k in range(4):
        for s in range(8):
            model = ("small", "large")[(s + k) % 3 == 0]
            body, dec, reported = call(clients["a"], model, prompts[s], f"rep{s}", max_tokens=4)
            total += 1
            ok += abs(int(dec["predicted_cached_tokens"]) - reported) <= 32
            prompts[s] = prompts[s] + body["choices"][0]["token_ids"] + ids(rng, 40)
            time.sleep(0.1)
    REPORT["replay_within_one_block"] = f"{ok}/{total}"
    assert ok >= 0.95 * total


def test_shadow_the_plane_chose_is_what_vllm_holds(gw):
    """With shadows on, a `large` call's history goes where the control plane decided (one `small` instance,
    the other rejected with a reason), and that server's own KV events then show the history's blocks."""
    mgr, clients, peers = gw
    mgr.core.shadows = True                                      # this test only: the fixture's manager
    try:
        rng = random.Random(6)
        before = {i.url: i.stats["shadow_submitted"] for i in mgr.instances["small"]}
        prompt = ids(rng, 600)
        body, dec, _ = call(clients["a"], "large", prompt, "sh1")
        rec = clients["a"].get("/manager/decisions").json()[-1]
        assert clients["a"].post("/manager/wait-shadows?timeout=120").json()["idle"]
    finally:
        mgr.core.shadows = False
    history = prompt + body["choices"][0]["token_ids"]
    chosen = [s["instance"] for s in rec["shadows"]]
    rejected = {r["instance"]: r["reason"] for r in rec["shadows_rejected"]}
    REPORT["plane_shadow"] = {"chosen": rec["shadows"], "rejected": rec["shadows_rejected"]}
    assert len(chosen) == 1 and dec["shadows"] == f"small@{chosen[0]}"
    assert set(chosen) | set(rejected) == {i.url for i in mgr.instances["small"]} and all(rejected.values())
    target = inst(mgr, chosen[0])
    w = len(history) // 32 * 32
    assert wait_for(lambda: target.view.cached_tokens("tenant-a", history) >= w, 2.0)   # vLLM's own events
    for i in mgr.instances["small"]:                             # dispatched == decided
        assert i.stats["shadow_submitted"] - before[i.url] == (i.url in chosen)
        if i.url not in chosen:
            assert i.view.cached_tokens("tenant-a", history) == 0


def test_reset_and_killed_server(gw):
    mgr, clients, peers = gw
    a = inst(mgr, peers["servers"]["a"]["url"])
    assert [e for e in mgr.gateway.entries_at(a.url) if e.tenant == "tenant-a"]
    r = httpx.post(a.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    # vLLM publishes the AllBlocksCleared with its next engine step: one call of another tenant makes one
    httpx.post(a.url + "/v1/completions", json={"model": "small", "prompt": [11] * 40, "max_tokens": 1,
                                                 "cache_salt": "probe"}, timeout=120)
    assert wait_for(lambda: not [e for e in mgr.gateway.entries_at(a.url) if e.tenant == "tenant-a"], 2.0)
    assert a.view.stats["cleared"] >= 1
    b = inst(mgr, peers["servers"]["b"]["url"])
    os.killpg(peers["servers"]["b"]["pid"], signal.SIGKILL)
    rng = random.Random(5)
    for k in range(3):                                           # nothing hangs; b is dropped
        call(clients["a"], "small", ids(rng, 200), f"kill{k}")
    assert wait_for(lambda: not mgr.gateway.entries_at(b.url), 5.0)
    _, dec, _ = call(clients["a"], "small", ids(rng, 300), "ev")     # a session sticky to b falls back to a
    assert dec["instance"] == a.url
    summary = clients["a"].get("/manager/summary").json()["instances"][b.url]
    REPORT["after_kill"] = {"alive": summary["alive"], "source": summary["source"], "last_error": summary["last_error"]}
    assert summary["alive"] is False
    metrics = clients["a"].get("/metrics").text
    assert "shadowprefill_gateway_decisions_total" in metrics and "shadowprefill_gateway_registry_entries" in metrics
