"""KV transfer path of the gateway: pack → (compress) → wire bytes → unpack (paper 003, §III-D, §IV-F).

The bytes that cross the wire are exactly what ``shadowprefill.ops.pack_blocks`` produces (raw pages, or
fp8 e4m3 with one float32 scale per (page, layer, K/V, head), DESIGN.md §4), framed by a small JSON header.
:func:`packed_nbytes` predicts that size from the page shape so the control plane can cost a transfer
without packing anything; a test checks the prediction against the kernel's buffers.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sites import Link

if TYPE_CHECKING:  # torch is imported where tensors are handled, so the gateway imports without it
    import torch


@dataclass(frozen=True)
class Codec:
    """A compression format for KV pages and the task-level quality loss it is declared to cost."""

    name: str
    element_bytes: int  # bytes per K/V element on the wire
    scale_bytes: int  # bytes of scale per (page, layer, K/V, head)
    quality_loss: float  # d in Q = q − d (§III-A); 0 for lossless


# fp8 e4m3 with per-head scales: 3 mantissa bits, relative error <= 2^-4. Declared loss 0.005 (half a point
# of task accuracy) is an assumption of this project, of the order ZipCache reports at 4.98x (0.38%, [37]).
CODECS: dict[str, Codec] = {"fp8": Codec("fp8", element_bytes=1, scale_bytes=4, quality_loss=0.005)}


def codec_quality_loss(compression: str | None) -> float:
    if compression is None:
        return 0.0
    try:
        return CODECS[compression].quality_loss
    except KeyError:
        raise ValueError(f"compression must be None or one of {sorted(CODECS)}, got {compression!r}") from None


def packed_nbytes(num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype_bytes: int, quant: str | None = None) -> int:
    """Bytes of ``pack_blocks`` output (buffer + scales) for ``num_blocks`` pages of ``num_layers`` layers."""
    elems = num_blocks * num_layers * 2 * num_kv_heads * block_size * head_dim
    if quant is None:
        return elems * dtype_bytes
    codec = CODECS.get(quant)
    if codec is None:
        raise ValueError(f"quant must be None or one of {sorted(CODECS)}, got {quant!r}")
    return elems * codec.element_bytes + num_blocks * num_layers * 2 * num_kv_heads * codec.scale_bytes


def layout_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                           block_size: int, compression: str | None = None) -> float:
    """Stored / wire bytes per token of a page layout (scale overhead spread over the page)."""
    return packed_nbytes(1, num_layers, num_kv_heads, head_dim, block_size, dtype_bytes, compression) / block_size


def choose_codec(base_quality: float, min_quality: float) -> str | None:
    """The smallest wire format whose declared loss keeps Q = q − d >= Q̄ (None: send raw pages)."""
    best, best_bytes = None, None
    for name, c in CODECS.items():
        if base_quality - c.quality_loss >= min_quality and (best_bytes is None or c.element_bytes < best_bytes):
            best, best_bytes = name, c.element_bytes
    return best


@dataclass
class KVPayload:
    """What travels: the packed buffer, its scales (fp8 only) and enough metadata to unpack it."""

    buf: torch.Tensor
    scales: torch.Tensor | None
    quant: str | None
    layers: tuple[int, int] | None
    num_blocks: int

    @property
    def nbytes(self) -> int:
        n = self.buf.numel() * self.buf.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n


def pack_for_transfer(kv_cache: torch.Tensor, block_ids, layers=None, quant: str | None = None) -> KVPayload:
    """Gather pages ``block_ids`` (optionally a layer range) with the project's pack kernel."""
    if quant is not None and quant not in CODECS:
        raise ValueError(f"quant must be None or one of {sorted(CODECS)}, got {quant!r}")
    import torch

    from shadowprefill import ops  # lazy: the gateway imports without compiled ops

    block_ids = torch.as_tensor(block_ids, dtype=torch.int64)
    buf, scales = ops.pack_blocks(kv_cache, block_ids, layers=layers, quant=quant)
    return KVPayload(buf, scales, quant, None if layers is None else tuple(layers), int(block_ids.numel()))


def unpack_from_transfer(payload: KVPayload, kv_cache: torch.Tensor, block_ids) -> None:
    """Scatter a received payload into pages ``block_ids`` of ``kv_cache`` (dequantising fp8)."""
    if not isinstance(payload, KVPayload):
        raise TypeError(f"payload must be KVPayload, got {type(payload).__name__}")
    import torch

    block_ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if block_ids.numel() != payload.num_blocks:
        raise ValueError(f"block_ids has {block_ids.numel()} ids, payload carries {payload.num_blocks} pages")
    from shadowprefill import ops

    buf, scales = payload.buf, payload.scales
    if buf.device != kv_cache.device:
        buf = buf.to(kv_cache.device)
        scales = None if scales is None else scales.to(kv_cache.device)
    ops.unpack_blocks(buf, scales, kv_cache, block_ids, layers=payload.layers)


_MAGIC = b"SPKV1"


def _tensor_bytes(t: "torch.Tensor") -> bytes:
    import torch

    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _tensor_from(data: memoryview, dtype: str, shape: list[int]) -> "torch.Tensor":
    import torch

    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def encode(payload: KVPayload) -> bytes:
    """Wire format: magic, header length, JSON header, buffer bytes, scale bytes."""
    header = {"quant": payload.quant, "layers": payload.layers, "num_blocks": payload.num_blocks,
              "buf": [str(payload.buf.dtype).removeprefix("torch."), list(payload.buf.shape)],
              "scales": None if payload.scales is None else
              [str(payload.scales.dtype).removeprefix("torch."), list(payload.scales.shape)]}
    h = json.dumps(header).encode()
    parts = [_MAGIC, struct.pack("<I", len(h)), h, _tensor_bytes(payload.buf)]
    if payload.scales is not None:
        parts.append(_tensor_bytes(payload.scales))
    return b"".join(parts)


def decode(data: bytes) -> KVPayload:
    """Inverse of :func:`encode` (tensors land on the CPU)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if bytes(mv[:len(_MAGIC)]) != _MAGIC:
        raise ValueError("data: not a KV payload (bad magic)")
    (hlen,) = struct.unpack_from("<I", mv, len(_MAGIC))
    off = len(_MAGIC) + 4
    header = json.loads(bytes(mv[off:off + hlen]))
    off += hlen
    import torch

    tensors = []
    for spec in (header["buf"], header["scales"]):
        if spec is None:
            tensors.append(None)
            continue
        dtype, shape = spec
        n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for s in shape:
            n *= s
        tensors.append(_tensor_from(mv[off:off + n], dtype, shape))
        off += n
    if off != len(mv):
        raise ValueError(f"data: {len(mv) - off} trailing bytes")
    layers = header["layers"]
    return KVPayload(tensors[0], tensors[1], header["quant"], None if layers is None else tuple(layers),
                     header["num_blocks"])


@dataclass(frozen=True)
class TransferReport:
    wire_bytes: int  # bytes that crossed the (simulated) wire, header included
    payload_bytes: int  # kernel buffer + scales
    est_time_s: float  # Eq. 1 estimate over ``link`` (0 without a link)


def send_blocks(src_cache: torch.Tensor, src_block_ids, dst_cache: torch.Tensor, dst_block_ids,
                layers=None, quant: str | None = None, link: Link | None = None) -> TransferReport:
    """Move pages between two caches through the wire format: pack → encode → decode → unpack."""
    payload = pack_for_transfer(src_cache, src_block_ids, layers=layers, quant=quant)
    wire = encode(payload)
    unpack_from_transfer(decode(wire), dst_cache, dst_block_ids)
    t = 0.0 if link is None else link.transfer_time_s(len(wire))
    return TransferReport(len(wire), payload.nbytes, t)
