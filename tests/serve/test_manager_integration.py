"""The manager against two real HTTP peers (built-in engine servers, or vLLM via $SP_SERVE_PEERS)."""
from __future__ import annotations

import json
import os
import random
import time

import httpx

from shadowprefill.serve.frontdoor import MANAGER_KEY
from tests.serve.conftest import cached_tokens, completion, random_ids, wait_shadows

HISTORY = 300           # first-call prompt tokens


def _report(name: str, values: dict) -> None:
    """Measured numbers go to stdout (pytest -s) and to $SP_SERVE_REPORT (a JSON-lines file) if set."""
    line = json.dumps({"measure": name, **values})
    print(line)
    path = os.environ.get("SP_SERVE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _two_calls(client, rng, session, shadow: bool, peers) -> tuple[dict, dict, int]:
    """Call 0 on small, then a switch call on large whose prompt extends call 0's prompt + response."""
    prompt = random_ids(rng, HISTORY)
    r0 = completion(client, "small", prompt, session, shadow=shadow, return_token_ids=True)
    out_ids = r0["choices"][0]["token_ids"]
    assert len(out_ids) == 8
    wait_shadows(client)
    history = prompt + out_ids
    r1 = completion(client, "large", history + random_ids(rng, 40), session, shadow=shadow)
    return r0, r1, len(history)


def test_switch_call_after_shadow_hits_history_and_without_shadow_misses(manager, peers):
    _, client = manager
    rng = random.Random(1)
    bs = peers.block_size
    _, r1, hist = _two_calls(client, rng, "switch-shadow", True, peers)
    cached = cached_tokens(r1)
    assert cached % bs == 0
    assert hist // bs * bs - bs <= cached <= hist // bs * bs, (cached, hist)
    _, r1_cold, hist_cold = _two_calls(client, rng, "switch-cold", False, peers)
    cold = cached_tokens(r1_cold)
    assert cold < bs, cold
    summary = client.get("/manager/summary").json()["policies"]
    assert summary["harvest"]["num_switch_calls"] == 1 and summary["no-shadow"]["num_switch_calls"] == 1
    assert summary["harvest"]["switch_hit_rate"] == cached / r1["usage"]["prompt_tokens"]
    _report("switch_cached_tokens", {"peer": peers.kind, "history": hist, "with_shadow": cached, "without": cold})


def test_non_append_only_history_shadows_only_the_prompt(manager, peers):
    _, client = manager
    rng = random.Random(2)
    bs = peers.block_size
    p0 = random_ids(rng, 200)
    completion(client, "small", p0, "rewrite", return_token_ids=True)
    # call 1 rewrites the history (keeps 100 tokens of it): the session is now non-append-only
    p1 = p0[:100] + random_ids(rng, 200)
    r1 = completion(client, "small", p1, "rewrite", return_token_ids=True)
    wait_shadows(client)
    mgr = manager[0].app[MANAGER_KEY]
    assert mgr.sessions[("tenant-a", "rewrite")].append_only is False
    # the shadow on large is p1 alone (not p1 + response): a switch call extending p1 + response hits p1 only
    r2 = completion(client, "large", p1 + r1["choices"][0]["token_ids"] + random_ids(rng, 20), "rewrite")
    assert cached_tokens(r2) == len(p1) // bs * bs or (peers.kind == "vllm" and
                                                        len(p1) // bs * bs - bs <= cached_tokens(r2) <= len(p1))


def _stream_events(c: httpx.Client, body: dict) -> list[dict]:
    with c.stream("POST", "/v1/completions", json=body, headers={"X-Session-Id": "stream"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    out = [json.loads(ln[5:]) for ln in lines[:-1]]
    for e in out:                       # per-request ids/timestamps differ; a null field equals an absent one
        e.pop("id", None), e.pop("created", None)
        for obj in [e] + e.get("choices", []):
            for k in [k for k, v in obj.items() if v is None]:
                del obj[k]
    return out


def test_streaming_is_passed_through_unchanged(manager, peers):
    """Greedy decoding: the same request through the manager and straight to the server gives the same
    events. Text prompts: event for event (the manager's injected usage chunk is removed again). Token-id
    prompts: the manager asks for `return_token_ids` (to shadow the response ids), which makes vLLM split
    the text over chunks differently, so there the text, finish reason and chunk count are compared."""
    _, client = manager
    rng = random.Random(3)
    direct_client = httpx.Client(base_url=peers.models["small"]["url"], timeout=60)
    served = peers.models["small"]["served_model_name"]
    text = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(40))
    for prompt in (text, random_ids(rng, 64)):
        body = {"prompt": prompt, "max_tokens": 6, "stream": True, "ignore_eos": True}
        _stream_events(direct_client, {**body, "model": served})          # warm: all runs below hit the cache
        via_manager = _stream_events(client, {**body, "model": "small"})
        direct = _stream_events(direct_client, {**body, "model": served})
        direct_again = _stream_events(direct_client, {**body, "model": served})
        assert all("usage" not in e for e in via_manager)
        assert all("token_ids" not in c and "prompt_token_ids" not in c for e in via_manager for c in e["choices"])
        if direct != direct_again:
            # a peer whose greedy output is not reproducible (vLLM bf16 on CPU with random weights: nearly
            # flat logits): compare the event structure only
            def shape(events):
                return [(sorted(e), [sorted(c) for c in e["choices"]]) for e in events]
            # different text splits into a different number of chunks (byte-level tokens), so only the
            # first event's structure, the chunk count bound and the finish reason are comparable
            assert shape(via_manager)[:1] == shape(direct)[:1]
            assert 1 <= len(via_manager) <= body["max_tokens"] + 1
            assert [c.get("finish_reason") for c in via_manager[-1]["choices"]] == ["length"]
            _report("stream_passthrough", {"peer": peers.kind, "reproducible_peer": False})
            continue
        if isinstance(prompt, str):
            assert via_manager == direct
        else:
            def text_of(events):
                return "".join(c.get("text", "") for e in events for c in e["choices"])
            assert text_of(via_manager) == text_of(direct)
            assert [c.get("finish_reason") for c in via_manager[-1]["choices"]] == \
                [c.get("finish_reason") for c in direct[-1]["choices"]]
        # the manager still read the usage (cached tokens) for its records
        rec = manager[0].app[MANAGER_KEY].calls[-1]
        assert rec.stream and rec.prompt_tokens > 0 and rec.ttft is not None and rec.ttft <= rec.latency


def test_chat_streaming_and_next_turn_prefix_shadow(manager, peers):
    _, client = manager
    bs = peers.block_size
    rng = random.Random(4)
    words = " ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(80))
    messages = [{"role": "user", "content": words}]
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "small", "messages": messages, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True},
            headers={"X-Session-Id": "chat"}) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and "[DONE]" not in ln]
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) >= 1                                   # asked for: passed through
    answer = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c["choices"])
    first_prompt = usage_chunks[-1]["usage"]["prompt_tokens"]
    wait_shadows(client)
    turn2 = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "next step"}]
    r2 = client.post("/v1/chat/completions", json={"model": "large", "messages": turn2, "max_tokens": 2},
                     headers={"X-Session-Id": "chat"})
    assert r2.status_code == 200, r2.text
    cached = cached_tokens(r2.json())
    assert cached >= (first_prompt // bs - 1) * bs, (cached, first_prompt)


def test_auth_and_tenant_isolation(manager, peers):
    thread, client = manager
    bs = peers.block_size
    assert httpx.get(thread.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"}):
        r = httpx.post(thread.url + "/v1/completions", json={"model": "small", "prompt": [11, 12],
                                                             "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    rng = random.Random(5)
    prompt = random_ids(rng, HISTORY)
    r0 = completion(client, "small", prompt, "same-id", return_token_ids=True)
    wait_shadows(client)
    # tenant b uses the same session id and the same tokens on the other model: nothing of tenant a's
    # shadow may serve it
    other = httpx.Client(base_url=thread.url, timeout=120, headers={"Authorization": "Bearer key-b"})
    history = prompt + r0["choices"][0]["token_ids"]
    rb = completion(other, "large", history + random_ids(rng, 20), "same-id")
    assert cached_tokens(rb) < bs
    mgr = thread.app[MANAGER_KEY]
    assert ("tenant-a", "same-id") in mgr.sessions and ("tenant-b", "same-id") in mgr.sessions
    assert mgr.sessions[("tenant-b", "same-id")].models == ["large"]
    assert [c["tenant"] for c in other.get("/manager/calls").json()] == ["tenant-b"]
    # while tenant a's own switch hits its shadow
    ra = completion(client, "large", history + random_ids(rng, 20), "same-id")
    assert cached_tokens(ra) >= len(history) // bs * bs - bs


def test_routed_call_not_held_back_by_pending_shadow(manager, peers):
    """Measure a routed call's latency on `large` while a long shadow targets it, against the same call
    with the instance idle. Reported, never asserted (speed is measured in bench/); the call must complete."""
    _, client = manager
    rng = random.Random(6)

    def routed_latency(session: str) -> float:
        t = time.monotonic()
        completion(client, "large", random_ids(rng, 64), session, max_tokens=4)
        return time.monotonic() - t

    idle = [routed_latency(f"idle-{i}") for i in range(3)]
    long_prompt = random_ids(rng, 1500)
    completion(client, "small", long_prompt, "long-shadow", max_tokens=2)   # its shadow (1.5K tokens) -> large
    during = [routed_latency(f"busy-{i}") for i in range(3)]
    wait_shadows(client, 120)
    lat_busy = max(during)
    _report("routed_latency_with_pending_shadow", {"peer": peers.kind, "idle_s": idle, "during_shadow_s": during,
                                                   "max_during_s": lat_busy})


def test_unknown_model_and_bad_requests(manager):
    _, client = manager
    r = client.post("/v1/completions", json={"model": "nope", "prompt": [11], "max_tokens": 1})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_replay_cli_prints_switch_table(manager, tmp_path, capsys):
    from shadowprefill.cluster.traces import save_sessions
    from shadowprefill.cluster.workloads import Call, Session
    from shadowprefill.serve.cli import main

    thread, _ = manager
    sessions = [Session(f"cli-{i}", "default", "t", 0.0,
                        [Call(model=m, new_input_tokens=120 if k == 0 else 20, output_tokens=4, gap_s=0.2)
                         for k, m in enumerate(["small", "large", "small"])]) for i in range(2)]
    path = tmp_path / "s.jsonl"
    save_sessions(path, sessions)
    out_json = tmp_path / "out.json"
    assert main(["replay", "--manager", thread.url, "--sessions", str(path), "--api-key", "key-a",
                 "--min-gap-s", "0.2", "--max-gap-s", "0.2", "--background-prompt-tokens", "32",
                 "--out", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "switch cached frac" in text and "no-shadow" in text and "harvest" in text
    result = json.loads(out_json.read_text())
    for policy in ("no-shadow", "harvest"):
        s = result["summary"][policy]
        assert s["num_calls"] == 6 and s["num_switch_calls"] == 4 and s["num_failed_calls"] == 0
