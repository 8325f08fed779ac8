"""The built-in server's KV-cache events, in vLLM's format (`serve-engine --kv-events-config JSON`).

`KVEventsPublisher` is the wire side, like vLLM's ZMQ publisher: a PUB socket (bound for `tcp://*:PORT`,
`ipc://`, `inproc://`; connected otherwise, so a gateway that binds receives it), an optional ROUTER
`replay_endpoint` that re-sends buffered batches from a requested sequence number and then the seq -1
end marker, and one thread that owns both sockets. Batches are `gateway.kv_events.encode_batch` bytes.

`CacheTracker` is the engine side (runs on the engine thread, `serve.engine_loop`): after a request
finishes or a shadow settles, the sequence it leaves (prompt + generated tokens) is peeked in the KV
manager (`peek_prefix`: device-resident whole pages); pages not yet announced are published as one
`BlockStored` (block ids chain the content and the tenant, which is also sent as the first block's
`cache_salt` extra key). Every `check_s` the tracked sequences are peeked again and pages that left the
device (eviction) are published as `BlockRemoved`. Start-up publishes `AllBlocksCleared` (a restarted
server holds nothing).
"""
from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections import OrderedDict, deque

import zmq

from shadowprefill.gateway.kv_events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                             encode_batch, seq_bytes)


def parse_events_config(text: str) -> dict:
    """vLLM's `--kv-events-config` JSON -> {endpoint, replay_endpoint, topic, buffer_steps} (ValueError)."""
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config must be JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    allowed = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps",
               "hwm", "max_queue_size"}
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"--kv-events-config has unknown keys {sorted(unknown)}")
    if d.get("publisher", "zmq") != "zmq":
        raise ValueError(f"--kv-events-config publisher must be 'zmq', got {d.get('publisher')!r}")
    if not d.get("enable_kv_cache_events", False):
        raise ValueError("--kv-events-config needs \"enable_kv_cache_events\": true")
    ep = d.get("endpoint", "tcp://*:5557")
    if not isinstance(ep, str) or "://" not in ep:
        raise ValueError(f"--kv-events-config endpoint must be a ZMQ address, got {ep!r}")
    steps = d.get("buffer_steps", 10_000)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--kv-events-config buffer_steps must be an int >= 1, got {steps!r}")
    return {"endpoint": ep, "replay_endpoint": d.get("replay_endpoint"), "topic": str(d.get("topic", "")),
            "buffer_steps": steps}


class KVEventsPublisher:
    """PUB + ROUTER replay on one thread; `publish(events)` from any thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = None
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self.pub.bind(endpoint)
            else:
                self.pub.connect(endpoint)
            if replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.pub.close(0)
            if self.replay is not None:
                self.replay.close(0)
            self.ctx.term()
            raise ValueError(f"kv events endpoint {endpoint} / {replay_endpoint}: {exc}") from None
        self.topic = topic.encode()
        self.buffer: deque = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()

    def publish(self, events) -> None:
        if events:
            self._queue.put(EventBatch(time.time(), tuple(events)))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)
        for s in (self.pub, self.replay):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()

    def _run(self) -> None:
        while self._running:
            if self.replay is not None and self.replay.poll(0):
                frames = self.replay.recv_multipart()
                if len(frames) == 3:
                    client, _, start = frames
                    start_seq = int.from_bytes(start, "big", signed=True)
                    for seq, payload in list(self.buffer):
                        if seq >= start_seq:
                            self.replay.send_multipart([client, b"", self.topic, seq_bytes(seq), payload])
                    self.replay.send_multipart([client, b"", b"", seq_bytes(END_SEQ), b""])
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            payload = encode_batch(batch)
            self.pub.send_multipart([self.topic, seq_bytes(self._seq), payload])
            self.buffer.append((self._seq, payload))
            self._seq += 1


def _block_id(parent: int | None, tokens, tenant: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((parent, tenant if parent is None else "", tuple(tokens))).encode())
    return int.from_bytes(h.digest(), "big") >> 1


class CacheTracker:
    """What the engine holds, as block events (engine thread only)."""

    def __init__(self, engine, publisher: KVEventsPublisher, check_s: float = 0.2, max_sequences: int = 4096):
        self.engine, self.publisher = engine, publisher
        self.bs = engine.config.block_size
        self.check_s, self.max_sequences = check_s, max_sequences
        self._announced: dict[int, int] = {}                       # block id -> sequences that hold it
        self._seqs: "OrderedDict[tuple, list[int]]" = OrderedDict()  # (tenant, tokens) -> announced block ids
        self._next_check = 0.0
        publisher.publish([AllBlocksCleared()])

    def settle(self, tokens, tenant: str) -> None:
        """A sequence finished on the engine: announce its newly cached whole pages."""
        tokens = tuple(tokens)
        device = self.engine.kv.peek_prefix(list(tokens), tenant=tenant)[0] // self.bs
        key = (tenant, tokens[:device * self.bs])
        if device == 0 or key in self._seqs:
            return
        ids, parent, new, first_new = [], None, [], None
        for i in range(device):
            b = _block_id(parent, tokens[i * self.bs:(i + 1) * self.bs], tenant)
            ids.append(b)
            if b not in self._announced and first_new is None:
                first_new = i
            parent = b
        events = []
        if first_new is not None:
            new = ids[first_new:]
            events.append(BlockStored(tuple(new), ids[first_new - 1] if first_new else None,
                                      tokens[first_new * self.bs:device * self.bs], self.bs,
                                      tuple(((tenant,) if (first_new + k == 0 and tenant) else None)
                                            for k in range(len(new)))))
        for b in ids:
            self._announced[b] = self._announced.get(b, 0) + 1
        self._seqs[key] = ids
        while len(self._seqs) > self.max_sequences:                 # forget the oldest (no event: unknown)
            self._forget(self._seqs.popitem(last=False)[1])
        self.publisher.publish(events)

    def _forget(self, ids) -> list[int]:
        gone = []
        for b in ids:
            n = self._announced.get(b, 0) - 1
            if n <= 0:
                self._announced.pop(b, None)
                gone.append(b)
            else:
                self._announced[b] = n
        return gone

    def check(self, now: float) -> None:
        """Publish BlockRemoved for announced pages that left the device since the last check."""
        if now < self._next_check:
            return
        self._next_check = now + self.check_s
        removed = []
        for key in list(self._seqs):
            tenant, tokens = key
            ids = self._seqs[key]
            device = self.engine.kv.peek_prefix(list(tokens), tenant=tenant)[0] // self.bs
            if device >= len(ids):
                continue
            del self._seqs[key]
            removed += self._forget(ids[device:])
            short = (tenant, tokens[:device * self.bs])
            if device and short not in self._seqs:
                self._seqs[short] = ids[:device]          # the surviving prefix keeps its counts
            else:
                removed += self._forget(ids[:device])
        if removed:
            self.publisher.publish([BlockRemoved(tuple(removed))])
