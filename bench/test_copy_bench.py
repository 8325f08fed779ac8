"""Page copy / pack / unpack throughput against one plain contiguous copy of the same bytes.

`make bench` (or `pytest bench/test_copy_bench.py -s`): each case prints GB/s of the op and of a contiguous
copy of as many bytes on the same device pair, and their ratio (also stored in the benchmark's extra_info).
CPU always; the CUDA cases (device <-> pinned host, device pages <-> contiguous buffer) when a GPU is present.
"""
import time

import pytest
import torch

from shadowprefill import ops
from shadowprefill.kv import KVCacheSpec

# a Llama-style page: 4 layers x 8 kv heads x 16 tokens x 128 dims, bf16 = 256 KiB (the 8B model: 32 layers)
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
NUM_BLOCKS, NUM_MOVED = 512, 128     # 128 MiB pool, 32 MiB moved per call
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats=10):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def contiguous_copy_seconds(nbytes, src_device, dst_device):
    pin = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device, pin_memory=pin and src_device == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device, pin_memory=pin and dst_device == "cpu")
    src.random_(0, 255)
    return median_seconds(lambda: dst.copy_(src, non_blocking=True), dst_device if dst_device != "cpu" else src_device)


def report(benchmark, name, nbytes, device, baseline_seconds):
    seconds = benchmark.stats.stats.median
    rate, base = nbytes / seconds / 1e9, nbytes / baseline_seconds / 1e9
    benchmark.extra_info.update(gb_per_s=rate, contiguous_gb_per_s=base, ratio=rate / base, bytes=nbytes)
    print(f"\n{name:<34} {device:<10} {rate:8.2f} GB/s   contiguous {base:8.2f} GB/s   ratio {rate / base:5.2f}")


def pool(device):
    """A cache of random finite values; host caches are pinned when a GPU is present (the host tier's)."""
    cache = SPEC.allocate(NUM_BLOCKS, "cpu", pin_memory=device == "cpu" and "cuda" in DEVICES)
    cache.normal_()
    return cache if device == "cpu" else cache.to(device)


@pytest.mark.parametrize("pair", [("cpu", "cpu")] + [(a, b) for a, b in (("cuda", "cpu"), ("cpu", "cuda"),
                                                                          ("cuda", "cuda")) if "cuda" in DEVICES])
@pytest.mark.parametrize("ids", ["random", "consecutive"])
def test_copy_blocks(benchmark, pair, ids):
    src_device, dst_device = pair
    src, dst = pool(src_device), pool(dst_device)
    if ids == "random":
        src_ids, dst_ids = torch.randperm(NUM_BLOCKS)[:NUM_MOVED], torch.randperm(NUM_BLOCKS)[:NUM_MOVED]
    else:
        src_ids, dst_ids = torch.arange(NUM_MOVED), torch.arange(NUM_MOVED) + 100
    device = "cuda" if "cuda" in pair else "cpu"
    benchmark.pedantic(lambda: (ops.copy_blocks(src, dst, src_ids, dst_ids), sync(device)), rounds=10,
                       warmup_rounds=1)
    nbytes = NUM_MOVED * SPEC.page_bytes
    report(benchmark, f"copy_blocks {src_device}->{dst_device} {ids}", nbytes, device,
           contiguous_copy_seconds(nbytes, src_device, dst_device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("variant", ["raw", "raw-layers-1:3", "fp8"])
def test_pack_unpack(benchmark, device, direction, variant):
    cache = pool(device)
    ids = torch.randperm(NUM_BLOCKS)[:NUM_MOVED]
    quant = "fp8" if variant == "fp8" else None
    layers = (1, 3) if variant == "raw-layers-1:3" else None
    buf, scales = ops.pack_blocks(cache, ids, layers=layers, quant=quant)
    if direction == "pack":
        fn = lambda: ops.pack_blocks(cache, ids, layers=layers, quant=quant)  # noqa: E731
    else:
        fn = lambda: ops.unpack_blocks(buf, scales, cache, ids, layers=layers)  # noqa: E731
    rounds = 3 if quant and device == "cpu" else 10  # the CPU fp8 path is plain torch: slow
    benchmark.pedantic(lambda: (fn(), sync(device)), rounds=rounds, warmup_rounds=1)
    nbytes = NUM_MOVED * SPEC.page_bytes * (2 if layers else SPEC.num_layers) // SPEC.num_layers  # cache bytes
    report(benchmark, f"{direction}_blocks {variant}", nbytes, device, contiguous_copy_seconds(nbytes, device, device))
