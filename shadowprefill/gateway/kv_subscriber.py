"""The gateway's KV-event subscriber: one thread reading every engine's ZMQ stream into its `EngineView`.

Per engine a SUB socket on its `endpoint` (bound when `bind`, the default: vLLM's publisher *connects* to a
non-wildcard TCP endpoint; with `tcp://*:PORT` vLLM binds and the gateway connects), filtered by `topic`.
A batch whose sequence number skips ahead (or the first one seen, when it is not seq 0) is preceded by a
replay from the engine's ROUTER `replay_endpoint` (a DEALER asks from the next missing seq; the answer
ends with seq -1); without a replay endpoint, or when the replay does not close the gap within
`replay_timeout_s`, the view skips ahead and says so in its stats. Malformed messages are logged and
skipped. `stop()` closes everything.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from .engine_view import EngineView
from .kv_events import END_SEQ, decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventSource:
    """Where one engine publishes: `endpoint` (SUB), optional `replay_endpoint` (ROUTER), `topic`."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = True

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "EventSource":
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object, got {d!r}")
        unknown = set(d) - {"endpoint", "replay_endpoint", "topic", "bind"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        ep = d.get("endpoint")
        if not isinstance(ep, str) or "://" not in ep:
            raise ValueError(f"{where}.endpoint must be a ZMQ address like tcp://127.0.0.1:5557, got {ep!r}")
        rep = d.get("replay_endpoint")
        if rep is not None and (not isinstance(rep, str) or "://" not in rep):
            raise ValueError(f"{where}.replay_endpoint must be a ZMQ address, got {rep!r}")
        topic, bind = d.get("topic", ""), d.get("bind", True)
        if not isinstance(topic, str):
            raise ValueError(f"{where}.topic must be a string, got {topic!r}")
        if not isinstance(bind, bool):
            raise ValueError(f"{where}.bind must be true or false, got {bind!r}")
        return cls(ep, rep, topic, bind)


class KVEventSubscriber:
    """Reads the streams of several engines on one background thread."""

    def __init__(self, replay_timeout_s: float = 1.0, poll_ms: int = 50) -> None:
        self.ctx = zmq.Context()
        self.replay_timeout_s = replay_timeout_s
        self.poll_ms = poll_ms
        self._subs: list[tuple[zmq.Socket, EventSource, EngineView]] = []
        self._thread: threading.Thread | None = None
        self._running = False

    def add(self, source: EventSource, view: EngineView) -> None:
        """Subscribe `view` to `source` (before `start()`); a bind failure raises naming the endpoint."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        try:
            (sock.bind if source.bind else sock.connect)(source.endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ValueError(f"kv_events endpoint {source.endpoint}: {exc}") from None
        self._subs.append((sock, source, view))

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for sock, _, _ in self._subs:
            sock.close(linger=0)
        self.ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock, _, _ in self._subs:
            poller.register(sock, zmq.POLLIN)
        by_sock = {sock: (src, view) for sock, src, view in self._subs}
        while self._running:
            try:
                ready = dict(poller.poll(self.poll_ms))
            except zmq.ZMQError:
                return
            for sock in ready:
                src, view = by_sock[sock]
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self.handle(frames, src, view)

    def handle(self, frames: list[bytes], src: EventSource, view: EngineView) -> None:
        """One (topic, seq, payload) message: decode, replay a gap first, apply; malformed -> skipped."""
        try:
            if len(frames) != 3:
                raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            seq, batch = seq_of(frames[1]), decode_batch(frames[2])
        except ValueError as exc:
            view.stats["skipped"] += 1
            log.warning("kv events from %s: malformed message skipped: %s", view.site, exc)
            return
        if view.apply(seq, batch) != "gap":
            return
        start = 0 if view.last_seq is None else view.last_seq + 1
        if src.replay_endpoint is not None:
            self._replay(src, view, start, seq)
        if view.last_seq is None or view.last_seq < seq - 1:
            log.warning("kv events from %s: seq %d..%d lost (no replay), continuing", view.site, start, seq - 1)
            view.skip_to(seq)
        view.apply(seq, batch, replayed=True)

    def _replay(self, src: EventSource, view: EngineView, start: int, upto: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", seq_bytes(start)])
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = seq_of(frames[2])
                if seq == END_SEQ:
                    break
                if seq >= upto:
                    continue
                try:
                    batch = decode_batch(frames[3])
                except ValueError as exc:
                    view.stats["skipped"] += 1
                    log.warning("kv events replay from %s: malformed batch skipped: %s", view.site, exc)
                    continue
                if view.last_seq is None and seq > 0:
                    view.skip_to(seq)                # the replay buffer starts later than 0
                view.apply(seq, batch, replayed=True)
        except zmq.ZMQError as exc:
            log.warning("kv events replay from %s failed: %s", src.replay_endpoint, exc)
        finally:
            sock.close(linger=0)
