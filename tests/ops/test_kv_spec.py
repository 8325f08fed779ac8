"""KVCacheSpec: validation, sizes, allocation (pinned too), and `check`."""
import pytest
import torch

from shadowprefill.kv import KVCacheSpec


def test_sizes_and_allocate():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert spec.page_shape == (32, 2, 8, 16, 128)
    assert spec.page_numel == 32 * 2 * 8 * 16 * 128
    assert spec.page_bytes == 2 * 1024 * 1024  # DESIGN.md §3: 2 MiB for a Llama-3-8B page of 16 tokens
    small = KVCacheSpec(2, 4, 64, 32, torch.float32)
    cache = small.allocate(7)
    assert cache.shape == (7, 2, 2, 4, 32, 64) and cache.dtype == torch.float32 and cache.is_contiguous()
    assert cache.stride(0) * cache.element_size() == small.page_bytes
    small.check(cache)
    assert KVCacheSpec.of(cache) == small
    assert small.allocate(0).shape == (0,) + small.page_shape


def test_spec_is_frozen_and_hashable():
    spec = KVCacheSpec(1, 1, 64, 16, torch.float16)
    with pytest.raises(AttributeError):
        spec.block_size = 32
    assert len({spec, KVCacheSpec(1, 1, 64, 16, torch.float16)}) == 1


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_kv_heads=-1), ValueError, "num_kv_heads"),
    (dict(head_dim=64.0), TypeError, "head_dim"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(dtype=torch.int8), TypeError, "dtype"),
    (dict(dtype="float16"), TypeError, "dtype"),
])
def test_invalid_spec(kwargs, error, name):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        KVCacheSpec(**args)


def test_allocate_arguments():
    spec = KVCacheSpec(1, 1, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="num_blocks"):
        spec.allocate(-1)
    with pytest.raises(TypeError, match="num_blocks"):
        spec.allocate(3.0)
    with pytest.raises(ValueError, match="pin_memory"):
        spec.allocate(3, device="meta", pin_memory=True)


def test_pinned_allocation_or_a_clear_error():
    spec = KVCacheSpec(1, 1, 64, 16, torch.float16)
    if torch.cuda.is_available():
        assert spec.allocate(4, pin_memory=True).is_pinned()
    else:  # no accelerator: pinning fails, and the error names the size asked for
        with pytest.raises(RuntimeError, match=f"{4 * spec.page_bytes} bytes .* pinned host memory"):
            spec.allocate(4, pin_memory=True)


@pytest.mark.parametrize("cache, error", [
    (torch.empty(4, 1, 2, 1, 16, 64, dtype=torch.float32), TypeError),
    (torch.empty(4, 2, 2, 1, 16, 64, dtype=torch.float16), ValueError),
    (torch.empty(4, 1, 2, 1, 64, 16, dtype=torch.float16).transpose(4, 5), ValueError),
    (torch.empty(1, 2, 1, 16, 64, dtype=torch.float16), ValueError),
    ("not a tensor", TypeError),
])
def test_check_rejects(cache, error):
    with pytest.raises(error, match="kv_cache"):
        KVCacheSpec(1, 1, 64, 16, torch.float16).check(cache)
