"""Independent float64 references for the op tests.

Written apart from shadowprefill/ops on purpose: they read the cache one token at a time through the block
table (no page gathers, no reshapes of the page layout), and loop where the ops vectorise.
"""
import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


def gather_tokens(kv_cache, layer, kind, table_row, positions):
    """K (kind 0) or V (kind 1) of the given positions of one sequence, float64 [n, Hkv, D]."""
    block_size = kv_cache.shape[4]
    rows = [kv_cache[int(table_row[p // block_size]), layer, kind, :, p % block_size, :] for p in positions]
    return torch.stack(rows).double()


def attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None, softcap=None):
    """Causal attention of every query token, float64 [T, Hq, D], computed one query at a time."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    num_q_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    kv_head_of = [h * num_kv_heads // num_q_heads for h in range(num_q_heads)]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    table = block_table.cpu()
    cache = kv_cache.cpu()
    for s, seq_len in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        all_keys = gather_tokens(cache, layer, 0, table[s], range(seq_len))    # [seq_len, Hkv, D]
        all_values = gather_tokens(cache, layer, 1, table[s], range(seq_len))
        for i in range(q_len):
            pos = seq_len - q_len + i
            visible = [j for j in range(pos + 1) if sliding_window is None or j > pos - sliding_window]
            keys = all_keys[visible][:, kv_head_of]                               # [n, Hq, D]
            values = all_values[visible][:, kv_head_of]
            logits = torch.einsum("nhd,hd->hn", keys, q[cu[s] + i].cpu().double()) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            weights = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
            out[cu[s] + i] = torch.einsum("hn,nhd->hd", weights / weights.sum(dim=1, keepdim=True), values)
    return out


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
