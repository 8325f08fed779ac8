"""write_kv and pack/unpack Triton kernels: exact copies, the fp8 path bit for bit against torch's
float32 -> float8_e4m3fn cast, and the integer fp8 conversion the interpreter uses (triton_kernels/fp8.py)
on every code. On CPU under the interpreter, on CUDA when present.
"""
import pytest
import torch

import reference
from shadowprefill import triton_kernels as tk
from triton_batch import DEVICE, HAS_CUDA

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # plain copies are exact in the interpreter too


def random_pool(shape, dtype):
    return torch.randn(shape, dtype=torch.float32).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_write_kv_odd_heads_and_head_dim(dtype):
    pool = random_pool((20, 3, 2, 3, 16, 80), dtype)  # 3 kv heads, head_dim 80: both padded in the tile
    key, value = random_pool((30, 3, 80), dtype), random_pool((30, 3, 80), dtype)
    slots = torch.randperm(20 * 16)[:30]
    slots[::7] = -1
    expected = reference.write_kv(pool.cpu(), key.cpu(), value.cpu(), 1, slots)
    tk.write_kv(key, value, pool, 1, slots.to(DEVICE))
    assert torch.equal(pool.cpu(), expected)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("layers", [(0, 3), (1, 3), (2, 3)])
def test_pack_unpack_exact(dtype, layers):
    pool = random_pool((16, 3, 2, 3, 16, 96), dtype)  # 6 units per layer, 4 per program: a partial program
    ids = torch.tensor([5, 3, 15, 0, 9], device=DEVICE)
    buf, scales = tk.pack_blocks(pool, ids, *layers, None)
    assert buf.dtype == dtype and buf.is_contiguous() and scales.numel() == 0
    assert torch.equal(buf.cpu(), reference.pack(pool.cpu(), ids.cpu(), layers))
    target = random_pool(pool.shape, dtype)
    untouched = target.clone()
    tk.unpack_blocks(buf, scales, target, ids.to(torch.int32), *layers)
    assert torch.equal(target[ids, layers[0]:layers[1]], pool[ids, layers[0]:layers[1]])
    others = torch.ones(16, dtype=torch.bool)
    others[ids.cpu()] = False
    assert torch.equal(target[others.to(DEVICE)], untouched[others.to(DEVICE)])


def torch_fp8(pages, scales):
    """torch's own quantisation of pages [n, L, 2, H, bs, D] with scales [n, L, 2, H] (float32 math)."""
    q = pages.float() / scales.float()[..., None, None]
    return q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (16, 80), (128, 128)])  # 128x128: 2 chunks
def test_pack_fp8_matches_torch_bit_for_bit(dtype, block_size, head_dim):
    pool = random_pool((6, 2, 2, 2, block_size, head_dim), dtype) * 3
    pool[2, 0, 1, 0] = 0.0                                  # an all-zero unit: scale 1, payload 0
    pool[4, 1, 0, 1, 5:] = float("nan")                     # a NaN tail: left out of the amax
    ids = torch.tensor([4, 2, 0], device=DEVICE)
    buf, scales = tk.pack_blocks(pool, ids, 0, 2, "fp8")
    assert buf.dtype == torch.float8_e4m3fn and scales.shape == (3, 2, 2, 2)
    pages = reference.pack(pool.cpu(), ids.cpu())
    torch.testing.assert_close(scales.cpu().double(), reference.fp8_scales(pages), rtol=1e-7, atol=0)
    expected = torch_fp8(pages, scales.cpu())
    assert torch.equal(buf.cpu().view(torch.uint8), expected.view(torch.uint8))
    target = torch.full_like(pool, float("nan"))
    tk.unpack_blocks(buf, scales, target, ids, 0, 2)
    back = target[ids].cpu()
    finite = torch.isfinite(pages)
    bound = reference.fp8_error_bound(pages, reference.fp8_scales(pages), dtype)
    assert bool(((back.double() - pages.double()).abs() <= bound)[finite].all())
    assert torch.equal(back.isnan(), pages.isnan())


def test_fp8_encode_every_code_ties_and_subnormals():
    """Scale 1 (each unit holds 448): the payload is torch's cast of the value itself, for every e4m3
    value, every midpoint between neighbours (ties to even), values a hair off each midpoint, and zeros."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([-0.0, 2**-12])])
    values = torch.cat([values, -values])
    unit = 16 * 64
    units = -(-values.numel() // (unit - 1))
    body = torch.zeros((units + units % 2) * (unit - 1))  # K and V units of whole pages
    body[:values.numel()] = values
    flat = torch.cat([torch.full((body.numel() // (unit - 1), 1), 448.0), body.view(-1, unit - 1)], 1)
    pool = flat.reshape(-1, 1, 2, 1, 16, 64).to(DEVICE)  # each (page, K/V) unit starts with 448
    assert torch.equal(pool.cpu().reshape(-1, unit)[:, 1:].reshape(-1)[:values.numel()], values)
    ids = torch.arange(pool.shape[0], device=DEVICE)
    buf, scales = tk.pack_blocks(pool, ids, 0, 1, "fp8")
    assert bool((scales == 1.0).all())
    expected = pool.cpu().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(buf.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_fp8_decode_every_code():
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)  # 1024 = one 16 x 64 unit
    buf = codes.view(torch.float8_e4m3fn).view(1, 1, 1, 1, 16, 64).expand(1, 1, 2, 1, 16, 64).contiguous()
    scales = torch.ones(1, 1, 2, 1)
    target = torch.zeros(1, 1, 2, 1, 16, 64, device=DEVICE)
    tk.unpack_blocks(buf.to(DEVICE), scales.to(DEVICE), target, torch.tensor([0], device=DEVICE), 0, 1)
    expected = buf.float()
    got = target.cpu()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])


@pytest.mark.skipif(not HAS_CUDA, reason="on CPU both paths are the integer conversion; compares the GPU's "
                                         "hardware fp8 conversion with it")
def test_hardware_fp8_matches_integer_fp8_on_gpu():
    pool = random_pool((8, 2, 2, 4, 16, 128), torch.bfloat16) * 5
    ids = torch.arange(8, device=DEVICE)
    hw, hw_scales = tk.pack_blocks(pool, ids, 0, 2, "fp8")
    soft, soft_scales = tk.pack_blocks(pool, ids, 0, 2, "fp8", force_soft_fp8=True)
    assert torch.equal(hw_scales, soft_scales)
    assert torch.equal(hw.view(torch.uint8), soft.view(torch.uint8))
    a, b = torch.empty_like(pool), torch.empty_like(pool)
    tk.unpack_blocks(hw, hw_scales, a, ids, 0, 2)
    tk.unpack_blocks(hw, hw_scales, b, ids, 0, 2, force_soft_fp8=True)
    assert torch.equal(a, b)


def test_int64_offsets_write_and_pack():
    num_blocks = (1 << 20) + 8  # 2048-element pages: offsets beyond 2^31 elements
    try:
        pool = torch.empty((num_blocks, 1, 2, 1, 16, 64), dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as e:
        pytest.skip(f"cannot reserve a 4.3 GB pool on this machine: {e}")
    block = num_blocks - 3
    assert block * pool.stride(0) >= 2**31
    key, value = random_pool((16, 1, 64), torch.float16), random_pool((16, 1, 64), torch.float16)
    pool[block] = 0.0
    slots = torch.arange(16, dtype=torch.int64) + block * 16
    tk.write_kv(key, value, pool, 0, slots.to(DEVICE))
    assert torch.equal(pool[block, 0, 0, 0], key[:, 0]) and torch.equal(pool[block, 0, 1, 0], value[:, 0])
    ids = torch.tensor([block], device=DEVICE)
    buf, _ = tk.pack_blocks(pool, ids, 0, 1)
    assert torch.equal(buf[0], pool[block])
    pool[block + 1] = 1.0
    tk.unpack_blocks(buf, _, pool, torch.tensor([block + 1], device=DEVICE), 0, 1)
    assert torch.equal(pool[block + 1], pool[block])
