"""Oracles for the op and kernel tests, written apart from the ops (no shared code): attention by torch's
scaled_dot_product_attention in float64 on K/V gathered through the block table (the check of both the
kernels and shadowprefill.ops.reference, the ops' CPU path), explicit loops for the copy ops, plus the
assertion helpers.
"""
import torch

from shadowprefill.ops.reference import FP8_MAX


def attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None,
                 softcap=None):
    """float64 [T, Hq, D] of every query token, on the CPU, over K/V views [num_blocks, block_size, Hkv, D]
    of any layout, computed apart from shadowprefill.ops.reference: per sequence, the visible keys are
    gathered position by position through the block table, and torch's scaled_dot_product_attention runs
    in float64 with the causal (and window) mask as an explicit boolean mask (GQA by repeating heads); the
    softcap formula is written out. 0 / None mean no window / no softcap."""
    q, block_table = q.cpu(), block_table.cpu()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    group = q.shape[1] // key_cache.shape[2]
    block_size = key_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        first = max(0, seq_len - q_len - sliding_window + 1) if sliding_window else 0  # pages before: unread
        pos = torch.arange(first, seq_len)
        blocks = block_table[s, pos // block_size].long().to(key_cache.device)
        slots = (pos % block_size).to(key_cache.device)
        k = key_cache[blocks, slots].cpu().double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        v = value_cache[blocks, slots].cpu().double().repeat_interleave(group, 1).transpose(0, 1)
        qs = q[cu[s]:cu[s + 1]].double().transpose(0, 1)                                        # [Hq, q_len, D]
        qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = pos[None, :] <= qpos
        if sliding_window:
            visible &= pos[None, :] > qpos - sliding_window
        if softcap:
            logits = softcap * torch.tanh(scale * (qs @ k.transpose(1, 2)) / softcap)
            o = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale)
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out


def attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None, softcap=None):
    """attention_kv over layer `layer` of a block-major cache [num_blocks, L, 2, Hkv, block_size, D]."""
    return attention_kv(q, kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2),
                        block_table, cu_seqlens_q, seq_lens, scale, sliding_window, softcap)


def write_kv(kv_cache, key, value, layer, slot_mapping):
    """A copy of kv_cache with each token's key/value written into its slot (negative slots skipped)."""
    result = kv_cache.clone()
    block_size = kv_cache.shape[4]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            result[slot // block_size, layer, 0, :, slot % block_size, :] = key[t]
            result[slot // block_size, layer, 1, :, slot % block_size, :] = value[t]
    return result


def pack(kv_cache, block_ids, layers=None):
    """Pages block_ids (layer range `layers`) stacked into one tensor, by explicit per-page copies."""
    start, stop = layers if layers is not None else (0, kv_cache.shape[1])
    return torch.stack([kv_cache[int(b), start:stop].clone() for b in block_ids.tolist()])


def fp8_scales(pages):
    """float64 scale amax / 448 per (page, layer, K/V, head) over the finite values; 1 where amax is 0."""
    n, layers, two, heads = pages.shape[:4]
    scales = torch.empty(n, layers, two, heads, dtype=torch.float64)
    for idx in range(n * layers * two * heads):
        i, rest = divmod(idx, layers * two * heads)
        l, rest = divmod(rest, two * heads)
        k, h = divmod(rest, heads)
        tile = pages[i, l, k, h].double()
        finite = tile[torch.isfinite(tile)]
        amax = float(finite.abs().max()) if finite.numel() else 0.0
        scales[i, l, k, h] = amax / FP8_MAX if amax > 0 else 1.0
    return scales


def fp8_error_bound(x, scales, dtype):
    """Largest |x - dequant(quant(x))| allowed per element: e4m3 keeps 3 mantissa bits (relative half-ulp
    2^-4 for normals, absolute 2^-10 * scale in the subnormal range), plus rounding to the cache dtype."""
    scale = scales.double()[..., None, None]
    x = x.double().abs()
    return x * 2.0 ** -4 + scale * 2.0 ** -10 + (x * 2.0 ** -4 + x) * torch.finfo(dtype).eps + 1e-30


def relative_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def assert_close_to_reference(out, ref, dtype):
    """fp32 ~1e-4 abs/rel, fp16 ~2e-3, bf16 ~2e-2 relative norm; and every element written (finite)."""
    assert bool(torch.isfinite(out).all()), "output has NaN/inf: not fully written or NaN leaked"
    out = out.cpu().double()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    elif dtype == torch.float16:
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    else:
        err = relative_error(out, ref)
        assert err < 2e-2, f"bf16 relative error {err:.3g} >= 2e-2"
