"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, and report resources.

    python bench/sm90_compile_report.py [--quick]

Runs the public entry points on CPU tensors for the bench shapes of issue 3 with every kernel launch
intercepted; each launch is compiled ahead of time for GPUTarget("cuda", 90, 32) with the specialisation
Triton's JIT would give it (pointers and ints divisible by 16 marked, ints equal to 1 made constexpr).
Per variant it prints shared memory, registers / spills (from the cubin, via the cuobjdump Triton ships),
and whether the loops got Hopper matrix instructions (wgmma) and software-pipelined async copies.
This costs no device time and catches lowering errors and resource overflows before a GPU run; it says
nothing about speed. Set PYTHONPATH to another Triton (e.g. 3.6, the GPU machine's) to check that one.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions, even without CUDA

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from shadowprefill import triton_kernels as tk  # noqa: E402
from shadowprefill.triton_kernels import attention, attention_split, kv_write, pack  # noqa: E402

KERNELS = [attention.paged_attention_kernel, attention_split.reduce_splits_kernel, kv_write.write_kv_kernel,
           pack.pack_kernel, pack.unpack_kernel]
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


def capture_launches(run_calls):
    """Run `run_calls()` with every kernel launch recorded (kernel, args, kwargs) instead of executed."""
    captured = []
    for kernel in KERNELS:
        kernel.run = (lambda k: lambda *args, grid, warmup, **kwargs: captured.append((k, args, kwargs)))(kernel)
    try:
        run_calls()
    finally:
        for kernel in KERNELS:
            del kernel.run
    return captured


def specialise(kernel, args, kwargs):
    """signature, constexprs, attrs and options as Triton's JIT would derive them for this launch."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args))
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        param = kernel.params[index]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot specialise {name}={value!r}")
    return signature, constexprs, attrs, options


def resources(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "cuobjdump not found"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return f"regs {match[1]} stack {match[2]} local {match[4]}" if match else text.strip()[-80:]


def workloads(quick: bool):
    """Calls of the bench shapes (bf16, Hq 32 / Hkv 8, D 128, block 16) plus the other head dims."""
    def attention_call(seqs, head_dim=128, q_heads=32, kv_heads=8, dtype=torch.bfloat16, window=0, softcap=0.0,
                       max_blocks=None):
        lens = [c + n for c, n in seqs]
        blocks = max_blocks or max(-(-n // 16) for n in lens)
        q = torch.empty((sum(n for _, n in seqs), q_heads, head_dim), dtype=dtype)
        cache = torch.empty((4, 1, 2, kv_heads, 16, head_dim), dtype=dtype)
        table = torch.zeros((len(seqs), blocks), dtype=torch.int32)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        tk.paged_attention(q, cache, 0, table, cu, torch.tensor(lens, dtype=torch.int32), 0.1, torch.empty_like(q),
                           window, softcap)

    calls = [("prefill 2048 on 32K", lambda: attention_call([(32768, 2048)])),
             ("decode 64 x 8K", lambda: attention_call([(8191, 1)] * 64)),
             ("decode 1 x 128K (split)", lambda: attention_call([(131071, 1)])),
             ("mixed 64 decodes + chunk", lambda: attention_call([(8191, 1)] * 64 + [(16384, 2048)]))]
    if not quick:
        for head_dim in (64, 80, 96, 256):
            calls.append((f"mixed D{head_dim}", lambda d=head_dim: attention_call([(100, 1), (50, 300)], head_dim=d)))
        calls.append(("mixed fp16 window softcap", lambda: attention_call([(100, 1), (50, 300)], dtype=torch.float16,
                                                                           window=64, softcap=30.0)))
        calls.append(("mixed fp32", lambda: attention_call([(100, 1), (50, 300)], dtype=torch.float32)))
    cache = torch.empty((8, 32, 2, 8, 16, 128), dtype=torch.bfloat16)
    ids = torch.arange(4)
    calls.append(("write_kv", lambda: tk.write_kv(torch.empty(8, 8, 128, dtype=torch.bfloat16),
                                                  torch.empty(8, 8, 128, dtype=torch.bfloat16), cache, 1,
                                                  torch.arange(8))))
    for quant in (None, "fp8"):
        buf = torch.empty((4, 32, 2, 8, 16, 128), dtype=torch.bfloat16 if quant is None else torch.float8_e4m3fn)
        scales = torch.empty((4, 32, 2, 8))
        for soft in ((False, True) if quant else (False,)):
            label = f"{quant} {'integer cvt' if soft else 'device cvt'}" if quant else "bf16"
            calls.append((f"pack {label}", gpu_fp8(lambda q=quant, f=soft: tk.pack_blocks(
                cache, ids, 0, 32, q, force_soft_fp8=f))))
            calls.append((f"unpack {label}", gpu_fp8(lambda b=buf, s=scales, f=soft: tk.unpack_blocks(
                b, s, cache, ids, 0, 32, force_soft_fp8=f))))
    return calls


def gpu_fp8(call):
    """`call` with pack's fp8 path chosen as on a GPU (the device conversion unless forced soft)."""
    def run():
        chooser = pack._soft_fp8
        pack._soft_fp8 = lambda kernel, device, force_soft: force_soft
        try:
            call()
        finally:
            pack._soft_fp8 = chooser
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the four attention bench shapes + copies")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    seen, failures = set(), 0
    for name, call in workloads(args.quick):
        for kernel, kargs, kwargs in capture_launches(call):
            signature, constexprs, attrs, options = specialise(kernel, kargs, dict(kwargs))
            key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            label = f"{name:<28} {kernel.fn.__name__:<24} " + " ".join(
                f"{k}={v}" for k, v in constexprs.items() if k.isupper())
            start = time.time()
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=GPUTarget("cuda", 90, 32), options=options)
            except Exception as e:  # noqa: BLE001 - report every variant
                failures += 1
                print(f"FAIL {label}\n     {type(e).__name__}: {str(e)[-1500:]}")
                continue
            ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
            print(f"ok   {label} {options}\n     smem {compiled.metadata.shared} B, "
                  f"{resources(compiled.asm['cubin'])}, "
                  f"wgmma {ttgir.count('warp_group_dot ')}, async copies {ttgir.count('async_copy_global_to_local')}, "
                  f"ld/st.v4 {ptx.count('.v4.')}, {time.time() - start:.1f} s")
    print(f"{len(seen)} variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
