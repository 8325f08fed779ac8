"""pack_blocks / unpack_blocks: pages (a layer range of them) to one contiguous buffer and back.

This is the P->D push format and the compressed-transfer format of the gateway (DESIGN.md §4, §8).
In a page [L, 2, Hkv, bs, D] each (layer, K/V, head) tile of bs * D elements is contiguous, and so are the
tiles of a layer range; the buffer [n, L', 2, Hkv, bs, D] keeps the same order. So the unit of work is one
such tile ("unit"): a program moves `units_per_program` of them.
quant=None copies bits. quant="fp8" stores e4m3 with one float32 scale per (page, layer, K/V, head) unit,
scale = amax / 448 computed in the kernel over the unit's finite values (an all-zero unit gets scale 1),
payload = clamp(x / scale, -448, 448) rounded to nearest even; unpack writes payload * scale.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import fp8, launch

FP8_MAX = 448.0


@triton.jit
def _scale_of(amax):
    """amax / 448 rounded to nearest (div.rn.f32, as torch divides), 1 where amax is 0."""
    return tl.where(amax > 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def _quantise(x, scale, SOFT_FP8: tl.constexpr):
    # exact division: `/` lowers to the approximate div.full.f32 (up to 2 ulp off torch's quotient)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # NaN passes through as NaN
    if SOFT_FP8:  # one return: the compiler type-checks every return, even in a dead constexpr branch
        q = fp8.encode_e4m3(y)
    else:
        q = y.to(tl.float8e4nv)
    return q


@triton.jit
def pack_kernel(kv_ptr, block_ids_ptr, buf_ptr, scale_ptr, layer_offset, stride_kb, num_units,
                UNIT: tl.constexpr, UNITS: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                QUANT: tl.constexpr, SOFT_FP8: tl.constexpr):
    i = tl.program_id(0)
    offs_u = tl.program_id(1) * UNITS + tl.arange(0, UNITS)
    u_ok = offs_u < num_units
    page = tl.load(block_ids_ptr + i).to(tl.int64)
    src = kv_ptr + page * stride_kb + layer_offset + offs_u[:, None].to(tl.int64) * UNIT
    packed_unit = i.to(tl.int64) * num_units + offs_u
    dst = buf_ptr + packed_unit[:, None] * UNIT
    offs_e = tl.arange(0, CHUNK)
    if not QUANT:
        for c in tl.static_range(NUM_CHUNKS):
            e = c * CHUNK + offs_e
            mask = u_ok[:, None] & (e < UNIT)[None, :]
            tl.store(dst + e[None, :], tl.load(src + e[None, :], mask=mask), mask=mask)
    elif NUM_CHUNKS == 1:
        mask = u_ok[:, None] & (offs_e < UNIT)[None, :]
        x = tl.load(src + offs_e[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), 1)  # NaN/inf left out
        scale = _scale_of(amax)
        tl.store(scale_ptr + packed_unit, scale, mask=u_ok)
        tl.store(dst + offs_e[None, :], _quantise(x, scale, SOFT_FP8), mask=mask)
    else:  # unit larger than one tile: an amax pass, then a quantise pass (second read mostly from L2)
        amax = tl.zeros([UNITS], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            e = c * CHUNK + offs_e
            mask = u_ok[:, None] & (e < UNIT)[None, :]
            x = tl.load(src + e[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), 1))
        scale = _scale_of(amax)
        tl.store(scale_ptr + packed_unit, scale, mask=u_ok)
        for c in tl.static_range(NUM_CHUNKS):
            e = c * CHUNK + offs_e
            mask = u_ok[:, None] & (e < UNIT)[None, :]
            x = tl.load(src + e[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(dst + e[None, :], _quantise(x, scale, SOFT_FP8), mask=mask)


@triton.jit
def unpack_kernel(buf_ptr, scale_ptr, kv_ptr, block_ids_ptr, layer_offset, stride_kb, num_units,
                  UNIT: tl.constexpr, UNITS: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                  QUANT: tl.constexpr, SOFT_FP8: tl.constexpr):
    i = tl.program_id(0)
    offs_u = tl.program_id(1) * UNITS + tl.arange(0, UNITS)
    u_ok = offs_u < num_units
    page = tl.load(block_ids_ptr + i).to(tl.int64)
    dst = kv_ptr + page * stride_kb + layer_offset + offs_u[:, None].to(tl.int64) * UNIT
    packed_unit = i.to(tl.int64) * num_units + offs_u
    src = buf_ptr + packed_unit[:, None] * UNIT
    if QUANT:
        scale = tl.load(scale_ptr + packed_unit, mask=u_ok, other=1.0)
    offs_e = tl.arange(0, CHUNK)
    for c in tl.static_range(NUM_CHUNKS):
        e = c * CHUNK + offs_e
        mask = u_ok[:, None] & (e < UNIT)[None, :]
        x = tl.load(src + e[None, :], mask=mask)
        if QUANT:
            if SOFT_FP8:
                x = fp8.decode_e4m3(x)
            else:
                x = x.to(tl.float32)
            x = (x * scale[:, None]).to(kv_ptr.dtype.element_ty)
        tl.store(dst + e[None, :], x, mask=mask)


def _geometry(kv_cache: torch.Tensor, layer_start: int, layer_end: int):
    _, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    unit = block_size * head_dim
    num_units = (layer_end - layer_start) * 2 * num_kv_heads
    return unit, num_units, launch.copy_tile(unit)


def _soft_fp8(kernel, device: torch.device, force_soft: bool) -> bool:
    return force_soft or launch.is_interpreted(kernel) or device.type != "cuda"


def _check_quant(quant: Optional[str]) -> None:
    if quant not in (None, "fp8"):
        raise ValueError(f"quant: expected None or 'fp8', got {quant!r}")


def pack_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int,
                quant: Optional[str] = None, *, force_soft_fp8: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather pages `block_ids` (layers [layer_start, layer_end)) into buf [n, L, 2, Hkv, bs, D].

    quant=None: buf has the cache dtype and the exact bits; scales is an empty float32 tensor.
    quant="fp8": buf is torch.float8_e4m3fn, scales [n, L, 2, Hkv] float32 (amax / 448 per unit).
    `force_soft_fp8` (tests, device check) uses the integer fp8 conversion even on a GPU.
    """
    _check_quant(quant)
    n = block_ids.shape[0]
    _, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    num_layers = layer_end - layer_start
    shape = (n, num_layers, 2, num_kv_heads, block_size, head_dim)
    buf = torch.empty(shape, dtype=kv_cache.dtype if quant is None else torch.float8_e4m3fn,
                      device=kv_cache.device)
    scales = torch.empty((n, num_layers, 2, num_kv_heads) if quant else (0,), dtype=torch.float32,
                         device=kv_cache.device)
    if buf.numel() == 0:
        return buf, scales
    unit, num_units, tile = _geometry(kv_cache, layer_start, layer_end)
    soft = quant is not None and _soft_fp8(pack_kernel, kv_cache.device, force_soft_fp8)
    pack_kernel[(n, launch.cdiv(num_units, tile.units_per_program))](
        kv_cache, block_ids, buf.view(torch.uint8) if soft else buf, scales,
        layer_start * kv_cache.stride(1), kv_cache.stride(0), num_units,
        UNIT=unit, UNITS=tile.units_per_program, CHUNK=tile.chunk, NUM_CHUNKS=tile.num_chunks,
        QUANT=quant is not None, SOFT_FP8=soft, num_warps=tile.num_warps)
    return buf, scales


def unpack_blocks(buf: torch.Tensor, scales: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                  layer_start: int, layer_end: int, *, force_soft_fp8: bool = False) -> None:
    """Scatter buf [n, L, 2, Hkv, bs, D] back into pages `block_ids`, layers [layer_start, layer_end);
    a float8_e4m3fn buf is dequantised with `scales` [n, L, 2, Hkv] into the cache dtype."""
    n = block_ids.shape[0]
    if n == 0 or buf.numel() == 0:
        return
    quant = buf.dtype == torch.float8_e4m3fn
    unit, num_units, tile = _geometry(kv_cache, layer_start, layer_end)
    soft = quant and _soft_fp8(unpack_kernel, kv_cache.device, force_soft_fp8)
    unpack_kernel[(n, launch.cdiv(num_units, tile.units_per_program))](
        buf.view(torch.uint8) if soft else buf, scales if quant else buf, kv_cache, block_ids,
        layer_start * kv_cache.stride(1), kv_cache.stride(0), num_units,
        UNIT=unit, UNITS=tile.units_per_program, CHUNK=tile.chunk, NUM_CHUNKS=tile.num_chunks,
        QUANT=quant, SOFT_FP8=soft, num_warps=tile.num_warps)
