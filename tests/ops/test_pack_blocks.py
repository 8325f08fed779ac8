"""pack_blocks / unpack_blocks: bit-exact without quantisation, within e4m3 error with fp8."""
import itertools

import pytest
import torch

import reference
from shadowprefill.ops import pack_blocks, unpack_blocks

from shadowprefill.ops.testing import NAN
from .matrix import TRITON_DTYPES, backend_cases

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYERS = (None, (1, 3), (0, 1), (3, 4))


def bits(x):
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def random_pool(num_blocks, dtype, device, num_layers=4, heads=2, block_size=16, head_dim=64):
    # magnitudes spread over several decades per tile, so fp8 rounding is exercised across the range
    x = torch.randn(num_blocks, num_layers, 2, heads, block_size, head_dim)
    x = x * torch.exp(2 * torch.randn(num_blocks, num_layers, 2, heads, 1, 1))
    return x.to(dtype).to(device)


def page_ids(num_blocks, count):
    """A run of consecutive ids (merge path), then random ones, including the last page."""
    rest = torch.randperm(num_blocks - 8)[: count - 5] + 4
    return torch.cat([torch.tensor([0, 1, 2, 3]), torch.tensor([num_blocks - 1]), rest])


@pytest.mark.parametrize("backend, case", backend_cases(list(itertools.product(DTYPES, LAYERS)),
                                                        list(itertools.product(TRITON_DTYPES, LAYERS[:2]))),
                         indirect=["backend"])
def test_pack_unpack_bit_exact(backend, device, case):
    dtype, layers = case
    pool = random_pool(48, dtype, device)
    ids = page_ids(48, 12)
    buf, scales = pack_blocks(pool, ids, layers=layers)
    assert scales is None and buf.dtype == dtype and buf.is_contiguous()
    assert torch.equal(bits(buf.cpu()), bits(reference.pack(pool.cpu(), ids, layers)))
    # scatter into other pages of a NaN cache: exactly those pages and layers change
    dst = torch.full_like(pool, NAN)
    dst_ids = torch.randperm(48)[:12].to(torch.int32)
    expected = dst.cpu().clone()
    start, stop = layers or (0, 4)
    for i, d in enumerate(dst_ids.tolist()):
        expected[d, start:stop] = buf[i].cpu()
    unpack_blocks(buf, None, dst, dst_ids, layers=layers)
    assert torch.equal(bits(dst.cpu()), bits(expected))


@pytest.mark.parametrize("backend, case", backend_cases(list(itertools.product(DTYPES, LAYERS[:2])),
                                                        list(itertools.product(TRITON_DTYPES, LAYERS[:2]))),
                         indirect=["backend"])
def test_fp8_round_trip(backend, device, case):
    dtype, layers = case
    pool = random_pool(40, dtype, device)
    ids = page_ids(40, 10)
    buf, scales = pack_blocks(pool, ids, layers=layers, quant="fp8")
    start, stop = layers or (0, 4)
    assert buf.dtype == FP8 and buf.shape == (10, stop - start, 2, 2, 16, 64)
    assert scales.dtype == torch.float32 and scales.shape == (10, stop - start, 2, 2)
    pages = reference.pack(pool.cpu(), ids, layers)
    expected_scales = reference.fp8_scales(pages)
    torch.testing.assert_close(scales.cpu().double(), expected_scales, rtol=1e-6, atol=0)
    dst = torch.full_like(pool, NAN)
    unpack_blocks(buf, scales, dst, ids, layers=layers)
    restored = dst.cpu()[ids, start:stop]
    error = (restored.double() - pages.double()).abs()
    assert bool((error <= reference.fp8_error_bound(pages, expected_scales, dtype)).all()), float(error.max())
    assert bool(torch.isnan(dst.cpu()[:, :start]).all()) and bool(torch.isnan(dst.cpu()[:, stop:]).all())


def test_fp8_nan_tail_and_zero_tile(backend, device):
    """A partial last block's NaN tail must not spoil the scale of its tile; an all-zero tile gets
    scale 1 (amax guard) and round-trips to zeros."""
    dtype = torch.float16
    pool = random_pool(8, dtype, device)
    pool[3, :, :, :, 5:] = NAN       # page 3 holds 5 tokens
    pool[6, 2, 1, 0] = 0.0           # one zero tile (layer 2, V, head 0)
    ids = torch.tensor([3, 6, 1])
    buf, scales = pack_blocks(pool, ids, quant="fp8")
    assert bool(torch.isfinite(scales).all())
    assert float(scales[1, 2, 1, 0]) == 1.0
    pages = reference.pack(pool.cpu(), ids)
    torch.testing.assert_close(scales.cpu().double(), reference.fp8_scales(pages), rtol=1e-6, atol=0)
    dst = torch.full_like(pool, NAN)
    unpack_blocks(buf, scales, dst, ids)
    written = dst.cpu()[3, :, :, :, :5].double()
    bound = reference.fp8_error_bound(pages[0, :, :, :, :5], scales[0].cpu(), dtype)
    assert bool(((written - pages[0, :, :, :, :5].double()).abs() <= bound).all())
    assert bool((dst[6, 2, 1, 0] == 0).all())


def test_pack_duplicates_and_empty(backend, device):
    pool = random_pool(8, torch.float32, device)
    ids = torch.tensor([5, 5, 2], dtype=torch.int32)
    buf, _ = pack_blocks(pool, ids)
    assert torch.equal(buf.cpu(), reference.pack(pool.cpu(), ids))
    for quant in (None, "fp8"):
        empty, scales = pack_blocks(pool, torch.empty(0, dtype=torch.int64), quant=quant)
        assert empty.shape == (0, 4, 2, 2, 16, 64)
        unpack_blocks(empty, scales, pool, torch.empty(0, dtype=torch.int64))


def test_large_pool_ids(backend, device):
    pool = torch.randn(32768, 1, 2, 1, 16, 16).half().to(device)  # 32 MiB
    ids = torch.tensor([32767, 0, 20000, 32766])
    buf, _ = pack_blocks(pool, ids)
    assert torch.equal(bits(buf.cpu()), bits(reference.pack(pool.cpu(), ids)))
    dst = torch.full_like(pool, NAN)
    unpack_blocks(buf, None, dst, ids.flip(0))
    assert torch.equal(bits(dst[32767].cpu()), bits(pool[32766].cpu()))
    assert torch.equal(bits(dst[32766].cpu()), bits(pool[32767].cpu()))
