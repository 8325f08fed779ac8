"""KV-cache events: wire format, the registry fed per engine, tenancy, gaps with replay, faults."""
import random
import socket
import threading
import time

import pytest
import zmq

from shadowprefill.gateway.engine_view import EngineView
from shadowprefill.gateway.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                             decode_batch, encode_batch, seq_bytes)
from shadowprefill.gateway.kv_subscriber import EventSource, KVEventSubscriber
from shadowprefill.gateway.registry import CacheRegistry

BS = 4


def stored(tokens, parent=None, salt=None, base=0):
    n = len(tokens) // BS
    hashes = [base + i for i in range(n)]
    extra = tuple((salt,) if i == 0 else None for i in range(n)) if salt else None
    return BlockStored(tuple(hashes), parent, tuple(tokens[:n * BS]), BS, extra), hashes


def view_pair():
    reg, lock = CacheRegistry(), threading.RLock()
    return reg, EngineView(reg, lock, "http://a", "m"), EngineView(reg, lock, "http://b", "m")


def test_wire_roundtrip_matches_vllm_layout():
    rng = random.Random(0)
    toks = [rng.randrange(10, 500) for _ in range(12)]
    ev, _ = stored(toks, salt="t1")
    batch = EventBatch(12.5, (ev, BlockRemoved((b"\x01\x02", 7), "GPU"), AllBlocksCleared()), 0)
    back = decode_batch(encode_batch(batch))
    assert back == batch
    # the bytes vLLM 0.32's msgspec encoder writes for a BlockStored batch (array batch, tagged map events)
    vllm = bytes.fromhex(
        "93cb3ff80000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573917bb1706172"
        "656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964"
        "c0a66d656469756da3475055a96c6f72615f6e616d65c0c0"
    )
    b = decode_batch(vllm)
    assert b.ts == 1.5 and b.events == (BlockStored((123,), None, (1, 2), 2, None, "GPU"),)


@pytest.mark.parametrize("payload", [b"\xc1", encode_batch(EventBatch(1.0, ())) + b"x", b"\x93\x01\x02\x03",
                                     bytes.fromhex("9201918184a474797065ab426c6f636b53746f726564")])
def test_malformed_payload_is_a_value_error(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_registry_per_instance_and_tenant():
    rng = random.Random(1)
    reg, a, b = view_pair()
    toks = [rng.randrange(10, 500) for _ in range(4 * BS + 3)]
    ev, hashes = stored(toks[:3 * BS], salt="t1")
    assert a.apply(0, EventBatch(time.time(), (ev,))) == "applied"
    ev2, _ = stored(toks[3 * BS:4 * BS], parent=hashes[-1], base=100)   # the chain continues (no salt repeated)
    assert a.apply(1, EventBatch(time.time(), (ev2,))) == "applied"
    assert a.cached_tokens("t1", toks) == 4 * BS
    assert b.cached_tokens("t1", toks) == 0                              # nothing at B
    assert a.cached_tokens("t2", toks) == 0                              # never across tenants
    assert a.cached_tokens("t1", toks[:2 * BS] + [1] * 9) == 2 * BS
    # eviction of the third block truncates the entry before it
    assert a.apply(2, EventBatch(time.time(), (BlockRemoved((hashes[2],)),))) == "applied"
    assert a.cached_tokens("t1", toks) == 2 * BS
    assert a.apply(3, EventBatch(time.time(), (AllBlocksCleared(),))) == "applied"
    assert a.cached_tokens("t1", toks) == 0 and len(reg) == 0


def test_out_of_order_gap_and_bad_event_are_skipped():
    rng = random.Random(2)
    reg, a, _ = view_pair()
    toks = [rng.randrange(10, 500) for _ in range(2 * BS)]
    ev, _ = stored(toks)
    assert a.apply(0, EventBatch(0.0, (ev,))) == "applied"
    assert a.apply(0, EventBatch(0.0, (ev,))) == "old"
    assert a.apply(5, EventBatch(0.0, ())) == "gap" and a.last_seq == 0
    orphan = BlockStored((999,), 12345, tuple(toks[:BS]), BS)           # its parent was never stored
    assert a.apply(1, EventBatch(0.0, (orphan, AllBlocksCleared()))) == "applied"
    assert a.stats["skipped"] == 2 and a.stats["cleared"] == 1


def test_stale_when_an_expected_event_does_not_come():
    _, a, _ = view_pair()
    assert not a.stale()
    a.expect_event(within_s=0.05)
    assert not a.stale()
    assert a.stale(time.monotonic() + 0.1)
    a.apply(0, EventBatch(0.0, ()))
    assert not a.stale(time.monotonic() + 10)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zmq_stream_with_replay_of_a_gap():
    """A publisher that connects (as vLLM does to a non-wildcard endpoint); batch 1 never goes out live, the
    subscriber fetches it from the ROUTER replay socket before applying batch 2."""
    rng = random.Random(3)
    toks = [rng.randrange(10, 500) for _ in range(3 * BS)]
    ev0, h0 = stored(toks[:BS])
    ev1, h1 = stored(toks[BS:2 * BS], parent=h0[-1], base=10)
    ev2, _ = stored(toks[2 * BS:], parent=h1[-1], base=20)
    payloads = [encode_batch(EventBatch(time.time(), (e,))) for e in (ev0, ev1, ev2)]
    ep, rep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    reg, a, _ = view_pair()
    sub = KVEventSubscriber(replay_timeout_s=2.0)
    sub.add(EventSource(ep, rep, "kv"), a)
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    router.bind(rep)
    pub.connect(ep)
    stop = threading.Event()

    def serve_replay():
        while not stop.is_set():
            if router.poll(20):
                cid, _, start = router.recv_multipart()
                for s in range(int.from_bytes(start, "big"), 3):
                    router.send_multipart([cid, b"", b"kv", seq_bytes(s), payloads[s]])
                router.send_multipart([cid, b"", b"", seq_bytes(-1), b""])
    t = threading.Thread(target=serve_replay, daemon=True)
    t.start()
    sub.start()
    try:
        time.sleep(0.3)                                   # slow joiner
        for s in (0, 2):
            pub.send_multipart([b"kv", seq_bytes(s), payloads[s]])
        pub.send_multipart([b"kv", b"bad", b"x"])         # malformed: skipped
        end = time.monotonic() + 5
        while a.last_seq != 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert a.last_seq == 2 and a.stats["replayed"] >= 1
        assert a.cached_tokens("", toks) == 3 * BS
        while a.stats["skipped"] < 1 and time.monotonic() < end:
            time.sleep(0.02)
        assert a.stats["skipped"] == 1
    finally:
        stop.set()
        t.join(2)
        sub.stop()
        pub.close(0)
        router.close(0)
        ctx.term()


def test_restarted_publisher_and_expectation_after_the_event():
    rng = random.Random(5)
    _, a, _ = view_pair()
    toks = [rng.randrange(10, 500) for _ in range(2 * BS)]
    ev, _ = stored(toks)
    a.apply(0, EventBatch(0.0, (ev,)))
    a.apply(1, EventBatch(0.0, ()))
    assert a.cached_tokens("", toks) == 2 * BS
    assert a.apply(0, EventBatch(0.0, ())) == "applied"          # seq 0 again: a restarted engine holds nothing
    assert a.cached_tokens("", toks) == 0 and a.last_seq == 0
    started = time.monotonic() - 1.0                              # the call started before the last batch
    a.expect_event(within_s=0.0, since=started)
    assert not a.stale(time.monotonic() + 5)


def test_control_plane_uses_each_models_own_tokens():
    from shadowprefill.gateway.control_plane import Candidate, ControlPlane, GatewayRequest
    from shadowprefill.gateway.registry import CacheLayout, Location
    rng = random.Random(6)
    reg = CacheRegistry()
    tb = [rng.randrange(10, 500) for _ in range(8 * BS)]
    reg.insert("t", "b", "live", tb, CacheLayout(BS, 1, 1, 1), Location("s"))
    ta = [rng.randrange(10, 500) for _ in range(7 * BS)]           # model a's tokenizer splits differently
    req = GatewayRequest("t", ta, tokens_by_model={"b": tb + [1, 2]})
    d = ControlPlane(registry=reg).decide(req, [Candidate("a", "s"), Candidate("b", "s")])
    reuse = [o for o in d.options if o.action == "reuse"]
    assert [(o.model_id, o.cached_tokens) for o in reuse] == [("b", 8 * BS)]
    assert {o.model_id: o.cached_tokens for o in d.options if o.action == "reprefill"} == {"a": 0, "b": 0}
