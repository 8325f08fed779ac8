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


def check_copy(src, dst, src_ids, dst_ids, layers=None):
    expected = dst.cpu().clone()
    part = slice(None) if layers is None else slice(*layers)
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):  # one page at a time
        expected[d, part] = src[s, part].cpu()
    copy_blocks(src, dst, src_ids, dst_ids, layers=layers)
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


@pytest.mark.parametrize("layers", [(0, 1), (1, 2), (0, 2)])
def test_cpu_layer_range_copies_only_those_layers(backend, layers):
    """The layer-wise reload's copy: layers start..end-1 of each page, the other layers untouched."""
    src, dst = random_pool(12, torch.float32), random_pool(12, torch.float32)
    check_copy(src, dst, torch.tensor([3, 4, 5, 0]), torch.tensor([7, 8, 9, 2]), layers)   # a run and a page


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


def ids_with_runs(num_runs, pages_per_run):
    """Page ids forming exactly `num_runs` merged runs of `pages_per_run` consecutive pages."""
    starts = torch.randperm(4 * num_runs)[:num_runs].sort().values * (pages_per_run + 1)
    return torch.cat([torch.arange(s, s + pages_per_run) for s in starts.tolist()])


@pytest.mark.parametrize("num_runs", [1, 17, 64, 256])
@pytest.mark.parametrize("page_bytes", [16 << 10, 2 << 20])
def test_cuda_path_is_chosen_by_bytes_per_run(num_runs, page_bytes):
    """The CUDA copy's choice (csrc/segments.h, replayed on the host by _C.copy_path): runs of >= 256 KiB
    go to the copy engine, whatever their count; small runs go to one gather kernel once there are 4+."""
    from shadowprefill import _C
    from shadowprefill.ops import page_copy

    max_run, min_runs = page_copy.copy_path_limits()
    for pages_per_run in (1, 16):
        ids = ids_with_runs(num_runs, pages_per_run)
        run_bytes = pages_per_run * page_bytes
        memcpy_runs, kernel_runs, chunks = _C.copy_path(ids.data_ptr(), ids.data_ptr(), ids.numel(), page_bytes,
                                                         max_run, min_runs, 64 << 10)
        assert memcpy_runs + kernel_runs == num_runs
        if run_bytes >= 256 << 10 or num_runs < 4:
            assert (memcpy_runs, kernel_runs, chunks) == (num_runs, 0, 0)
        else:
            assert (memcpy_runs, kernel_runs) == (0, num_runs)
            assert chunks == num_runs * -(-run_bytes // (64 << 10))


def test_cuda_path_splits_a_mix_of_small_and_large_runs(monkeypatch):
    from shadowprefill import _C
    from shadowprefill.ops import page_copy

    ids = torch.cat([ids_with_runs(6, 1), 1000 + torch.arange(40)])  # six 16 KiB runs and one of 640 KiB
    assert _C.copy_path(ids.data_ptr(), ids.data_ptr(), ids.numel(), 16 << 10, *page_copy.copy_path_limits(),
                        64 << 10) == (1, 6, 6)
    monkeypatch.setenv("SHADOWPREFILL_COPY_PATH", "kernel")
    assert _C.copy_path(ids.data_ptr(), ids.data_ptr(), ids.numel(), 16 << 10, *page_copy.copy_path_limits(),
                        64 << 10) == (0, 7, 6 + 10)
    monkeypatch.setenv("SHADOWPREFILL_COPY_PATH", "memcpy")
    assert _C.copy_path(ids.data_ptr(), ids.data_ptr(), ids.numel(), 16 << 10, *page_copy.copy_path_limits(),
                        64 << 10) == (7, 0, 0)
    monkeypatch.setenv("SHADOWPREFILL_COPY_PATH", "dma")
    with pytest.raises(ValueError, match="SHADOWPREFILL_COPY_PATH"):
        page_copy.copy_path_limits()


@needs_cuda
@pytest.mark.parametrize("path", ["auto", "memcpy", "kernel"])
@pytest.mark.parametrize("page_shape", [(1, 2, 2, 16, 64), (4, 2, 8, 16, 128)])  # 8 KiB and 256 KiB pages
def test_cuda_copies_on_every_path(monkeypatch, path, page_shape):
    """Scattered and consecutive ids, device <-> pinned host, through the copy engine and the gather
    kernel (pinned run table) alike: byte-exact, nothing else touched."""
    monkeypatch.setenv("SHADOWPREFILL_COPY_PATH", path)
    gpu = torch.randn((80,) + page_shape, device="cuda").half()
    host = torch.randn((80,) + page_shape).half().pin_memory()
    src_ids = torch.cat([ids_with_runs(9, 1), 60 + torch.arange(12)])
    dst_ids = torch.randperm(80)[:src_ids.numel()]
    check_copy(gpu, host, src_ids, dst_ids)
    check_copy(host, gpu, dst_ids, src_ids)
    last = page_shape[0] - 1
    check_copy(host, gpu, dst_ids, src_ids, layers=(last, last + 1))   # one layer (the layer-wise reload)
    for _ in range(3):  # reuse of the pinned staging ring
        check_copy(gpu, gpu.clone(), src_ids, dst_ids)
