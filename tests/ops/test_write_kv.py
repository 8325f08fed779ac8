"""write_kv vs a per-token reference: written slots bit-exact, every other element untouched."""
import itertools

import pytest
import torch

import reference
from shadowprefill.ops import write_kv

from shadowprefill.ops.testing import nan_pool
from .matrix import TRITON_DTYPES, backend_cases

FULL = list(itertools.product((torch.float32, torch.float16, torch.bfloat16), (1, 4), (64, 128), (16, 32)))
# (dtype, num_kv_heads, head_dim, block_size), pairwise
PAIRWISE = [(torch.float32, 1, 64, 16), (torch.float16, 1, 128, 32), (torch.float16, 4, 64, 16),
            (torch.float32, 4, 128, 32)]
PAIRWISE += [(torch.bfloat16, 4, 64, 32)] if torch.bfloat16 in TRITON_DTYPES else []


def bits(x):
    """Bit patterns, so NaN == NaN and -0 != +0 in comparisons."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def random_slots(num_blocks, block_size, count, num_skipped):
    """Distinct slots in random order (including the very last slot), with `num_skipped` -1 entries."""
    last = num_blocks * block_size - 1
    slots = torch.randperm(last)[:count]  # distinct, all < last
    slots[torch.randperm(count)[:num_skipped]] = -1
    slots[(slots >= 0).nonzero()[0]] = last
    return slots.to(torch.int64)


def check_write(pool, num_tokens, layer, num_skipped):
    device = pool.device
    num_blocks, _, _, heads, block_size, head_dim = pool.shape
    key = torch.randn(num_tokens, heads, head_dim).to(pool.dtype).to(device)
    value = torch.randn(num_tokens, heads, head_dim).to(pool.dtype).to(device)
    slots = random_slots(num_blocks, block_size, num_tokens, num_skipped).to(device)
    expected = reference.write_kv(pool.cpu(), key.cpu(), value.cpu(), layer, slots.cpu())
    write_kv(key, value, pool, layer, slots)
    assert torch.equal(bits(pool.cpu()), bits(expected))


@pytest.mark.parametrize("backend, case", backend_cases(FULL, PAIRWISE), indirect=["backend"])
def test_write_kv(backend, device, case):
    dtype, heads, head_dim, block_size = case
    pool = nan_pool(16, 3, heads, block_size, head_dim, dtype, device)
    check_write(pool, num_tokens=40, layer=2, num_skipped=5)


def test_write_kv_large_pool(backend, device):
    pool = nan_pool(32768, 1, 1, 16, 16, torch.float16, device)  # 32 MiB
    check_write(pool, num_tokens=64, layer=0, num_skipped=3)


def test_write_kv_repeated_calls_fill_pages(backend, device):
    """Token-by-token decode writes land next to a prefill's, in the same page."""
    pool = nan_pool(8, 2, 2, 16, 64, torch.float32, device)
    key, value = torch.randn(20, 2, 64, device=device), torch.randn(20, 2, 64, device=device)
    slots = torch.tensor([5 * 16 + i for i in range(16)] + [2 * 16 + i for i in range(4)], device=device)
    write_kv(key[:17], value[:17], pool, 1, slots[:17])
    for t in range(17, 20):
        write_kv(key[t:t + 1], value[t:t + 1], pool, 1, slots[t:t + 1])
    torch.testing.assert_close(pool[5, 1, 0].transpose(0, 1), key[:16], rtol=0, atol=0)
    torch.testing.assert_close(pool[2, 1, 1, :, :4].transpose(0, 1), value[16:], rtol=0, atol=0)
    assert bool(pool[2, 1, :, :, 4:].isnan().all()) and bool(pool[:, 0].isnan().all())


def test_write_kv_empty_and_all_skipped(backend, device):
    pool = nan_pool(4, 1, 1, 16, 64, torch.float16, device)
    empty = torch.empty(0, 1, 64, dtype=torch.float16, device=device)
    write_kv(empty, empty, pool, 0, torch.empty(0, dtype=torch.int64, device=device))
    key = torch.randn(3, 1, 64, device=device).half()
    write_kv(key, key, pool, 0, torch.full((3,), -1, dtype=torch.int64, device=device))
    assert bool(pool.isnan().all())
