"""shadowprefill.ops.reference, the one attention reference, against torch's own attention.

Everything else (the ops' CPU path, the kernel tests, the self-check, the device check) trusts this module,
so here it is checked against an independent computation, tests/reference.py's oracle:
torch.nn.functional.scaled_dot_product_attention in float64 on K/V gathered position by position through the
block table (GQA by repeating heads, the causal and window masks as explicit boolean masks), and, for the
softcap, the formula written out. The op tests compare both backends with the same oracle.
"""
import math

import pytest
import torch

import reference as oracle  # tests/reference.py: torch SDPA in float64, written apart from the ops
from shadowprefill.ops import reference
from shadowprefill.ops.testing import nan_pool, random_batch


def torch_attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, window=None, softcap=None):
    return oracle.attention(q, kv_cache, layer, block_table, cu_seqlens_q, seq_lens, scale, window, softcap)


@pytest.mark.parametrize("window, softcap", [(None, None), (9, None), (None, 2.5), (20, 5.0), (1, None)])
@pytest.mark.parametrize("gqa", [1, 4])
def test_paged_reference_matches_torch_attention(window, softcap, gqa):
    pool = nan_pool(64, 2, 2, 16, 64, torch.float32)
    batch = random_batch([(36, 1), (15, 1), (21, 7), (0, 19), (40, 0), (47, 33)], pool, layer=1,
                         num_q_heads=2 * gqa)
    expected = torch_attention(**batch, window=window, softcap=softcap)
    for dtype in (torch.float64, torch.float32):
        got = reference.paged_attention(**batch, sliding_window=window, softcap=softcap, dtype=dtype)
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                                   atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_out_argument_is_written_in_its_dtype():
    pool = nan_pool(32, 1, 2, 16, 64, torch.float16)
    batch = random_batch([(20, 3), (5, 9)], pool, layer=0, num_q_heads=2)
    out = torch.full_like(batch["q"], float("nan"))
    result = reference.paged_attention(**batch, out=out, dtype=torch.float32)
    assert result is out and out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), torch_attention(**batch), rtol=2e-3, atol=2e-3)


def test_dense_reference_is_the_paged_one_on_one_page_table():
    """dense_attention over K/V [n, Hkv, D] equals the paged reference over pages holding the same K/V."""
    n_k, n_q, heads, kv_heads, dim = 37, 5, 4, 2, 32
    keys, values, q = torch.randn(n_k, kv_heads, dim), torch.randn(n_k, kv_heads, dim), torch.randn(n_q, heads, dim)
    pages = -(-n_k // 16)
    kv = torch.full((pages, 16, kv_heads, dim), float("nan"))
    key_cache, value_cache = kv.clone(), kv.clone()
    key_cache.view(-1, kv_heads, dim)[:n_k] = keys
    value_cache.view(-1, kv_heads, dim)[:n_k] = values
    args = (torch.arange(pages, dtype=torch.int32)[None], torch.tensor([0, n_q], dtype=torch.int32),
            torch.tensor([n_k], dtype=torch.int32), 1 / math.sqrt(dim))
    paged = reference.paged_attention_kv(q, key_cache, value_cache, *args, sliding_window=7)
    dense = reference.dense_attention(q, keys, values, 1 / math.sqrt(dim), sliding_window=7)
    torch.testing.assert_close(dense, paged, rtol=1e-12, atol=1e-12)  # paged sums only the window's keys


def test_long_prefill_is_computed_in_blocks_of_queries():
    """More logits than one block holds (the reference bounds memory by query blocks): same result."""
    pool = nan_pool(40, 1, 1, 16, 32, torch.float32)
    batch = random_batch([(100, 200)], pool, layer=0, num_q_heads=8)
    limit = reference._MAX_LOGITS
    try:
        reference._MAX_LOGITS = 8 * 300 * 7  # 7 queries per block
        blocked = reference.paged_attention(**batch)
    finally:
        reference._MAX_LOGITS = limit
    torch.testing.assert_close(blocked, reference.paged_attention(**batch), rtol=1e-12, atol=1e-12)


def test_fp8_reference_round_trip_and_scales():
    pages = torch.randn(3, 2, 2, 2, 16, 64) * 5
    pages[0, 0, 0, 0] = 0.0
    pages[1, 1, 1, 1, 3:] = float("nan")
    before = pages.clone()
    payload, scales = reference.quantize_fp8(pages)
    assert torch.equal(pages.nan_to_num(), before.nan_to_num())  # the input is left alone
    assert payload.dtype == torch.float8_e4m3fn and scales[0, 0, 0, 0] == 1.0
    finite = pages.nan_to_num(0.0).abs().amax(dim=(-2, -1))
    torch.testing.assert_close(scales, torch.where(finite > 0, finite / 448.0, torch.ones_like(finite)))
    back = reference.dequantize_fp8(payload, scales, torch.float32)
    ok = torch.isfinite(pages)
    assert bool(((back - pages).abs()[ok] <= pages.abs()[ok] * 2 ** -4 + 1e-6 * 5).all())
