"""copy_blocks: whole pages copied bit-exactly, nothing else touched, on every device pair available."""
import pytest
import torch

from shadowprefill.ops import copy_blocks


HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (device<->host copies)")


def bits(x):
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def random_pool(num_blocks, dtype=torch.float16, device="cpu", pin=False):
    pool = torch.randn(num_blocks, 2, 2, 2, 16, 64).to(dtype)
    pool = pool.pin_memory() if pin else pool
    return pool.to(device)


def check_copy(src, dst, src_ids, dst_ids):
    expected = dst.cpu().clone()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):  # one page at a time
        expected[d] = src[s].cpu()
    copy_blocks(src, dst, src_ids, dst_ids)
    if dst.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(expected))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cpu_random_ids(backend, id_dtype):
    src, dst = random_pool(40), random_pool(50)
    src_ids = torch.randint(0, 40, (25,), dtype=id_dtype)   # duplicate sources are fine
    dst_ids = torch.randperm(50)[:25].to(id_dtype)
    check_copy(src, dst, src_ids, dst_ids)


def test_cpu_runs_of_consecutive_ids_merge_correctly():
    src, dst = random_pool(64, torch.float32), random_pool(64, torch.float32)
    src_ids = torch.tensor([3, 4, 5, 6, 10, 11, 20, 21, 22, 40, 41])
    dst_ids = torch.tensor([30, 31, 32, 33, 12, 13, 0, 1, 5, 62, 63])  # runs that break on either side
    check_copy(src, dst, src_ids, dst_ids)


def test_cpu_large_pool_and_large_copy():
    """Ids near the end of a 32,768-page pool; one copy big enough for the multithreaded path (64 MiB)."""
    src = torch.randn(32768, 1, 2, 1, 16, 64).half()  # 128 MiB
    dst = torch.zeros(1024, 1, 2, 1, 16, 64).half()
    src_ids = torch.cat([torch.tensor([32767, 32766]), torch.randperm(32765)[:1022]])
    check_copy(src, dst, src_ids, torch.randperm(1024))
    big_src = torch.randn(64, 2, 2, 8, 16, 128).half()   # 1 MiB pages
    big_dst = torch.zeros_like(big_src)
    check_copy(big_src, big_dst, torch.arange(64), torch.arange(64).flip(0))


def test_same_cache_disjoint_pages():
    pool = random_pool(16)
    check_copy(pool, pool, torch.tensor([1, 2, 3]), torch.tensor([9, 10, 4]))


def test_empty_copy_is_a_no_op(backend):
    src, dst = random_pool(4), random_pool(4)
    check_copy(src, dst, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "reference"], indirect=True)
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_cuda_copies(backend, direction):
    pinned = random_pool(40, torch.bfloat16, pin=True)
    gpu = random_pool(40, torch.bfloat16, "cuda")
    gpu2 = random_pool(40, torch.bfloat16, "cuda")
    src, dst = {"d2h": (gpu, pinned), "h2d": (pinned, gpu), "d2d": (gpu, gpu2)}[direction]
    src_ids = torch.tensor([0, 1, 2, 3, 17, 39, 8])
    dst_ids = torch.tensor([5, 6, 7, 8, 0, 1, 39])
    check_copy(src, dst, src_ids, dst_ids)
    check_copy(src, dst, src_ids.cuda(), dst_ids.cuda())  # ids on the device work too (with a sync)


@needs_cuda
def test_cuda_copy_is_enqueued_on_the_current_stream():
    """Spill on a side stream, wait with an event, reload: byte-exact round trip."""
    gpu = random_pool(64, torch.float16, "cuda")
    host = random_pool(64, torch.float16, pin=True)
    ids = torch.randperm(64)[:32]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy_blocks(gpu, host, ids, ids)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert torch.equal(bits(host[ids]), bits(gpu[ids].cpu()))
    back = torch.zeros_like(gpu)
    copy_blocks(host, back, ids, ids)
    torch.cuda.synchronize()
    assert torch.equal(bits(back[ids].cpu()), bits(gpu[ids].cpu()))
