"""KV-cache events on the wire (vLLM's `--kv-events-config` ZMQ publisher format) and their meaning.

A publisher sends multipart messages `(topic, seq, payload)`: `seq` an 8-byte big-endian sequence number,
`payload` a msgpack `KVEventBatch` = `[ts, [event, ...], data_parallel_rank]`, each event a map tagged by
`"type"`:

- `BlockStored`: `block_hashes` (int or bytes, one per full block, in chain order), `parent_block_hash`
  (the block before the first, or None), `token_ids` (the blocks' tokens), `block_size`, `extra_keys` (per
  block: LoRA name, multimodal keys and the request's `cache_salt`, untagged), `medium`, ...;
- `BlockRemoved`: `block_hashes`, `medium`;
- `AllBlocksCleared`: the engine dropped its whole prefix cache (`reset_prefix_cache`, restart).

The replay socket (ROUTER) answers a request `(b"", start_seq as 8 bytes)` with every buffered
`(b"", topic, seq, payload)` from `start_seq` on, then an end marker with seq -1. This module decodes and
encodes that format with `msgpack` (the built-in server publishes the same bytes); it never imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack

END_SEQ = -1


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple
    parent_block_hash: object
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple
    data_parallel_rank: int | None = None


def _hash(h):
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return h
    raise ValueError(f"block hash must be int or bytes, got {type(h).__name__}")


def _event(d) -> object:
    if isinstance(d, (list, tuple)) and d and isinstance(d[0], str):       # array-like encoding: [tag, *fields]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium", "lora_name", "extra_keys"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}.get(d[0])
        if names is None:
            raise ValueError(f"unknown event type {d[0]!r}")
        d = {"type": d[0], **dict(zip(names, d[1:]))}
    if not isinstance(d, dict):
        raise ValueError(f"event must be a map, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "BlockStored":
        hashes = tuple(_hash(h) for h in d["block_hashes"])
        tokens = tuple(int(t) for t in d["token_ids"])
        bs = d["block_size"]
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"BlockStored.block_size must be a positive int, got {bs!r}")
        if len(tokens) != len(hashes) * bs:
            raise ValueError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {bs}")
        parent = d.get("parent_block_hash")
        extra = d.get("extra_keys")
        return BlockStored(hashes, None if parent is None else _hash(parent), tokens, bs,
                           None if extra is None else tuple(None if e is None else tuple(e) for e in extra),
                           d.get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(_hash(h) for h in d["block_hashes"]), d.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack `KVEventBatch` -> EventBatch; ValueError (naming what is wrong) on anything malformed."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise ValueError("payload must be [ts, events, data_parallel_rank]")
    try:
        events = tuple(_event(e) for e in raw[1])
        ts = float(raw[0])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed event: {exc!r}") from None
    return EventBatch(ts, events, raw[2] if len(raw) > 2 else None)


def _event_dict(e) -> dict:
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
                "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": None, "medium": e.medium,
                "lora_name": None, "extra_keys": None if e.extra_keys is None else [
                    None if k is None else list(k) for k in e.extra_keys]}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(e).__name__}")


def encode_batch(batch: EventBatch) -> bytes:
    """EventBatch -> the msgpack bytes vLLM's publisher sends."""
    return msgpack.packb([batch.ts, [_event_dict(e) for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return int(seq).to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
