"""write_kv: scatter the new tokens' K and V into their slots of the block-major paged cache.

slot = block_id * block_size + offset (int64); a negative slot is skipped. One program per token writes
all KV heads of that token: kv_cache[block, layer, 0|1, h, offset, :] = key|value[t, h, :].
"""
import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, kv_ptr, slot_ptr, layer_offset,
                    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                    stride_kb, stride_kv, stride_kh, stride_kt,
                    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (kv_ptr + block * stride_kb + layer_offset + offset * stride_kt
           + offs_h[:, None].to(tl.int64) * stride_kh + offs_d[None, :])
    k = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :],
                mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot // bs, layer, 0/1, :, slot % bs] = key/value [T, Hkv, D]; negative slots skipped.

    Inputs are validated by shadowprefill.ops (slots in range and unique, inner dims contiguous).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_p, head_dim_p = launch.next_power_of_2(num_kv_heads), launch.next_power_of_2(head_dim)
    write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, layer * kv_cache.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=heads_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=kv_cache.shape[4], num_warps=4 if heads_p * head_dim_p <= 2048 else 8)
