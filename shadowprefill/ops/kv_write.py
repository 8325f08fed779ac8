"""write_kv_cache / write_kv: scatter the new tokens' K and V into their slots of a paged cache
(DESIGN.md §4).

slot = block_id * block_size + offset; a negative slot (padding, or a token whose K/V is not kept) is
skipped. write_kv_cache takes any engine's layout (key_cache / value_cache [num_blocks, block_size, Hkv, D],
any strides, contiguous last dimension); write_kv on the block-major cache is a thin wrapper over the
same code with the views kv_cache[:, layer, 0 / 1].transpose(1, 2).
"""
import torch

from . import _backend, _validate as check, reference


def _check_structure(key, value, key_cache, value_cache, slot_mapping, cache_name="key_cache"):
    _, _, num_kv_heads, head_dim = check.kv_views(key_cache, value_cache)
    for x, name in ((key, "key"), (value, "value")):
        check.tensor(x, name, 3)
        check.same_dtype(x, name, key_cache.dtype, cache_name)
        check.device(x, name, key_cache.device, cache_name)
        if x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected shape [T, {num_kv_heads}, {head_dim}] (num_kv_heads, head_dim "
                             f"of {cache_name}), got {tuple(x.shape)}")
    check.shape(value, "value", key.shape, "the shape of key")
    check.tensor(slot_mapping, "slot_mapping", 1, (torch.int64,))
    check.shape(slot_mapping, "slot_mapping", key.shape[:1], "one slot per token of key")
    check.device(slot_mapping, "slot_mapping", key_cache.device, cache_name)


def _check_values(num_blocks, block_size, slot_mapping):
    slots = slot_mapping.cpu()
    slots = slots[slots >= 0]
    num_slots = num_blocks * block_size
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slot {int(slots.max())} out of range [0, {num_slots}) "
                         f"(num_blocks * block_size)")
    check.unique(slots, "slot_mapping")


def _run(key, value, key_cache, value_cache, slot_mapping):
    """The implementation behind both custom ops (structure already checked)."""
    if _backend.value_checks_enabled(key_cache.device):
        _check_values(key_cache.shape[0], key_cache.shape[1], slot_mapping)
        check.distinct_views(key_cache, value_cache)
    if key.shape[0] == 0:
        return
    if _backend.use_triton(key_cache.device):
        _backend.triton_kernel("write_kv_cache")(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                                 slot_mapping.contiguous())
    else:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


@torch.library.custom_op("shadowprefill::write_kv_cache", mutates_args=("key_cache", "value_cache"))
def _write_kv_cache_op(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    _check_structure(key, value, key_cache, value_cache, slot_mapping)
    _run(key, value, key_cache, value_cache, slot_mapping)


@_write_kv_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    _check_structure(key, value, key_cache, value_cache, slot_mapping)


def _layer_views(kv_cache, layer):
    check.kv_cache(kv_cache)
    check.integer(layer, "layer", 0, kv_cache.shape[1])
    return reference.layer_views(kv_cache, layer)


@torch.library.custom_op("shadowprefill::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor) -> None:
    key_cache, value_cache = _layer_views(kv_cache, layer)
    _check_structure(key, value, key_cache, value_cache, slot_mapping, "kv_cache")
    _run(key, value, key_cache, value_cache, slot_mapping)


@_write_kv_op.register_fake
def _(key, value, kv_cache, layer, slot_mapping):
    key_cache, value_cache = _layer_views(kv_cache, layer)
    _check_structure(key, value, key_cache, value_cache, slot_mapping, "kv_cache")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into any engine's paged cache at slot_mapping [T] int64 slots.

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] views with any strides but a contiguous last
    dimension (see paged_attention_kv); written in place, no copy. Negative slots are skipped; duplicate
    non-negative slots are an error.
    """
    for x, name in ((key, "key"), (value, "value"), (key_cache, "key_cache"), (value_cache, "value_cache"),
                    (slot_mapping, "slot_mapping")):
        check.tensor(x, name)
    torch.ops.shadowprefill.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """write_kv_cache into layer `layer` of the block-major `kv_cache` [num_blocks, L, 2, Hkv, block_size, D].

    Negative slots are skipped; duplicate non-negative slots are an error.
    """
    for x, name in ((key, "key"), (value, "value"), (kv_cache, "kv_cache"), (slot_mapping, "slot_mapping")):
        check.tensor(x, name)
    check.integer(layer, "layer", 0)
    torch.ops.shadowprefill.write_kv(key, value, kv_cache, layer, slot_mapping)
