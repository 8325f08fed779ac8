"""write_kv_cache: scatter the new tokens' K and V into their slots of a paged cache of any layout.

key_cache / value_cache are [num_blocks, block_size, Hkv, D] views with any strides but a contiguous last
dimension (DESIGN.md §4). slot = block_id * block_size + offset (int64); a negative slot is skipped. One
program per token writes all KV heads of that token: key_cache[block, offset, h, :] = key[t, h, :].
"""
import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
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
    head = offs_h[:, None].to(tl.int64)
    k = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_kt + head * stride_kh + offs_d[None, :], k,
             mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :],
                mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vt + head * stride_vh + offs_d[None, :], v,
             mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key_cache / value_cache[slot // bs, slot % bs] = key / value [T, Hkv, D]; negative slots skipped.

    Inputs are validated by shadowprefill.ops (slots in range and unique, last dims contiguous).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_p, head_dim_p = launch.next_power_of_2(num_kv_heads), launch.next_power_of_2(head_dim)
    write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=heads_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=key_cache.shape[1], num_warps=4 if heads_p * head_dim_p <= 2048 else 8)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """write_kv_cache into layer `layer` of the block-major kv_cache [num_blocks, L, 2, Hkv, bs, D]."""
    write_kv_cache(key, value, kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2),
                   slot_mapping)
