"""Correctness part of bench/device_check.py: the Triton kernels against float64 / exact references.

The attention reference is shadowprefill.ops.reference in float64 (on the device), the one reference the
ops' CPU path uses, itself checked against torch SDPA in float64 by tests/ops/test_reference.py; it is
independent of the kernels. The fp8 reference runs on the CPU (exact division, as the kernel's div.rn.f32).
Outputs are poisoned with NaN before each call; pages' unwritten tails hold NaN. Every input is random
(never zeros) and fresh per check.
"""

import torch

from shadowprefill import triton_kernels as tk
from shadowprefill.ops import reference
from shadowprefill.ops.testing import random_batch
from shadowprefill.triton_kernels import launch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # rel. norm vs float64


def make_batch(seqs, num_blocks, num_layers, num_kv_heads, num_q_heads, block_size, head_dim, dtype, device,
               high_ids=False):
    """shadowprefill.ops.testing.random_batch (the tests' builder) over a new pool: random page order, or
    the highest ids of a mostly untouched (lazily committed) pool with `high_ids`."""
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    pool = torch.empty(shape, dtype=dtype, device=device)
    ids = None
    if high_ids:
        total = sum(-(-(c + n) // block_size) for c, n in seqs) + 1
        ids = (torch.randperm(total) + (num_blocks - total)).tolist()
    return random_batch(seqs, pool, num_layers - 1, num_q_heads, block_ids=ids)


def engine_views(kv_cache, layer, layout):
    """The same K/V as another engine holds them: (key_cache, value_cache) views of a new tensor."""
    k, v = kv_cache[:, layer, 0], kv_cache[:, layer, 1]               # [nb, Hkv, bs, D]
    if layout == "vllm":                                               # [2, nb, bs, Hkv, D]
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
        return kv[0], kv[1]
    kv = torch.stack([k, v], dim=1).contiguous()                       # FlashInfer HND [nb, 2, Hkv, bs, D]
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def attention_error(batch, window=0, softcap=0.0, splits=None, layout="block-major"):
    out = torch.full_like(batch["q"], float("nan"))
    args = (batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], batch["scale"], out, window, softcap)
    with launch.forced_splits(splits):
        if layout == "block-major":
            tk.paged_attention(batch["q"], batch["kv_cache"], batch["layer"], *args)
        else:
            tk.paged_attention_kv(batch["q"], *engine_views(batch["kv_cache"], batch["layer"], layout), *args)
    ref = reference.paged_attention(**batch, sliding_window=window, softcap=softcap, dtype=torch.float64)
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out.double() - ref).norm() / ref.norm())


def attention_cases(device, dry):
    """(name, dtype, batch kwargs, call kwargs) of the attention checks."""
    mixed = [(300, 1), (120, 37), (0, 50), (1000, 1), (17, 1)]
    if dry:
        return [("mixed fp32 D64 gqa2 bs16", torch.float32, dict(seqs=[(40, 1), (9, 12), (0, 5)], num_blocks=16,
                 num_layers=1, num_kv_heads=2, num_q_heads=4, block_size=16, head_dim=64), {}),
                ("mixed fp16 D80 split4 window softcap vLLM layout", torch.float16,
                 dict(seqs=[(40, 1), (9, 12)], num_blocks=16, num_layers=1, num_kv_heads=1, num_q_heads=2,
                      block_size=16, head_dim=80), dict(window=20, softcap=5.0, splits=4, layout="vllm"))]
    base = dict(num_blocks=512, num_layers=2)
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cases.append((f"mixed {str(dtype)[6:]} D128 gqa4 bs16", dtype,
                      dict(seqs=mixed, num_kv_heads=8, num_q_heads=32, block_size=16, head_dim=128, **base), {}))
    for head_dim, block_size, gqa in ((64, 32, 1), (80, 64, 8), (96, 128, 4), (256, 16, 2)):
        cases.append((f"mixed bf16 D{head_dim} gqa{gqa} bs{block_size}", torch.bfloat16,
                      dict(seqs=mixed, num_kv_heads=2, num_q_heads=2 * gqa, block_size=block_size,
                           head_dim=head_dim, **base), {}))
    gqa4 = dict(seqs=mixed, num_kv_heads=4, num_q_heads=16, block_size=16, head_dim=128, **base)
    cases += [
        ("mixed bf16 window 256 softcap 50", torch.bfloat16, gqa4, dict(window=256, softcap=50.0)),
        ("mixed bf16 forced split 8", torch.bfloat16, gqa4, dict(splits=8)),
        ("mixed bf16 vLLM layout", torch.bfloat16, gqa4, dict(layout="vllm")),
        ("mixed bf16 FlashInfer HND layout", torch.bfloat16, gqa4, dict(layout="hnd", window=100)),
        ("4 decodes at 32K bf16 (split chosen)", torch.bfloat16,
         dict(seqs=[(32768, 1)] * 4, num_blocks=8300, num_layers=1, num_kv_heads=8, num_q_heads=32,
              block_size=16, head_dim=128), {}),
        ("chunk 256 on 16K bf16 (split chosen)", torch.bfloat16,
         dict(seqs=[(16384, 256)], num_blocks=1100, num_layers=1, num_kv_heads=8, num_q_heads=32,
              block_size=16, head_dim=128), {}),
        ("2 decodes + chunk 256 on 16K bf16 (both launches split)", torch.bfloat16,
         dict(seqs=[(4000, 1), (16384, 256), (9000, 1)], num_blocks=1900, num_layers=1, num_kv_heads=8,
              num_q_heads=32, block_size=16, head_dim=128), {}),
        ("prefill 1024 on 3K bf16", torch.bfloat16,
         dict(seqs=[(3000, 1024)], num_blocks=300, num_layers=1, num_kv_heads=8, num_q_heads=32,
              block_size=16, head_dim=128), {}),
        ("int64 offsets (pool > 2^31 elements) bf16", torch.bfloat16,
         dict(seqs=[(500, 1), (300, 40)], num_blocks=(1 << 20) + 64, num_layers=1, num_kv_heads=1,
              num_q_heads=4, block_size=16, head_dim=64, high_ids=True), {}),
    ]
    return cases


def check_attention(table, device, dry):
    for name, dtype, batch_kwargs, call_kwargs in attention_cases(device, dry):
        batch = make_batch(dtype=dtype, device=device, **batch_kwargs)
        err = attention_error(batch, **call_kwargs)
        ok = err < TOLERANCE[dtype]
        table.add("check", f"attention {name}", err, "rel err", note=("ok" if ok else "FAIL") +
                  f" (< {TOLERANCE[dtype]:g})")
        del batch
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_copies(table, device, dry):
    dtype = torch.float32 if dry else torch.bfloat16
    shape = (64, 4, 2, 8, 16, 128) if not dry else (8, 2, 2, 2, 16, 64)
    pool = (torch.randn(shape, device=device) * 3).to(dtype)
    ids = torch.randperm(shape[0], device=device)[: shape[0] // 2]
    # write_kv (block-major) and write_kv_cache (vLLM layout) against a plain-torch scatter
    slots = torch.randperm(shape[0] * shape[4], device=device)[:100]
    slots[::9] = -1
    key = torch.randn(100, shape[3], shape[5], device=device).to(dtype)
    value = torch.randn(100, shape[3], shape[5], device=device).to(dtype)
    expected = pool.clone()
    reference.write_kv(key, value, expected, 1, slots)
    tk.write_kv(key, value, pool, 1, slots)
    written = torch.equal(pool, expected)
    table.add("check", "write_kv exact", float(written), "1=ok", note=_ok(written))
    vllm = torch.randn((2, shape[0], shape[4], shape[3], shape[5]), device=device).to(dtype)
    vllm_expected = vllm.clone()
    reference.write_kv_cache(key, value, vllm_expected[0], vllm_expected[1], slots)
    tk.write_kv_cache(key, value, vllm[0], vllm[1], slots)
    written = torch.equal(vllm, vllm_expected)
    table.add("check", "write_kv_cache (vLLM layout) exact", float(written), "1=ok", note=_ok(written))
    # pack / unpack, exact
    buf, scales = tk.pack_blocks(pool, ids, 1, 3 if not dry else 2)
    exact = torch.equal(buf, pool[ids, 1:buf.shape[1] + 1])
    target = torch.zeros_like(pool)
    tk.unpack_blocks(buf, scales, target, ids, 1, 1 + buf.shape[1])
    exact &= torch.equal(target[ids, 1:1 + buf.shape[1]], buf)
    table.add("check", "pack/unpack exact", float(exact), "1=ok", note=_ok(exact))
    # fp8: the device's conversion against the integer one, and against torch's cast
    hw, hw_scales = tk.pack_blocks(pool, ids, 0, shape[1], "fp8")
    soft, soft_scales = tk.pack_blocks(pool, ids, 0, shape[1], "fp8", force_soft_fp8=True)
    same = torch.equal(hw.view(torch.uint8), soft.view(torch.uint8)) and torch.equal(hw_scales, soft_scales)
    table.add("check", "fp8 pack: device cvt == integer cvt", float(same), "1=ok", note=_ok(same))
    ref_payload, ref_scales = reference.quantize_fp8(pool[ids].cpu())  # on the CPU: exact divisions
    agree = float((ref_payload.view(torch.uint8) == hw.cpu().view(torch.uint8)).float().mean())
    table.add("check", "fp8 pack == torch cast on the CPU (payload)", agree, "fraction", note=_ok(agree == 1.0))
    scales_equal = torch.equal(ref_scales, hw_scales.cpu())  # exact division (div.rn.f32) on both sides
    table.add("check", "fp8 pack scales == amax / 448 on the CPU", float(scales_equal), "1=ok",
              note=_ok(scales_equal))
    back = torch.zeros_like(pool)
    tk.unpack_blocks(hw, hw_scales, back, ids, 0, shape[1])
    pages = pool[ids].double()
    err = float((back[ids].double() - pages).norm() / pages.norm())
    table.add("check", "fp8 round trip", err, "rel err", note=_ok(err < 0.05) + " (< 0.05)")


def check_copy_blocks(table, device, dry):
    """copy_blocks GPU <-> host (pinned on a GPU) on each path, whole pages and a layer range, scattered ids:
    exactly the pages a plain-torch index copy on the CPU gives, and nothing else touched."""
    import os

    from shadowprefill import ops
    shape = (24, 4, 2, 2, 16, 64) if not dry else (8, 2, 2, 2, 16, 32)
    dtype = torch.float32 if dry else torch.bfloat16
    paths = ("auto", "kernel", "memcpy") if device.type == "cuda" else ("auto",)
    previous = os.environ.get("SHADOWPREFILL_COPY_PATH")
    try:
        for path in paths:
            os.environ["SHADOWPREFILL_COPY_PATH"] = path
            for layers in (None, (1, 3) if not dry else (1, 2)):
                gpu = torch.randn(shape, device=device).to(dtype)
                host = torch.randn(shape).to(dtype).pin_memory() if device.type == "cuda" else torch.randn(shape)
                src_ids, dst_ids = torch.randperm(shape[0])[:shape[0] // 2], torch.randperm(shape[0])[:shape[0] // 2]
                start, stop = layers or (0, shape[1])
                ok = True
                for src, dst in ((gpu, host), (host, gpu)):
                    expected = dst.cpu().clone()
                    expected[dst_ids, start:stop] = src.cpu()[src_ids, start:stop]
                    ops.copy_blocks(src, dst, src_ids, dst_ids, layers=layers)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    ok &= torch.equal(dst.cpu(), expected)
                table.add("check", f"copy_blocks exact, path {path}, layers {layers or 'all'}", float(ok), "1=ok",
                          note=_ok(ok))
    finally:
        if previous is None:
            os.environ.pop("SHADOWPREFILL_COPY_PATH", None)
        else:
            os.environ["SHADOWPREFILL_COPY_PATH"] = previous


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAIL"
