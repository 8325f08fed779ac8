"""Copy sections of bench/device_check.py: pack / unpack against a device copy, copy_blocks spill / reload
of scattered pages against one contiguous pinned copy, the layer-wise reload (kv/reload.py) overlapped with
a matmul per layer against copy + compute and the pipeline model, one layer slice of scattered pages (the
gather kernel's case) against a contiguous pinned copy of the same bytes, and copy_blocks over 1 / 17 / 64 / 256
merged runs of small (16 KiB) and large (2 MiB) pages on each path (auto, copy engine only, gather kernel
only).

Same signature as the attention sections: (table, device, ceilings, dry, deadline, results).
"""
import os
import time

import torch

import devcheck_timing as timing
from shadowprefill import ops
from shadowprefill import triton_kernels as tk
from shadowprefill.kv.reload import SideStream
from shadowprefill.model.latency import pipelined_reload_s

LLAMA_PAGE = (32, 2, 8, 16, 128)   # Llama-3-8B: 32 layers x K/V x 8 heads x 16 tokens x 128, bf16 = 2 MiB
SMALL_PAGE = (1, 2, 4, 16, 64)     # one layer of a small model, bf16 = 16 KiB
RUN_COUNTS = (1, 17, 64, 256)


def pages(dry, device, num_pages, page_shape=LLAMA_PAGE):
    shape = (num_pages, 2, 2, 2, 16, 64) if dry else (num_pages,) + page_shape
    return torch.randn(shape, dtype=torch.float32 if dry else torch.bfloat16, device=device)


def pinned_like(cache, pin):
    host = torch.empty(cache.shape, dtype=cache.dtype, pin_memory=pin)
    host.copy_(cache)
    return host


def pack_unpack(table, device, ceil, dry, deadline, results):
    num_pages, moved = (64, 16) if dry else (1024, 256)
    cache = pages(dry, device, num_pages)
    ids = torch.randperm(num_pages, device=device)[:moved]
    nbytes = moved * cache[0].numel() * cache.element_size()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    contiguous = timing.median_seconds([lambda: dst.copy_(src)], device)
    layers = cache.shape[1]
    for quant in (None, "fp8"):
        buf, scales = tk.pack_blocks(cache, ids, 0, layers, quant)
        packed = buf.numel() * buf.element_size() + scales.numel() * 4
        calls = {"pack": lambda: tk.pack_blocks(cache, ids, 0, layers, quant),
                 "unpack": lambda: tk.unpack_blocks(buf, scales, cache, ids, 0, layers)}
        for direction, fn in calls.items():
            if time.time() > deadline:
                table.add("pack/unpack", f"{direction} {quant or 'raw'}", None, "", note="skipped: time budget")
                continue
            seconds = timing.median_seconds([fn], device)
            moved_bytes = nbytes + packed  # read one side, write the other
            rate = moved_bytes / seconds
            results.setdefault("pack", {})[f"{direction} {quant or 'raw'}"] = rate / ceil["copy"]
            table.add("pack/unpack", f"{direction} {quant or 'raw'} {moved} pages", rate / 1e9, "GB/s r+w",
                      rate / ceil["copy"], f"contiguous copy {2 * nbytes / contiguous / 1e9:.3g} GB/s r+w",
                      contiguous / seconds, f"{seconds * 1e3:.3f} ms for {nbytes / 2**20:.3g} MiB of cache")


def _time_copy(src, dst, src_ids, dst_ids, device, path):
    previous = os.environ.get("SHADOWPREFILL_COPY_PATH")
    os.environ["SHADOWPREFILL_COPY_PATH"] = path
    try:
        return timing.median_seconds([lambda: ops.copy_blocks(src, dst, src_ids, dst_ids)], device, graph=False)
    finally:
        if previous is None:
            os.environ.pop("SHADOWPREFILL_COPY_PATH")
        else:
            os.environ["SHADOWPREFILL_COPY_PATH"] = previous


def copy_blocks(table, device, ceil, dry, deadline, results):
    """Spill / reload of 256 scattered Llama pages (512 MiB) against one contiguous pinned copy."""
    num_pages, moved = (64, 16) if dry else (1024, 256)
    gpu = pages(dry, device, num_pages)
    host = pinned_like(pages(dry, device, num_pages), pin=device.type == "cuda")
    nbytes = moved * gpu[0].numel() * gpu.element_size()
    for ids_kind in ("random", "consecutive"):
        if ids_kind == "random":
            src_ids, dst_ids = torch.randperm(num_pages)[:moved], torch.randperm(num_pages)[:moved]
        else:
            src_ids, dst_ids = torch.arange(moved), torch.arange(moved) + (num_pages - moved)
        for direction, (src, dst) in (("d2h", (gpu, host)), ("h2d", (host, gpu))):
            seconds = _time_copy(src, dst, src_ids, dst_ids, device, "auto")
            rate = nbytes / seconds
            peer = ceil.get(direction)
            if ids_kind == "random" and peer:
                results.setdefault("spill", {})[direction] = rate / peer
            table.add("copy_blocks", f"{direction} {ids_kind} {moved} pages", rate / 1e9, "GB/s", None,
                      f"contiguous pinned {peer / 1e9:.1f} GB/s" if peer else "", rate / peer if peer else None,
                      f"{seconds * 1e3:.3f} ms for {nbytes / 2**20:.3g} MiB")
            if (ids_kind, direction) == ("random", "h2d"):
                reload_overlap(table, device, src, dst, src_ids, dst_ids, seconds, dry, deadline)


def reload_overlap(table, device, host, gpu, src_ids, dst_ids, whole_s, dry, deadline):
    """The layer-wise reload of the scattered pages (one copy and one event per layer on the side stream)
    under a forward stand-in (matmuls sized so the compute about equals the copy, waiting on layer l's
    event before layer l): measured against copy + compute and max(C + R/L, R + C/L) (latency model)."""
    if time.time() > deadline:
        table.add("copy_blocks", "layer-wise reload + compute", None, "", note="skipped: time budget")
        return
    layers = gpu.shape[1]
    n = 64 if dry else 4096
    a = torch.randn(n, n, device=device, dtype=gpu.dtype)
    matmul_s = timing.median_seconds([lambda: a @ a], device, graph=False)
    reps = max(1, round(whole_s / layers / matmul_s))

    def compute(waits=None):
        for layer in range(layers):
            if waits is not None:
                waits.wait(layer)
            for _ in range(reps):
                a @ a

    def layer_wise():
        side = SideStream(device)
        batch = side.reload(host, gpu, src_ids.tolist(), dst_ids.tolist())
        side.issue(batch)
        compute(batch)

    compute_s = timing.median_seconds([compute], device, graph=False)
    seconds = timing.median_seconds([layer_wise], device, graph=False)
    model = pipelined_reload_s(compute_s, whole_s, layers)
    table.add("copy_blocks", f"layer-wise reload + compute ({layers} layers)", seconds * 1e3, "ms", None,
              f"copy + compute {(whole_s + compute_s) * 1e3:.3f} ms", (whole_s + compute_s) / seconds,
              f"pipeline model {model * 1e3:.3f} ms (measured / model {seconds / model:.2f}); copy "
              f"{whole_s * 1e3:.3f} ms, compute {compute_s * 1e3:.3f} ms")


def layer_slice_reload(table, device, ceil, dry, deadline, results):
    """One layer of 256 scattered Llama pages (a 64 KiB slice per page, below the copy-engine threshold, so
    `auto` takes the gather kernel) pinned host -> GPU, as the layer-wise reload issues it, against one
    contiguous pinned copy of the same bytes; each path (auto / gather kernel / one memcpy per page)."""
    num_pages, moved = (64, 16) if dry else (1024, 256)
    gpu = pages(dry, device, num_pages)
    host = pinned_like(pages(dry, device, num_pages), pin=device.type == "cuda")
    src_ids, dst_ids = torch.randperm(num_pages)[:moved], torch.randperm(num_pages)[:moved]
    layer = gpu.shape[1] // 2
    nbytes = moved * gpu[0, layer].numel() * gpu.element_size()
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    contiguous = timing.median_seconds([lambda: flat_gpu.copy_(flat_host, non_blocking=True)], device, graph=False)
    cells, rates = [], {}
    for path in (("auto", "kernel", "memcpy") if device.type == "cuda" else ("auto",)):
        if time.time() > deadline:
            cells.append(f"{path} skipped")
            continue
        previous = os.environ.get("SHADOWPREFILL_COPY_PATH")
        os.environ["SHADOWPREFILL_COPY_PATH"] = path
        try:
            seconds = timing.median_seconds(
                [lambda: ops.copy_blocks(host, gpu, src_ids, dst_ids, layers=(layer, layer + 1))], device, graph=False)
        finally:
            if previous is None:
                os.environ.pop("SHADOWPREFILL_COPY_PATH")
            else:
                os.environ["SHADOWPREFILL_COPY_PATH"] = previous
        rates[path] = nbytes / seconds
        cells.append(f"{path} {nbytes / seconds / 1e9:.3g}")
    if "auto" not in rates:
        table.add("layer slice", f"h2d 1 layer of {moved} pages", None, "", note="skipped: time budget")
        return
    results["layer_slice"] = rates["auto"] * contiguous / nbytes
    table.add("layer slice", f"h2d 1 layer of {moved} scattered pages", rates["auto"] / 1e9, "GB/s (auto)", None,
              f"contiguous pinned copy of the same bytes {nbytes / contiguous / 1e9:.3g} GB/s",
              results["layer_slice"], f"GB/s by path: {', '.join(cells)}; {nbytes / 2**20:.3g} MiB")


def ids_with_runs(num_runs, total_pages, num_pages):
    """(src ids, dst ids) of ~total_pages pages in exactly `num_runs` merged runs on both sides."""
    per_run = max(1, total_pages // num_runs)
    gap = max(1, (num_pages - num_runs * per_run) // num_runs)
    starts = torch.arange(num_runs) * (per_run + gap)
    src = torch.cat([torch.arange(s, s + per_run) for s in starts.tolist()])
    dst = torch.cat([torch.arange(s, s + per_run) for s in starts.flip(0).tolist()])  # runs reversed
    return src, dst


def copy_runs(table, device, ceil, dry, deadline, results):
    """copy_blocks GPU <-> pinned host over 1 / 17 / 64 / 256 runs of small and large pages, each path."""
    total = 16 if dry else 256
    paths = ("auto", "memcpy", "kernel") if device.type == "cuda" else ("auto",)
    for page_name, page_shape in (("small 16 KiB", SMALL_PAGE), ("large 2 MiB", LLAMA_PAGE)):
        num_pages = 2 * total + (RUN_COUNTS[-1] if not dry else 8)
        gpu = pages(dry, device, num_pages, page_shape)
        host = pinned_like(pages(dry, device, num_pages, page_shape), pin=device.type == "cuda")
        page_bytes = gpu[0].numel() * gpu.element_size()
        for num_runs in (RUN_COUNTS if not dry else (1, 4, 16)):
            src_ids, dst_ids = ids_with_runs(num_runs, total, num_pages)
            nbytes = src_ids.numel() * page_bytes
            peer = ceil.get("h2d")
            for direction, (src, dst) in (("d2h", (gpu, host)), ("h2d", (host, gpu))):
                cells = []
                for path in paths:
                    if time.time() > deadline:
                        cells.append(f"{path} skipped")
                        continue
                    seconds = _time_copy(src, dst, src_ids, dst_ids, device, path)
                    cells.append(f"{path} {nbytes / seconds / 1e9:.3g}")
                    if path == "auto":
                        auto_rate = nbytes / seconds
                if not any(c.startswith("auto ") and "skipped" not in c for c in cells):
                    table.add("copy runs", f"{direction} {page_name} {num_runs} runs", None, "",
                              note="skipped: time budget")
                    continue
                peer = ceil.get(direction)
                table.add("copy runs", f"{direction} {page_name} {num_runs} runs", auto_rate / 1e9, "GB/s (auto)",
                          None, f"contiguous pinned {peer / 1e9:.1f} GB/s" if peer else "",
                          auto_rate / peer if peer else None,
                          f"GB/s by path: {', '.join(cells)}; {nbytes / 2**20:.3g} MiB, {src_ids.numel()} pages")
        del gpu, host
