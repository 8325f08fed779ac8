"""paged_attention vs the float64 token-by-token reference, on both backends (see tests/conftest.py)."""
import itertools

import pytest
import torch

import reference
from shadowprefill.ops import paged_attention

from shadowprefill.ops.testing import nan_pool, random_batch
from .matrix import TRITON_DTYPES, backend_cases

# decodes (one on a full 16-token block, one on a full 32-token block), a prefill chunk on cached
# context, a fresh prefill
MIXED = [(36, 1), (15, 1), (31, 1), (21, 7), (0, 19)]
NUM_KV_HEADS = 2

FULL = list(itertools.product((torch.float32, torch.float16, torch.bfloat16), (1, 2, 4, 8), (64, 128), (16, 32)))
# (dtype, gqa, head_dim, block_size): every pair of values of any two of them appears at least once
PAIRWISE = [(torch.float32, 1, 64, 16), (torch.float16, 1, 128, 32), (torch.float16, 2, 64, 32),
            (torch.float32, 2, 128, 16), (torch.float16, 4, 64, 16), (torch.float32, 4, 128, 32),
            (torch.float32, 8, 64, 32), (torch.float16, 8, 128, 16)]
PAIRWISE += [(torch.bfloat16, 2, 128, 16)] if torch.bfloat16 in TRITON_DTYPES else []


def run_and_check(batch, dtype, **kwargs):
    args = batch
    out = torch.full_like(args["q"], float("nan"))
    result = paged_attention(**args, out=out, **kwargs)
    assert result is out
    ref = reference.attention(**args, **kwargs)
    reference.assert_close_to_reference(out, ref, dtype)
    return out


@pytest.mark.parametrize("backend, case", backend_cases(FULL, PAIRWISE), indirect=["backend"])
def test_mixed_batch(backend, device, case):
    dtype, gqa, head_dim, block_size = case
    pool = nan_pool(64, 2, NUM_KV_HEADS, block_size, head_dim, dtype, device)
    batch = random_batch(MIXED, pool, layer=1, num_q_heads=NUM_KV_HEADS * gqa)
    run_and_check(batch, dtype)


@pytest.fixture(scope="module")
def large_pool():
    """32,768 tiny pages (1 layer, 1 kv head, 16 x 64 fp16 = 128 MiB): ids far from 0 in the table."""
    return nan_pool(32768, 1, 1, 16, 64, torch.float16, "cuda" if torch.cuda.is_available() else "cpu")


def test_large_pool_random_table(backend, device, large_pool):
    pool = large_pool.to(device)  # no copy when the devices match
    batch = random_batch([(100, 1), (47, 9), (0, 30), (250, 1)], pool, layer=0, num_q_heads=2)
    assert int(batch["block_table"].max()) == pool.shape[0] - 1
    run_and_check(batch, torch.float16)


@pytest.mark.parametrize("window, softcap", [(8, None), (None, 1.5), (20, 2.0), (1, None)])
def test_sliding_window_softcap(backend, device, window, softcap):
    dtype = torch.float32
    pool = nan_pool(64, 1, 2, 16, 64, dtype, device)
    batch = random_batch([(40, 7), (60, 1), (0, 25), (3, 1)], pool, layer=0, num_q_heads=4)
    run_and_check(batch, dtype, sliding_window=window, softcap=softcap)


def test_window_leaves_pages_before_it_unread(backend, device):
    """Pages wholly before the window are never read: their table entries may point anywhere in range."""
    dtype = torch.float16
    pool = nan_pool(64, 1, 2, 16, 64, dtype, device)
    batch = random_batch([(70, 2)], pool, layer=0, num_q_heads=2)
    # positions 70, 71 with window 16 see 55..71: blocks 3, 4 only; blocks 0-2 now point at the NaN page
    batch["block_table"][0, :3] = batch.nan_page
    run_and_check(batch, dtype, sliding_window=16)


def test_block_table_padding_is_ignored():
    """Entries past each sequence's last page (and pages a window skips) are never looked at: -1 is fine
    there. Reference backend only: a kernel that wrongly dereferenced -1 would crash the interpreter."""
    pool = nan_pool(64, 1, 2, 16, 64, torch.float32)
    batch = random_batch([(30, 1), (70, 2), (3, 4)], pool, layer=0, num_q_heads=2, pad_id=-1)
    batch["block_table"][1, :3] = -1
    run_and_check(batch, torch.float32, sliding_window=16)


def test_edge_cases(backend, device):
    dtype = torch.float32
    pool = nan_pool(32, 1, 2, 16, 64, dtype, device)
    # a sequence with no new tokens between others, a one-token sequence, a decode at a block boundary
    batch = random_batch([(20, 3), (40, 0), (0, 1), (16, 1)], pool, layer=0, num_q_heads=4)
    run_and_check(batch, dtype)
    # an empty batch
    empty = random_batch([], pool, layer=0, num_q_heads=4)
    assert paged_attention(**empty).shape == (0, 4, 64)


def test_out_is_allocated_when_none(backend, device):
    pool = nan_pool(32, 1, 1, 16, 64, torch.float16, device)
    batch = random_batch([(5, 3)], pool, layer=0, num_q_heads=1)
    out = paged_attention(**batch)
    assert out.shape == batch["q"].shape and out.dtype == torch.float16
    reference.assert_close_to_reference(out, reference.attention(**batch), torch.float16)
