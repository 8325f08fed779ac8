"""Ops self-check: `shadowprefill selfcheck` (or `python -m shadowprefill.selfcheck`).

On the available device (CUDA if present, else CPU) it builds a small paged pool, writes a mixed
decode/prefill batch with write_kv, runs paged_attention against the float64 reference
(shadowprefill.ops.reference.dense_attention), repeats both on a vLLM-layout copy of the cache with
write_kv_cache / paged_attention_kv, spills and reloads pages with copy_blocks (device <-> host),
packs/unpacks with and without fp8, prints one table: op | check | max error | throughput, and ends with one
line `PASS: ...` or `FAIL: ...` naming the failed checks (exit status 1).
"""
import math
import sys
import time

import torch

from shadowprefill import ops
from shadowprefill.ops import reference
from shadowprefill.kv import KVCacheSpec

# (cached context, new tokens): decodes, a prefill chunk on cached context, a fresh prefill
BATCH = [(700, 1), (311, 1), (64, 1), (1000, 1), (512, 128), (0, 200)]


def timed(fn, device, repeats=5):
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(device: torch.device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=128, block_size=16, dtype=dtype)
    num_q_heads, layer, num_blocks = 16, 1, 512
    pool = spec.allocate(num_blocks, device).fill_(float("nan"))
    rows = []

    # write_kv: every token of every sequence, pages from a random permutation of the pool
    lens = [c + n for c, n in BATCH]
    pages = torch.randperm(num_blocks)
    tables, used = [], 0
    for length in lens:
        count = math.ceil(length / spec.block_size)
        tables.append(pages[used:used + count])
        used += count
    table = torch.zeros(len(BATCH), max(len(t) for t in tables), dtype=torch.int32)
    for s, t in enumerate(tables):
        table[s, :len(t)] = t
    slots = torch.cat([tables[s][torch.arange(n) // spec.block_size] * spec.block_size
                       + torch.arange(n) % spec.block_size for s, n in enumerate(lens)])
    keys = torch.randn(len(slots), spec.num_kv_heads, spec.head_dim, device=device).to(dtype)
    values = torch.randn_like(keys)
    slots_dev = slots.to(device)
    ops.write_kv(keys, values, pool, layer, slots_dev)
    flat = pool[:, layer].permute(0, 3, 1, 2, 4).reshape(num_blocks * spec.block_size, 2, spec.num_kv_heads, -1)
    exact = torch.equal(flat[slots_dev, 0], keys) and torch.equal(flat[slots_dev, 1], values)
    seconds = timed(lambda: ops.write_kv(keys, values, pool, layer, slots_dev), device)
    rows.append(("write_kv", exact, 0.0, 2 * keys.numel() * keys.element_size() / seconds / 1e9, "GB/s"))

    # paged_attention over the mixed batch vs float64 dense attention per sequence
    q_lens = [n for _, n in BATCH]
    q = torch.randn(sum(q_lens), num_q_heads, spec.head_dim, device=device).to(dtype)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(spec.head_dim)
    args = (q, pool, layer, table.to(device), cu.to(device), seq_lens.to(device), scale)
    out = ops.paged_attention(*args, out=torch.full_like(q, float("nan")))
    token_start = torch.tensor([0] + lens).cumsum(0)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3  # |out - ref| <= tol * (1 + |ref|)
    worst, ok, flops = 0.0, bool(torch.isfinite(out).all()), 0
    for s, (context, n) in enumerate(BATCH):
        tokens = slice(int(token_start[s]), int(token_start[s + 1]))
        ref = reference.dense_attention(q[cu[s]:cu[s + 1]].cpu(), keys[tokens].cpu(), values[tokens].cpu(), scale)
        error = (out[cu[s]:cu[s + 1]].cpu().double() - ref).abs()
        worst = max(worst, float(error.max()))
        ok = ok and bool((error <= tolerance * (1 + ref.abs())).all())
        flops += 4 * num_q_heads * spec.head_dim * sum(context + i + 1 for i in range(n))
    seconds = timed(lambda: ops.paged_attention(*args, out=out), device)
    rows.append(("paged_attention", ok, worst, flops / seconds / 1e12, "TFLOP/s"))

    # the same on a vLLM-layout cache ([2, num_blocks, block_size, Hkv, D], per layer): write, then attend
    vllm = torch.full((2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim), float("nan"),
                      dtype=dtype, device=device)
    ops.write_kv_cache(keys, values, vllm[0], vllm[1], slots_dev)
    exact = (torch.equal(vllm[0].flatten(0, 1)[slots_dev], keys)
             and torch.equal(vllm[1].flatten(0, 1)[slots_dev], values))
    seconds = timed(lambda: ops.write_kv_cache(keys, values, vllm[0], vllm[1], slots_dev), device)
    rows.append(("write_kv_cache (vLLM)", exact, 0.0, 2 * keys.numel() * keys.element_size() / seconds / 1e9, "GB/s"))
    kv_args = (q, vllm[0], vllm[1]) + args[3:]
    out_kv = ops.paged_attention_kv(*kv_args, out=torch.full_like(q, float("nan")))
    diff = (out_kv.float() - out.float()).abs()  # the same kernel family on other strides
    same = bool(torch.isfinite(out_kv).all()) and bool((diff <= tolerance * (1 + out.float().abs())).all())
    seconds = timed(lambda: ops.paged_attention_kv(*kv_args, out=out_kv), device)
    rows.append(("paged_attention_kv (vLLM)", same and ok, float(diff.max()), flops / seconds / 1e12, "TFLOP/s"))

    # copy_blocks: spill used pages to host memory, reload them into other pages of the pool
    host = spec.allocate(num_blocks, "cpu", pin_memory=device.type == "cuda")
    spilled = pages[:used]
    ops.copy_blocks(pool, host, spilled, spilled)
    reload_to = pages[used:2 * used]
    ops.copy_blocks(host, pool, spilled, reload_to)
    if device.type == "cuda":
        torch.cuda.synchronize()
    as_int = lambda x: x.view(torch.int16)  # noqa: E731  bit patterns: NaN tails compare equal
    exact = torch.equal(as_int(pool[reload_to.to(device)]), as_int(pool[spilled.to(device)]))
    nbytes = used * spec.page_bytes
    seconds = timed(lambda: ops.copy_blocks(pool, host, spilled, spilled), device)
    rows.append(("copy_blocks (spill)", exact, 0.0, nbytes / seconds / 1e9, "GB/s"))
    seconds = timed(lambda: ops.copy_blocks(host, pool, spilled, reload_to), device)
    rows.append(("copy_blocks (reload)", exact, 0.0, nbytes / seconds / 1e9, "GB/s"))

    # pack / unpack, raw and fp8, of the written pages (their NaN tails included)
    target = spec.allocate(num_blocks, device).fill_(0)
    for quant in (None, "fp8"):
        buf, scales = ops.pack_blocks(pool, spilled, quant=quant)
        ops.unpack_blocks(buf, scales, target, spilled)
        original, restored = pool[spilled.to(device)].float(), target[spilled.to(device)].float()
        finite = torch.isfinite(original)
        error = float((restored - original)[finite].abs().max() / original[finite].abs().max())
        ok = (torch.equal(as_int(target[spilled.to(device)]), as_int(pool[spilled.to(device)])) if quant is None
              else error < 2 ** -4 and bool(torch.isnan(restored[~finite]).all()))
        name = "fp8" if quant else "raw"
        seconds = timed(lambda: ops.pack_blocks(pool, spilled, quant=quant), device)
        rows.append((f"pack_blocks ({name})", ok, error, nbytes / seconds / 1e9, "GB/s"))
        seconds = timed(lambda: ops.unpack_blocks(buf, scales, target, spilled), device)
        rows.append((f"unpack_blocks ({name})", ok, error, nbytes / seconds / 1e9, "GB/s"))
    return rows


def register(subparsers) -> None:
    """Adds `shadowprefill selfcheck` to the command line."""
    parser = subparsers.add_parser("selfcheck", help="check and time every op on this machine's device",
                                   description="Check every op against its float64 reference on this machine's "
                                               "device (CUDA if present, else CPU), time it, and end with one "
                                               "PASS / FAIL line (exit status 1 on FAIL).")
    parser.set_defaults(func=lambda args: main())


def main(argv=None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    print(f"shadowprefill ops self-check on {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    rows = run(device)
    print(f"{'op':<28}{'check':<8}{'max error':>12}{'throughput':>20}")
    for name, ok, error, rate, unit in rows:
        print(f"{name:<28}{'ok' if ok else 'FAIL':<8}{error:>12.3g}{rate:>12.4g} {unit:<7}")
    print("max error: paged_attention vs float64 dense attention (abs), paged_attention_kv vs paged_attention "
          "(abs); pack/unpack relative to the largest |value|")
    failed = [name for name, ok, *_ in rows if not ok]
    if failed:
        print(f"FAIL: {len(failed)} of {len(rows)} checks on {device.type}: {', '.join(failed)}")
        return 1
    print(f"PASS: all {len(rows)} checks on {device.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
