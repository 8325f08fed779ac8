"""Plain-torch references of every op: the ops' CPU path, and what tests, the self-check and the device
check compare the kernels with (float64 there). Independent of the Triton kernels and the C++ copies.

    paged_attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, ...)
    paged_attention(q, kv_cache, layer, ...)         the same on the block-major cache (DESIGN.md §3)
    dense_attention(q, keys, values, scale, ...)     causal attention of the last queries over dense K/V
    write_kv_cache(...), write_kv(...)               scatter to slots (in place)
    pack_blocks(...), unpack_blocks(...)             gather / scatter pages, fp8 e4m3 with per-tile scales
    quantize_fp8(pages), dequantize_fp8(...)

Attention semantics (DESIGN.md §4): token i of sequence s sits at position seq_lens[s] - q_len[s] + i and
sees the keys j <= its position (and j > position - W with a sliding window W); logits are scale * q.k,
then softcap * tanh(logits / softcap) with a softcap. Only positions < seq_len are gathered, so a NaN in
the unwritten tail of the last page never enters. `dtype` is the accumulation and result dtype: float32
for the ops' CPU path, float64 for checking the kernels.
"""
from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
_MAX_LOGITS = 1 << 24  # elements of one logits block: bounds the memory of long prefills


def _off(value) -> float:
    return 0 if value is None else value


def _attend(q, k, v, first_query_pos: int, first_key_pos: int, scale: float, window, softcap, dtype):
    """Attention of q [n_q, Hq, D] at positions first_query_pos.. over k, v [n_k, Hkv, D] at positions
    first_key_pos..: causal (and windowed), GQA by head groups; returns [n_q, Hq, D] in `dtype`."""
    n_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    k = k.to(dtype).permute(1, 0, 2)                                        # [Hkv, n_k, D]
    v = v.to(dtype).permute(1, 0, 2)
    key_pos = torch.arange(first_key_pos, first_key_pos + k.shape[1], device=q.device)
    out = torch.empty((n_q, num_q_heads, head_dim), dtype=dtype, device=q.device)
    rows = max(1, _MAX_LOGITS // max(1, num_q_heads * k.shape[1]))
    for i0 in range(0, n_q, rows):  # a block of queries at a time
        i1 = min(n_q, i0 + rows)
        qs = q[i0:i1].to(dtype).reshape(i1 - i0, num_kv_heads, group, head_dim)
        qs = qs.permute(1, 2, 0, 3).reshape(num_kv_heads, group * (i1 - i0), head_dim)
        logits = torch.bmm(qs, k.transpose(1, 2)).mul_(scale)                # [Hkv, g * rows, n_k]
        if softcap:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        query_pos = torch.arange(first_query_pos + i0, first_query_pos + i1, device=q.device)[:, None]
        hidden = key_pos[None, :] > query_pos                                 # causal
        if window:
            hidden |= key_pos[None, :] <= query_pos - window
        logits = logits.view(num_kv_heads, group, i1 - i0, -1).masked_fill_(hidden, float("-inf"))
        probs = logits.softmax(dim=-1).view(num_kv_heads, group * (i1 - i0), -1)
        o = torch.bmm(probs, v).view(num_kv_heads, group, i1 - i0, head_dim)
        out[i0:i1] = o.permute(2, 0, 1, 3).reshape(i1 - i0, num_q_heads, head_dim)
    return out


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Causal attention of q [n_q, Hq, D] over keys / values [n_k, Hkv, D] of positions 0..n_k-1, the
    queries being the last n_q positions."""
    return _attend(q, keys, values, keys.shape[0] - q.shape[0], 0, scale, _off(sliding_window), _off(softcap),
                   dtype)


def paged_attention_kv(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                       out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Attention of q [T, Hq, D] over key_cache / value_cache [num_blocks, block_size, Hkv, D] (any
    strides); written into `out` (cast to its dtype) when given, else returned in `dtype`. Rows of
    sequences without new tokens do not exist (T counts new tokens only)."""
    window, cap = _off(sliding_window), _off(softcap)
    block_size = key_cache.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, q_len = cu[s], cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        first_query = seq_len - q_len
        lo = max(0, first_query - window + 1) if window else 0            # first key any query sees
        b0, b1 = lo // block_size, -(-seq_len // block_size)
        pages = block_table[s, b0:b1].long().to(key_cache.device)
        skip, count = lo - b0 * block_size, seq_len - lo
        k = key_cache[pages].reshape(-1, *key_cache.shape[2:])[skip:skip + count]   # [count, Hkv, D]
        v = value_cache[pages].reshape(-1, *value_cache.shape[2:])[skip:skip + count]
        out[start:start + q_len] = _attend(q[start:start + q_len], k, v, first_query, lo, scale, window, cap,
                                           dtype).to(out.dtype)
    return out


def layer_views(kv_cache: torch.Tensor, layer: int):
    """key / value views [num_blocks, block_size, Hkv, D] of layer `layer` of a block-major cache."""
    return kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2)


def paged_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None,
                    softcap=None, out=None, dtype=torch.float64):
    """paged_attention_kv over layer `layer` of the block-major kv_cache [num_blocks, L, 2, Hkv, bs, D]."""
    return paged_attention_kv(q, *layer_views(kv_cache, layer), block_table, cu_seqlens_q, seq_lens, scale,
                              sliding_window, softcap, out, dtype)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key_cache / value_cache[slot // block_size, slot % block_size] = key / value (in place); negative
    slots skipped."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(key_cache.device)
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep.to(key.device)]       # [n, Hkv, D] into (block, offset, :, :)
    value_cache[blocks, offsets] = value[keep.to(value.device)]


def write_kv(key, value, kv_cache, layer, slot_mapping) -> None:
    """write_kv_cache into layer `layer` of the block-major kv_cache."""
    write_kv_cache(key, value, *layer_views(kv_cache, layer), slot_mapping)


def quantize_fp8(pages: torch.Tensor):
    """pages [..., block_size, D] -> (e4m3 payload, float32 scales [...]): one scale per (…) tile,
    amax / 448 over the tile's finite values (1 for an all-zero tile), payload = x / scale clamped."""
    x = pages.to(torch.float32, copy=True)  # divided in place below: never the caller's tensor
    amax = x.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=(-2, -1))  # finite values only
    # tensor / tensor: an exact division on every device (CUDA's tensor / python-float multiplies by the
    # reciprocal, one ulp off for about half of all scales)
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), 1.0)
    payload = x.div_(scales[..., None, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return payload, scales


def dequantize_fp8(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (payload.float() * scales[..., None, None]).to(dtype)


def pack_blocks(kv_cache, block_ids, layers=None, quant=None):
    """(buf [n, L', 2, Hkv, bs, D], scales or None): pages block_ids, layers [start, stop)."""
    start, stop = layers if layers is not None else (0, kv_cache.shape[1])
    pages = kv_cache[block_ids.long().to(kv_cache.device), start:stop]
    if quant == "fp8":
        return quantize_fp8(pages)
    return pages.contiguous(), None


def unpack_blocks(buf, scales, kv_cache, block_ids, layers=None) -> None:
    """Scatter buf (from pack_blocks) back into pages block_ids (in place), dequantising fp8."""
    start, stop = layers if layers is not None else (0, kv_cache.shape[1])
    pages = dequantize_fp8(buf, scales, kv_cache.dtype) if buf.dtype == FP8 else buf
    kv_cache[block_ids.long().to(kv_cache.device), start:stop] = pages
