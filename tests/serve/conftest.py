"""Peers for the manager's integration suite: two built-in engine servers by default, or the servers
named in $SP_SERVE_PEERS (a JSON file written by tests/vllm_harness/run.sh for two real vLLM servers).

Built-in peers: model "small" (tiny) in-process on an ephemeral port, model "large" (tiny_large) as a
subprocess (its engine thread then does not share this process's interpreter lock). Both torn down at
session end. No test kills a peer (the failure test kills a forwarder in front of one).
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shadowprefill.serve.app_runner import AppThread
from shadowprefill.serve.config import ManagerConfig
from shadowprefill.serve.frontdoor import make_manager_app

ROOT = Path(__file__).resolve().parents[2]
VOCAB_HI = 500          # prompt ids in [10, 500): inside the tiny models' (and the harness tokenizer's) vocab


@dataclass
class Peers:
    kind: str                                   # "builtin" or "vllm"
    block_size: int
    models: dict[str, dict]                     # name -> {"url", "served_model_name", "pid"?}
    processes: list = field(default_factory=list)
    threads: list = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not healthy within {timeout} s")


def start_engine_subprocess(model: str, n_min: int = 16) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "shadowprefill.serve.cli", "serve-engine", "--model", model,
                             "--port", str(port), "--n-min", str(n_min)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc)
    except Exception:
        proc.kill()
        raise RuntimeError(f"engine subprocess failed: {proc.stderr.read().decode()[-2000:]}")
    return proc, url


@pytest.fixture(scope="session")
def peers():
    spec = os.environ.get("SP_SERVE_PEERS")
    if spec:
        d = json.loads(Path(spec).read_text())
        yield Peers(d.get("kind", "vllm"), int(d["block_size"]), d["models"])
        return
    from shadowprefill.serve.engine_server import make_engine_server
    small = AppThread(make_engine_server("tiny", model_name="tiny").app).start()
    proc, url = start_engine_subprocess("tiny_large")
    p = Peers("builtin", 16, {"small": {"url": small.url, "served_model_name": "tiny"},
                              "large": {"url": url, "served_model_name": "tiny_large"}},
              processes=[proc], threads=[small])
    try:
        yield p
    finally:
        for t in p.threads:
            t.stop()
        for pr in p.processes:
            if pr.poll() is None:
                pr.kill()
                pr.wait(timeout=10)


API_KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


def manager_config(peers: Peers, large: list[str] | None = None, **overrides) -> ManagerConfig:
    """A manager over the peers; `large`: other URLs for the "large" model's instances (same server kind)."""
    models = {name: [{"url": m["url"], "served_model_name": m["served_model_name"]}] for name, m in
              peers.models.items()}
    if large is not None:
        models["large"] = [{"url": u, "served_model_name": peers.models["large"]["served_model_name"]}
                           for u in large]
    d = {"models": models, "api_keys": API_KEYS, "connect_timeout_s": 2.0, "read_timeout_s": 60.0,
         "dead_retry_s": 30.0, "shadow": {"poll_s": 0.02, "timeout_s": 60.0},
         "tenant_cache_salt": peers.kind == "vllm"}
    d.update(overrides)
    return ManagerConfig.from_dict(d)


@pytest.fixture
def manager(peers):
    """A fresh manager (front door) over the peers; yields (AppThread, client for tenant-a)."""
    thread = AppThread(lambda: make_manager_app(manager_config(peers))).start()
    client = httpx.Client(base_url=thread.url, timeout=120, headers={"Authorization": "Bearer key-a"})
    try:
        yield thread, client
    finally:
        client.close()
        thread.stop()


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB_HI) for _ in range(n)]


def completion(client: httpx.Client, model: str, prompt, session: str | None, max_tokens: int = 8,
               shadow: bool = True, **extra) -> dict:
    headers = {}
    if session is not None:
        headers["X-Session-Id"] = session
    if not shadow:
        headers["X-Shadow"] = "off"
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "ignore_eos": True, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(response: dict) -> int:
    return (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def wait_shadows(client: httpx.Client, timeout: float = 150.0) -> None:
    """Until the manager's shadow dispatchers are idle. A built-in server answers a shadow once its pages are
    cached or after its `shadow_wait_s` (60 s), so on a loaded machine a wait of 60 s raced that deadline;
    the default outlasts it (a test returns as soon as the dispatchers are idle)."""
    r = client.post(f"/manager/wait-shadows?timeout={timeout}", timeout=timeout + 10)
    assert r.status_code == 200 and r.json()["idle"], r.text
