"""pytest-benchmark microbenchmarks of the Triton kernels (`make bench`, or `pytest bench/test_kernels_bench.py
--benchmark-only -s`).

On a GPU: bf16, Hq 32 / Hkv 8, head_dim 128, block 16, with the rate (TFLOP/s or GB/s) printed and stored in
extra_info. On the CPU the kernels run under the Triton interpreter with tiny shapes: those numbers only
show that the benchmarks run. The full GPU table (ceilings, peers, all shapes of issue 3) is
bench/device_check.sh.
"""
import pytest
import torch

from shadowprefill import triton_kernels as tk
from shadowprefill.ops.testing import random_batch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = (32, 8, 128, 16) if GPU else (4, 2, 64, 16)


def sync():
    if GPU:
        torch.cuda.synchronize()


def attention_batch(seqs):
    """shadowprefill.ops.testing.random_batch for [(context, q_len)] over a pool of exactly its pages (+ the
    NaN page), in random order; returns (tk.paged_attention args, pool)."""
    pages = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 1
    pool = torch.empty((pages, 1, 2, KV_HEADS, BLOCK, HEAD_DIM), device=DEVICE, dtype=DTYPE)
    b = random_batch(seqs, pool, 0, Q_HEADS, block_ids=torch.randperm(pages).tolist())
    args = (b["q"], pool, 0, b["block_table"], b["cu_seqlens_q"], b["seq_lens"], b["scale"], torch.empty_like(b["q"]))
    return args, pool


def run(benchmark, fn, rounds):
    benchmark.pedantic(lambda: (fn(), sync()), rounds=rounds, warmup_rounds=1)
    return benchmark.stats.stats.median


PREFILL = [(8192, 2048)] if GPU else [(64, 32)]
DECODE = [(8191, 1)] * 64 if GPU else [(127, 1)] * 2
LONG_DECODE = [(131071, 1)] if GPU else [(1023, 1)]


@pytest.mark.parametrize("name, seqs", [("prefill", PREFILL), ("decode", DECODE), ("decode-split", LONG_DECODE),
                                        ("mixed", DECODE + PREFILL)])
def test_paged_attention(benchmark, name, seqs):
    args, pool = attention_batch(seqs)
    seconds = run(benchmark, lambda: tk.paged_attention(*args), rounds=20 if GPU else 1)
    flops = sum(4 * Q_HEADS * HEAD_DIM * sum(c + i + 1 for i in range(n)) for c, n in seqs)  # causal only
    kv_bytes = pool.numel() * pool.element_size()
    benchmark.extra_info.update(tflops=flops / seconds / 1e12, kv_gb_per_s=kv_bytes / seconds / 1e9)
    print(f"\npaged_attention {name:<12} {seconds * 1e3:9.3f} ms  {flops / seconds / 1e12:8.2f} TFLOP/s  "
          f"{kv_bytes / seconds / 1e9:8.1f} GB/s KV")


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_pack_unpack(benchmark, quant, direction):
    shape = (512, 32, 2, 8, 16, 128) if GPU else (16, 2, 2, 2, 16, 64)
    cache = torch.randn(shape, device=DEVICE).to(DTYPE)
    ids = torch.randperm(shape[0], device=DEVICE)[: shape[0] // 2]
    buf, scales = tk.pack_blocks(cache, ids, 0, shape[1], quant)
    if direction == "pack":
        fn = lambda: tk.pack_blocks(cache, ids, 0, shape[1], quant)  # noqa: E731
    else:
        fn = lambda: tk.unpack_blocks(buf, scales, cache, ids, 0, shape[1])  # noqa: E731
    seconds = run(benchmark, fn, rounds=20 if GPU else 2)
    moved = cache[0].numel() * cache.element_size() * ids.numel() + buf.numel() * buf.element_size()
    benchmark.extra_info.update(gb_per_s_read_plus_write=moved / seconds / 1e9)
    print(f"\n{direction} {quant or 'raw':<4} {seconds * 1e3:9.3f} ms  {moved / seconds / 1e9:8.1f} GB/s read+write")


def test_write_kv(benchmark):
    tokens = 2048 if GPU else 32
    cache = torch.randn((tokens // BLOCK * 2, 4, 2, KV_HEADS, BLOCK, HEAD_DIM), device=DEVICE).to(DTYPE)
    key = torch.randn((tokens, KV_HEADS, HEAD_DIM), device=DEVICE).to(DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(cache.shape[0] * BLOCK, device=DEVICE)[:tokens]
    seconds = run(benchmark, lambda: tk.write_kv(key, value, cache, 1, slots), rounds=50 if GPU else 2)
    moved = 4 * key.numel() * key.element_size()  # read K, V; write K, V
    print(f"\nwrite_kv {tokens} tokens {seconds * 1e6:9.1f} us  {moved / seconds / 1e9:8.1f} GB/s read+write")
