"""Killing a server mid-run. The manager must never hang: the stream in flight on the killed server ends
(error event or completion), the next call routed to the dead model falls back cold to another instance
(built-in peers: a second "large" instance) or gets a clear HTTP 503 naming the model (vLLM peers: one
instance), and calls to the other model keep working.

The killed "server" is a TCP forwarder process in front of the shared "large" peer (`tcp_proxy.py`): to
the manager its death is a server's (open connections drop, new ones are refused), and the peer itself
lives on, so this test may run in any order with the others.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from shadowprefill.serve.app_runner import AppThread
from shadowprefill.serve.frontdoor import make_manager_app
from tests.serve.conftest import (_free_port, cached_tokens, completion, manager_config, random_ids, wait_healthy,
                                  wait_shadows)


def start_proxy(target_url: str) -> tuple[subprocess.Popen, str]:
    """A forwarder process in front of `target_url`; returns it and its URL."""
    target = urlsplit(target_url)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("tcp_proxy.py")), str(port),
                             target.hostname, str(target.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30, proc)
    return proc, url


def test_kill_large_mid_run_falls_back_or_errors_never_hangs(peers):
    spare = None
    if peers.kind == "builtin":
        from shadowprefill.serve.engine_server import make_engine_server
        spare = AppThread(make_engine_server("tiny_large", model_name="tiny_large").app).start()
    proxy, proxy_url = start_proxy(peers.models["large"]["url"])
    config = manager_config(peers, large=[proxy_url] + ([spare.url] if spare else []))
    thread = AppThread(lambda: make_manager_app(config)).start()
    client = httpx.Client(base_url=thread.url, timeout=60, headers={"Authorization": "Bearer key-a"})
    rng = random.Random(7)
    try:
        prompt = random_ids(rng, 200)
        r0 = completion(client, "small", prompt, "victim", return_token_ids=True)
        wait_shadows(client)
        history = prompt + r0["choices"][0]["token_ids"]

        # a long streamed call on large (the session's sticky instance: the one to be killed)
        seen: dict = {"events": [], "done": False, "error": None}
        first_chunk = threading.Event()

        def stream_call() -> None:
            try:
                with client.stream("POST", "/v1/completions", json={
                        "model": "large", "prompt": history + random_ids(rng, 10), "max_tokens": 400,
                        "stream": True, "ignore_eos": True}, headers={"X-Session-Id": "victim"}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            seen["events"].append(line)
                            first_chunk.set()
            except httpx.HTTPError as exc:
                seen["error"] = repr(exc)
            finally:
                seen["done"] = True
                first_chunk.set()

        t = threading.Thread(target=stream_call, daemon=True)
        t.start()
        assert first_chunk.wait(60)
        t_kill = time.monotonic()
        proxy.kill()
        proxy.wait(timeout=10)
        t.join(30)
        assert seen["done"], "the in-flight stream hung after its server was killed"
        ended_ok = seen["events"] and seen["events"][-1] == "data: [DONE]"
        error_events = [e for e in seen["events"] if '"error"' in e]
        assert ended_ok or error_events or seen["error"], seen["events"][-3:]

        # the next call routed to large: cold fallback or a clear error, quickly
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"model": "large", "prompt": history + random_ids(rng, 20),
                                                 "max_tokens": 4}, headers={"X-Session-Id": "victim"})
        elapsed = time.monotonic() - t0
        if spare is not None:
            assert r.status_code == 200, r.text
            assert cached_tokens(r.json()) < peers.block_size          # cold: the spare never saw the session
        else:
            assert r.status_code == 503, r.text
            assert "large" in r.json()["error"]["message"]
        # the other model still serves the session, and shadows towards the dead server do not hang
        r = completion(client, "small", history + random_ids(rng, 30), "victim")
        assert r["usage"]["prompt_tokens"] > 0
        wait_shadows(client, 30)
        print(json.dumps({"measure": "failure", "peer": peers.kind, "fallback_status": 200 if spare else 503,
                          "fallback_elapsed_s": elapsed, "stream_end_after_kill_s": time.monotonic() - t_kill}))
    finally:
        client.close()
        thread.stop()
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait(timeout=10)
        if spare is not None:
            spare.stop()
