"""References for the op tests: the attention reference is shadowprefill.ops.reference (one reference
for the ops' CPU path, the tests, the self-check and the device check; tests/ops/test_reference.py checks
it against torch's own attention). Here: float64 block-major adapters, and test-only oracles for the copy
ops written apart from the ops (explicit loops, no shared code), plus the assertion helpers.
"""
import torch

from shadowprefill.ops import reference as ops_reference
from shadowprefill.ops.reference import FP8_MAX


def attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None, softcap=None):
    """float64 [T, Hq, D] of every query token, on the CPU."""
    return ops_reference.paged_attention(q.cpu(), kv_cache.cpu(), layer, block_table.cpu(), cu_seqlens_q.cpu(),
                                         seq_lens.cpu(), scale, sliding_window, softcap, dtype=torch.float64)


def attention_kv(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None,
                 softcap=None):
    """float64 [T, Hq, D] over K/V views of any layout, on the CPU."""
    return ops_reference.paged_attention_kv(q.cpu(), key_cache.cpu(), value_cache.cpu(), block_table.cpu(),
                                            cu_seqlens_q.cpu(), seq_lens.cpu(), scale, sliding_window, softcap,
                                            dtype=torch.float64)


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
