"""pack_blocks / unpack_blocks: pages (optionally a layer range) to one contiguous buffer and back.

This is the P->D push format and the compressed-transfer format of the gateway (DESIGN.md §4, §6, §8).
quant=None copies bytes (bit-exact). quant="fp8" stores float8 e4m3 with one float32 scale per
(page, layer, K/V, head): scale = amax / 448 (448 = largest e4m3 value), 1 where amax = 0. The amax skips
non-finite values, so a NaN in the unwritten tail of a last block cannot spoil its head's scale.
"""
from typing import Optional

import torch

from . import _backend, _validate as check
from .page_copy import host_ids, page_bytes
from .reference import FP8, FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: F401 (public names kept here)

QUANTS = (None, "fp8")


def _check_common(kv_cache, block_ids, layer_start, layer_end):
    check.kv_cache(kv_cache)
    check.block_ids(block_ids, "block_ids", (kv_cache.device,))
    check.integer(layer_start, "layers[0]", 0, kv_cache.shape[1])
    check.integer(layer_end, "layers[1]", layer_start + 1, kv_cache.shape[1] + 1)


def _buf_shape(kv_cache, block_ids, layer_start, layer_end):
    return (block_ids.shape[0], layer_end - layer_start) + tuple(kv_cache.shape[2:])


def _segment(kv_cache, layer_start, layer_end):
    """(offset, length) in bytes of the layer range inside one page."""
    layer_bytes = kv_cache.stride(1) * kv_cache.element_size()
    return layer_start * layer_bytes, (layer_end - layer_start) * layer_bytes


@torch.library.custom_op("shadowprefill::pack_blocks", mutates_args=())
def _pack_blocks_op(kv_cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int,
                    quant: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    _check_common(kv_cache, block_ids, layer_start, layer_end)
    if _backend.value_checks_enabled(kv_cache.device) or block_ids.device.type == "cpu":
        check.ids_in_range(block_ids.cpu(), "block_ids", kv_cache.shape[0])  # host ids: no sync
    shape = _buf_shape(kv_cache, block_ids, layer_start, layer_end)
    no_scales = kv_cache.new_empty((0,), dtype=torch.float32)
    if shape[0] == 0:
        buf = kv_cache.new_empty(shape, dtype=FP8 if quant else kv_cache.dtype)
        return buf, kv_cache.new_empty(shape[:4], dtype=torch.float32) if quant else no_scales
    if _backend.use_triton(kv_cache.device):
        kernel = _backend.triton_kernel("pack_blocks")
        buf, scales = kernel(kv_cache, block_ids.to(kv_cache.device).contiguous(), layer_start, layer_end, quant)
        return buf, scales if quant else no_scales
    if quant == "fp8":
        return quantize_fp8(kv_cache[block_ids.to(kv_cache.device).long(), layer_start:layer_end])
    if kv_cache.device.type != "cpu":
        return kv_cache[block_ids.to(kv_cache.device).long(), layer_start:layer_end].contiguous(), no_scales
    buf = kv_cache.new_empty(shape)
    ids = host_ids(block_ids)
    offset, length = _segment(kv_cache, layer_start, layer_end)
    _backend.cpu_extension().copy_segments(kv_cache.data_ptr(), buf.data_ptr(), ids.data_ptr(), 0, ids.numel(),
                                           page_bytes(kv_cache), length, offset, 0, length, num_threads=0,
                                           src_count=kv_cache.shape[0], dst_count=ids.numel())
    return buf, no_scales


@_pack_blocks_op.register_fake
def _(kv_cache, block_ids, layer_start, layer_end, quant):
    _check_common(kv_cache, block_ids, layer_start, layer_end)
    shape = _buf_shape(kv_cache, block_ids, layer_start, layer_end)
    buf = kv_cache.new_empty(shape, dtype=FP8 if quant else kv_cache.dtype)
    return buf, kv_cache.new_empty(shape[:4] if quant else (0,), dtype=torch.float32)


def _check_unpack(buf, scales, kv_cache, block_ids, layer_start, layer_end):
    _check_common(kv_cache, block_ids, layer_start, layer_end)
    check.tensor(buf, "buf", 6, (kv_cache.dtype, FP8))
    check.shape(buf, "buf", _buf_shape(kv_cache, block_ids, layer_start, layer_end),
                "[len(block_ids), layers, 2, num_kv_heads, block_size, head_dim]")
    check.device(buf, "buf", kv_cache.device, "kv_cache")
    check.contiguous(buf, "buf")
    if buf.dtype == FP8:
        if scales is None:
            raise ValueError("scales: required for an fp8 buf")
        check.tensor(scales, "scales", 4, (torch.float32,))
        check.shape(scales, "scales", buf.shape[:4], "one scale per page, layer, K/V, head")
        check.device(scales, "scales", kv_cache.device, "kv_cache")
    elif scales is not None:
        raise ValueError(f"scales: must be None for a buf of dtype {buf.dtype} (not quantised)")


@torch.library.custom_op("shadowprefill::unpack_blocks", mutates_args=("kv_cache",))
def _unpack_blocks_op(buf: torch.Tensor, scales: Optional[torch.Tensor], kv_cache: torch.Tensor,
                      block_ids: torch.Tensor, layer_start: int, layer_end: int) -> None:
    _check_unpack(buf, scales, kv_cache, block_ids, layer_start, layer_end)
    if _backend.value_checks_enabled(kv_cache.device) or block_ids.device.type == "cpu":
        ids = block_ids.cpu()  # host ids: no sync
        check.ids_in_range(ids, "block_ids", kv_cache.shape[0])
        if _backend.value_checks_enabled(kv_cache.device):
            check.unique(ids, "block_ids")
    if buf.shape[0] == 0:
        return
    if _backend.use_triton(kv_cache.device):
        kernel = _backend.triton_kernel("unpack_blocks")
        kernel(buf, scales, kv_cache, block_ids.to(kv_cache.device).contiguous(), layer_start, layer_end)
    elif scales is not None:
        pages = dequantize_fp8(buf, scales, kv_cache.dtype)
        kv_cache[block_ids.to(kv_cache.device).long(), layer_start:layer_end] = pages
    elif kv_cache.device.type != "cpu":
        kv_cache[block_ids.to(kv_cache.device).long(), layer_start:layer_end] = buf
    else:
        ids = host_ids(block_ids)
        offset, length = _segment(kv_cache, layer_start, layer_end)
        _backend.cpu_extension().copy_segments(buf.data_ptr(), kv_cache.data_ptr(), 0, ids.data_ptr(),
                                               ids.numel(), length, page_bytes(kv_cache), 0, offset, length,
                                               num_threads=0, src_count=ids.numel(), dst_count=kv_cache.shape[0])


@_unpack_blocks_op.register_fake
def _(buf, scales, kv_cache, block_ids, layer_start, layer_end):
    _check_unpack(buf, scales, kv_cache, block_ids, layer_start, layer_end)


def pack_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, layers=None, quant: Optional[str] = None):
    """Gather pages `block_ids` (layers = None for all or a (start, stop) range) into one buffer.

    Returns (buf [n, layers, 2, Hkv, block_size, D], scales): buf has the cache dtype and scales is None for
    quant=None (bit-exact); for quant="fp8" buf is float8_e4m3fn and scales float32 [n, layers, 2, Hkv].
    """
    check.tensor(kv_cache, "kv_cache", 6)
    check.tensor(block_ids, "block_ids")
    start, stop = check.layer_range(layers, kv_cache.shape[1])
    if quant not in QUANTS:
        raise ValueError(f"quant: expected None or 'fp8', got {quant!r}")
    buf, scales = torch.ops.shadowprefill.pack_blocks(kv_cache, block_ids, start, stop, quant)
    return buf, (scales if quant else None)


def unpack_blocks(buf: torch.Tensor, scales: Optional[torch.Tensor], kv_cache: torch.Tensor,
                  block_ids: torch.Tensor, layers=None) -> None:
    """Scatter `buf` (from pack_blocks, same `layers`) into pages `block_ids` of kv_cache, dequantising fp8.

    Duplicate block ids are an error.
    """
    check.tensor(buf, "buf")
    check.tensor(kv_cache, "kv_cache", 6)
    check.tensor(block_ids, "block_ids")
    if scales is not None:
        check.tensor(scales, "scales")
    start, stop = check.layer_range(layers, kv_cache.shape[1])
    torch.ops.shadowprefill.unpack_blocks(buf, scales, kv_cache, block_ids, start, stop)
