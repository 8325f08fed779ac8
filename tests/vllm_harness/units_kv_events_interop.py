"""The gateway's KV-event subscriber against vLLM's own ZmqEventPublisher (no model, no server).

vLLM's publisher (run in $VLLM_VENV) binds `tcp://*:PORT` and its replay ROUTER; it publishes two batches
before the subscriber connects (dropped by PUB), then a third: the subscriber sees seq 2 first, replays 0
and 1 from vLLM's buffer, and the registry holds the three batches' blocks under the cache_salt tenant.
Run by tests/vllm_harness/run_gateway.sh: `python -m pytest -q tests/vllm_harness/units_kv_events_interop.py`.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from shadowprefill.gateway.engine_view import EngineView
from shadowprefill.gateway.kv_subscriber import EventSource, KVEventSubscriber
from shadowprefill.gateway.registry import CacheRegistry

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))

PUBLISHER = textwrap.dedent("""
    import os, sys, time
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    port, replay, ready, go, bs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], 16
    tokens = [int(t) for t in sys.argv[5].split(",")]
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", topic="kv")

    def batch(i, parent):
        blk = tokens[i * 2 * bs:(i + 1) * 2 * bs]
        return KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[1000 + 2 * i, 1001 + 2 * i], parent_block_hash=parent, token_ids=blk, block_size=bs,
            lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[("tenant-x",) if i == 0 else None, None])])
    pub.publish(batch(0, None))
    pub.publish(batch(1, 1001))
    time.sleep(0.5)
    open(ready, "w").close()
    end = time.time() + 60
    while not os.path.exists(go) and time.time() < end:
        time.sleep(0.05)
    time.sleep(0.5)
    pub.publish(batch(2, 1003))
    time.sleep(3)
    pub.shutdown()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_subscriber_reads_and_replays_vllms_publisher(tmp_path):
    rng = random.Random(0)
    tokens = [rng.randrange(10, 500) for _ in range(6 * 16)]
    port, replay = _port(), _port()
    ready, go = tmp_path / "ready", tmp_path / "go"
    script = tmp_path / "pub.py"
    script.write_text(PUBLISHER)
    proc = subprocess.Popen([str(VENV / "bin/python"), str(script), str(port), str(replay), str(ready), str(go),
                             ",".join(map(str, tokens))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < end, "vLLM publisher did not start"
            time.sleep(0.1)
        reg = CacheRegistry()
        view = EngineView(reg, threading.RLock(), "http://vllm", "small")
        sub = KVEventSubscriber(replay_timeout_s=3.0)
        sub.add(EventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", "kv", bind=False), view)
        sub.start()
        try:
            time.sleep(0.3)
            go.touch()
            end = time.monotonic() + 10
            while view.last_seq != 2 and time.monotonic() < end:
                time.sleep(0.05)
            assert view.last_seq == 2, view.stats
            assert view.stats["gaps"] == 1 and view.stats["replayed"] >= 2 and view.stats["skipped"] == 0
            assert view.cached_tokens("tenant-x", tokens + [1, 2]) == 6 * 16
            assert view.cached_tokens("tenant-y", tokens) == 0
        finally:
            sub.stop()
    finally:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
