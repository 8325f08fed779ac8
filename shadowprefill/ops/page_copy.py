"""copy_blocks: copy whole pages (or one layer range of each) between two caches of equal page shape, on
any pair of devices.

This is the spill / reload path of the host tier (DESIGN.md §3, §5): a page holds all layers of
block_size tokens contiguously, so page i is one contiguous byte range and runs of consecutive ids merge
into one copy; a layer range of a page is one contiguous byte range too (the layer-wise reload copies
layer l of every page, then layer l + 1, ...). CPU<->CPU runs in shadowprefill._C (multithreaded memcpy); anything touching CUDA runs in
shadowprefill._C_cuda, enqueued on the current stream, and returns at once: runs of at least
COPY_ENGINE_MIN_RUN_BYTES go to the copy engine (one cudaMemcpyAsync each), smaller ones to one gather
kernel when there are at least KERNEL_MIN_RUNS of them (csrc/segments.h). `SHADOWPREFILL_COPY_PATH=
auto|memcpy|kernel` forces one path (benchmarks).
"""
import os

import torch

from . import _backend, _validate as check

COPY_ENGINE_MIN_RUN_BYTES = 256 << 10  # a cudaMemcpyAsync costs ~2-5 us: worth it from here on
KERNEL_MIN_RUNS = 4                    # fewer small runs: their cudaMemcpyAsync calls cost less than a launch
COPY_PATHS = {"auto": (COPY_ENGINE_MIN_RUN_BYTES, KERNEL_MIN_RUNS), "memcpy": (0, 1 << 62), "kernel": (1 << 62, 1)}


def copy_path_limits() -> tuple:
    """(kernel_max_run_bytes, kernel_min_runs) for the CUDA copies, from SHADOWPREFILL_COPY_PATH."""
    name = os.environ.get("SHADOWPREFILL_COPY_PATH", "auto") or "auto"
    if name not in COPY_PATHS:
        raise ValueError(f"SHADOWPREFILL_COPY_PATH={name!r}: expected one of {', '.join(COPY_PATHS)}")
    return COPY_PATHS[name]


def page_bytes(kv_cache: torch.Tensor) -> int:
    return kv_cache.stride(0) * kv_cache.element_size()


def host_ids(ids: torch.Tensor) -> torch.Tensor:
    """Ids as a host int64 array (the compiled copies read them by address). Costs a sync for CUDA ids."""
    return ids.to(device="cpu", dtype=torch.int64).contiguous()


def _check_structure(src, dst, src_block_ids, dst_block_ids, layer_start, layer_end):
    check.kv_cache(src, "src")
    check.kv_cache(dst, "dst")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"dst: page shape {tuple(dst.shape[1:])} differs from src page shape {tuple(src.shape[1:])}")
    check.same_dtype(dst, "dst", src.dtype, "src")
    check.integer(layer_start, "layers[0]", 0, src.shape[1])
    check.integer(layer_end, "layers[1]", layer_start + 1, src.shape[1] + 1)
    check.block_ids(src_block_ids, "src_block_ids", (src.device, dst.device))
    check.block_ids(dst_block_ids, "dst_block_ids", (dst.device, src.device))
    check.shape(dst_block_ids, "dst_block_ids", src_block_ids.shape, "one destination per source id")


def _check_values(src, dst, src_ids, dst_ids, full: bool):
    """Ranges always (host ids: a min and a max); duplicates and src/dst overlap when `full`."""
    check.ids_in_range(src_ids, "src_block_ids", src.shape[0])
    check.ids_in_range(dst_ids, "dst_block_ids", dst.shape[0])
    if not full:
        return
    check.unique(dst_ids, "dst_block_ids")
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        overlap = dst_ids[torch.isin(dst_ids, src_ids)]
        if overlap.numel():
            raise ValueError(f"dst_block_ids: page {int(overlap[0])} is also a source page (src is dst)")


@torch.library.custom_op("shadowprefill::copy_blocks", mutates_args=("dst",))
def _copy_blocks_op(src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor,
                    dst_block_ids: torch.Tensor, layer_start: int, layer_end: int) -> None:
    _check_structure(src, dst, src_block_ids, dst_block_ids, layer_start, layer_end)
    src_ids, dst_ids = host_ids(src_block_ids), host_ids(dst_block_ids)
    on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
    full = _backend.value_checks_enabled(torch.device("cuda" if on_cuda else "cpu"))
    _check_values(src, dst, src_ids, dst_ids, full)
    n = src_ids.numel()
    if n == 0:
        return
    size = page_bytes(src)
    layer_bytes = src.stride(1) * src.element_size()
    offset, seg = layer_start * layer_bytes, (layer_end - layer_start) * layer_bytes   # all layers: the page
    args = (src.data_ptr(), dst.data_ptr(), src_ids.data_ptr(), dst_ids.data_ptr(), n, size, size, offset, offset,
            seg)
    bounds = dict(src_count=src.shape[0], dst_count=dst.shape[0])  # the extension re-checks the ids
    if src.device.type == "cpu" and dst.device.type == "cpu":
        _backend.cpu_extension().copy_segments(*args, num_threads=0, **bounds)
    elif _backend.backend_name() == "reference":
        layers = slice(layer_start, layer_end)
        dst[dst_ids.to(dst.device), layers] = src[src_ids.to(src.device), layers].to(dst.device)
    else:
        cuda_device = dst.device if dst.device.type == "cuda" else src.device
        stream = torch.cuda.current_stream(cuda_device)
        max_run, min_runs = copy_path_limits()
        with torch.cuda.device(cuda_device):
            _backend.cuda_extension().copy_segments(*args, stream_ptr=stream.cuda_stream, **bounds,
                                                    kernel_max_run_bytes=max_run, kernel_min_runs=min_runs)


@_copy_blocks_op.register_fake
def _(src, dst, src_block_ids, dst_block_ids, layer_start, layer_end):
    _check_structure(src, dst, src_block_ids, dst_block_ids, layer_start, layer_end)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor, layers: tuple[int, int] | None = None) -> None:
    """dst[dst_block_ids[i]] = src[src_block_ids[i]] for every i (whole pages, all layers; `layers=(start,
    end)`: only layers start..end-1 of each page, one contiguous range per page).

    src and dst: block-major caches with equal page shape and dtype, on any devices (CUDA, pinned or
    pageable CPU). Ids: int32/int64, on the CPU (best: no sync) or a cache's device. Ids out of range are
    an error always; duplicate destination ids (and, within one cache, a destination that is also a
    source) on CPU copies always, on copies touching CUDA with SHADOWPREFILL_DEBUG=1. A copy touching
    CUDA is enqueued on the current stream and returns at once; the caller keeps both caches alive until
    it completes (record an event). The run list is built on the host per call, so a copy is not captured
    into CUDA graphs.
    """
    for x, name in ((src, "src"), (dst, "dst"), (src_block_ids, "src_block_ids"),
                    (dst_block_ids, "dst_block_ids")):
        check.tensor(x, name)
    start, end = check.layer_range(layers, src.shape[1] if src.dim() == 6 else 1)   # (the op reports a bad src)
    torch.ops.shadowprefill.copy_blocks(src, dst, src_block_ids, dst_block_ids, start, end)
