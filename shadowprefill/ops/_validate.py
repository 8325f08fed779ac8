"""Argument checks shared by the ops.

Two kinds, kept apart on purpose:
- structure checks (type, shape, dtype, device, contiguity) never look at tensor values, so they also run
  on fake tensors inside torch.compile; they raise TypeError / ValueError naming the argument;
- value checks (ids in range, duplicates, monotone offsets) read the data; they take CPU tensors and the
  ops run them on CPU inputs always and on CUDA inputs only in debug mode (see _backend).
"""
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(x, name: str, ndim: Optional[int] = None, dtypes: Sequence[torch.dtype] = ()) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes and x.dtype not in dtypes:
        raise TypeError(f"{name}: dtype must be one of {_names(dtypes)}, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def shape(x: torch.Tensor, name: str, expected: Sequence[int], what: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        hint = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{hint}, got {tuple(x.shape)}")


def same_dtype(x: torch.Tensor, name: str, dtype: torch.dtype, other: str) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name}: dtype {x.dtype} differs from {other} dtype {dtype}")


def device(x: torch.Tensor, name: str, expected: torch.device, other: str) -> None:
    if x.device != expected:
        raise ValueError(f"{name}: on {x.device}, expected {expected} (the device of {other})")


def contiguous(x: torch.Tensor, name: str) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {tuple(x.stride())})")


def integer(v, name: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """A Python int with low <= v < high."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):  # SymInt: traced by torch.compile
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if (low is not None and v < low) or (high is not None and v >= high):
        raise ValueError(f"{name}: {v} out of range [{low}, {high})")
    return v


def positive_float(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"{name}: must be a finite number > 0, got {v}")
    return float(v) if isinstance(v, (int, float)) else v


def non_negative_float(v, name: str) -> float:
    """A finite number >= 0 (0 = the feature is off)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    if not (v >= 0 and v < float("inf")):
        raise ValueError(f"{name}: must be a finite number >= 0 (0 = off), got {v}")
    return float(v) if isinstance(v, (int, float)) else v


def kv_cache(x, name: str = "kv_cache") -> torch.Tensor:
    """A block-major cache [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]."""
    tensor(x, name, 6, FLOAT_DTYPES)
    if x.shape[2] != 2:
        raise ValueError(f"{name}: dim 2 must be 2 (K, V) in the layout "
                         f"[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], got {tuple(x.shape)}")
    contiguous(x, name)
    return x


def kv_views(key_cache, value_cache) -> tuple:
    """A K/V pair of paged views [num_blocks, block_size, num_kv_heads, head_dim]: any strides but a
    contiguous last dimension, equal shapes, dtypes and devices. Returns (num_blocks, block_size, Hkv, D)."""
    for x, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        tensor(x, name, 4, FLOAT_DTYPES)
        if x.shape[3] > 1 and x.stride(3) != 1:
            raise ValueError(f"{name}: the last dimension (head_dim) must be contiguous, got strides "
                             f"{tuple(x.stride())} for shape {tuple(x.shape)} "
                             "[num_blocks, block_size, num_kv_heads, head_dim]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache shape "
                         f"{tuple(key_cache.shape)}")
    same_dtype(value_cache, "value_cache", key_cache.dtype, "key_cache")
    device(value_cache, "value_cache", key_cache.device, "key_cache")
    return tuple(key_cache.shape)


def distinct_views(key_cache, value_cache) -> None:
    """A write target pair must not be one and the same view (every write would land twice)."""
    if (key_cache.numel() and key_cache.data_ptr() == value_cache.data_ptr()
            and key_cache.stride() == value_cache.stride()):
        raise ValueError("value_cache: is the same memory as key_cache (pass the K and the V view)")


def block_ids(x, name: str, cache_devices: Sequence[torch.device]) -> torch.Tensor:
    """A 1-D int32/int64 id tensor on the CPU or on one of the caches' devices."""
    tensor(x, name, 1, ID_DTYPES)
    if x.device.type != "cpu" and x.device not in cache_devices:
        raise ValueError(f"{name}: on {x.device}, expected cpu or {cache_devices[0]}")
    return x


def layer_range(layers, num_layers: int) -> tuple:
    """None -> all layers; (start, stop) -> that half-open range."""
    if layers is None:
        return 0, num_layers
    if not isinstance(layers, (tuple, list)) or len(layers) != 2:
        raise TypeError(f"layers: expected None or a (start, stop) pair, got {layers!r}")
    start = integer(layers[0], "layers[0]", 0, num_layers)
    stop = integer(layers[1], "layers[1]", start + 1, num_layers + 1)
    return start, stop


# ---- value checks (CPU tensors) --------------------------------------------------------------------------

def ids_in_range(ids: torch.Tensor, name: str, limit: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise ValueError(f"{name}: id {int(bad)} out of range [0, {limit})")


def unique(ids: torch.Tensor, name: str) -> None:
    if ids.numel() > 1:
        values, counts = torch.unique(ids, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"{name}: duplicate destination id {int(values[counts > 1][0])}")
