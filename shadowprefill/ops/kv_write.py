"""write_kv: scatter the new tokens' K and V into their slots of the paged cache (DESIGN.md §4).

slot = block_id * block_size + offset; a negative slot (padding, or a token whose K/V is not kept) is
skipped.
"""
import torch

from . import _backend, _validate as check


def _check_structure(key, value, kv_cache, layer, slot_mapping):
    check.kv_cache(kv_cache)
    _, num_layers, _, num_kv_heads, _, head_dim = kv_cache.shape
    check.integer(layer, "layer", 0, num_layers)
    for x, name in ((key, "key"), (value, "value")):
        check.tensor(x, name, 3)
        check.same_dtype(x, name, kv_cache.dtype, "kv_cache")
        check.device(x, name, kv_cache.device, "kv_cache")
        if x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected shape [T, {num_kv_heads}, {head_dim}] (num_kv_heads, head_dim "
                             f"of kv_cache), got {tuple(x.shape)}")
    check.shape(value, "value", key.shape, "the shape of key")
    check.tensor(slot_mapping, "slot_mapping", 1, (torch.int64,))
    check.shape(slot_mapping, "slot_mapping", key.shape[:1], "one slot per token of key")
    check.device(slot_mapping, "slot_mapping", kv_cache.device, "kv_cache")


def _check_values(kv_cache, slot_mapping):
    slots = slot_mapping.cpu()
    slots = slots[slots >= 0]
    num_slots = kv_cache.shape[0] * kv_cache.shape[4]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slot {int(slots.max())} out of range [0, {num_slots}) "
                         f"(num_blocks * block_size)")
    check.unique(slots, "slot_mapping")


def _reference(key, value, kv_cache, layer, slot_mapping):
    block_size = kv_cache.shape[4]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for kind, x in ((0, key), (1, value)):
        kv_cache[:, layer, kind][blocks, :, offsets] = x[keep]  # [n, Hkv, D] into (block, :, offset, :)


@torch.library.custom_op("shadowprefill::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor) -> None:
    _check_structure(key, value, kv_cache, layer, slot_mapping)
    if _backend.value_checks_enabled(kv_cache.device):
        _check_values(kv_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if _backend.use_triton(kv_cache.device):
        _backend.triton_kernel("write_kv")(key.contiguous(), value.contiguous(), kv_cache, layer,
                                           slot_mapping.contiguous())
    else:
        _reference(key, value, kv_cache, layer, slot_mapping)


@_write_kv_op.register_fake
def _(key, value, kv_cache, layer, slot_mapping):
    _check_structure(key, value, kv_cache, layer, slot_mapping)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] of layer `layer` into `kv_cache` at slot_mapping [T] int64 slots.

    Negative slots are skipped; duplicate non-negative slots are an error.
    """
    for x, name in ((key, "key"), (value, "value"), (kv_cache, "kv_cache"), (slot_mapping, "slot_mapping")):
        check.tensor(x, name)
    check.integer(layer, "layer", 0)
    torch.ops.shadowprefill.write_kv(key, value, kv_cache, layer, slot_mapping)
