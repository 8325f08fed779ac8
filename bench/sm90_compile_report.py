"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU; report and assert.

    python bench/sm90_compile_report.py [--quick] [--triton current|3.6|both]

Runs the public entry points on CPU tensors for the bench shapes with every kernel launch intercepted; each
launch is compiled ahead of time for GPUTarget("cuda", 90, 32) with the specialisation Triton's JIT would
give it (pointers and ints divisible by 16 marked, ints equal to 1 made constexpr). Per variant it prints
shared memory, registers / spills (from the cubin, via the cuobjdump Triton ships), wgmma and async-copy
counts, and for the attention kernel the pipelining read from the TTGIR and PTX. It fails (exit 1) when:
  - a variant does not compile;
  - a 16-bit attention variant keeps fewer than 2 K/V buffers, or a key loop of it waits for all its
    copies (`async_wait {num = 0}` / `cp.async.wait_group 0` inside the loop) instead of leaving the next
    tile's K and V in flight (a partial wait, num >= 2: two commit groups per tile);
  - launch.tile_resources (the occupancy model of the planner) is below the compiler's shared memory or
    registers for any attention variant;
  - the fp8 pack kernel (device conversion) divides with anything but div.rn.f32 (torch divides exactly);
  - an OVERLAP attention variant (tile suffix "o") has no wgmma loop whose every exp2 (the softmax) runs
    while a wgmma group is still in flight (read from the PTX: wgmma.commit_group / wgmma.wait_group N
    around ex2.approx, two passes over the loop body), or no MUFU.EX2 between an HGMMA and its wait in
    the SASS, or spills registers.
Per attention variant the report prints shared memory per CTA, registers / spills, the planner's CTAs
per SM, and from the SASS how many MUFU.EX2 ptxas placed between an HGMMA and the WARPGROUP.DEPBAR that
waits for it (program order, after ptxas's scheduling), for the default prefill tile and the tiles of PREFILL_TILES (the previous loop, the two-CTA tiles).
This costs no device time and catches lowering errors, resource overflows and pipelining regressions
before a GPU run; it says nothing about speed.

Triton versions: `--triton current` (default) uses the Triton of this interpreter (3.9 in the project's
.venv); `--triton 3.6` uses Triton 3.6.0, the GPU machine's, installed on first use from PyPI with
`pip install --no-deps --target .venv/triton-3.6 triton==3.6.0` (inside the ignored .venv, never in git)
and put first on PYTHONPATH in a subprocess; `--triton both` runs both.
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
from shadowprefill.triton_kernels import attention, attention_split, kv_write, launch, pack  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_36 = os.path.join(ROOT, ".venv", "triton-3.6")
KERNELS = [attention.paged_attention_kernel, attention_split.reduce_splits_kernel, kv_write.write_kv_kernel,
           pack.pack_kernel, pack.unpack_kernel]
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# besides the default prefill tile (128x64w8s3o, the overlapped main loop): the previous loop, the two-CTA
# overlapped tile and the previous two-CTA-capable tile, compared by the first GPU run's tile sweep
PREFILL_TILES = ["128x64w8s3", "64x32w4s4o", "64x64w4s3"]


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


def resources(cubin: bytes) -> dict:
    """Registers, stack and local memory of the cubin (cuobjdump --dump-resource-usage)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return {"regs": int(match[1]), "stack": int(match[2]), "local": int(match[4])} if match else {}


def sass(cubin: bytes) -> str:
    """The cubin's SASS (cuobjdump -sass, the one Triton ships), or "" without it."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def sass_ex2_under_hgmma(text: str) -> tuple:
    """(MUFU.EX2 issued after an HGMMA and before the WARPGROUP.DEPBAR that waits for it, all MUFU.EX2), in
    program order: what the machine code does after ptxas's scheduling (it may interleave the softmax with
    the issue of the next tile's q.K HGMMAs)."""
    pending, under, total = False, 0, 0
    for line in text.splitlines():
        if re.search(r"\bHGMMA\.", line):
            pending = True
        elif "WARPGROUP.DEPBAR" in line:
            pending = False
        elif "MUFU.EX2" in line:
            total += 1
            under += pending
    return under, total


def key_loops(ttgir: str) -> list:
    """Bodies of the scf.for loops that issue async K/V copies (brace matching on the TTGIR text)."""
    bodies = []
    for match in re.finditer(r"scf\.for ", ttgir):
        i = ttgir.index("\n", match.end()) - 1  # the header line ends with the body's "{"
        while ttgir[i] != "{":
            i -= 1
        depth, start = 0, i
        while True:
            depth += {"{": 1, "}": -1}.get(ttgir[i], 0)
            if depth == 0:
                break
            i += 1
        body = ttgir[start:i]
        if "async_copy_global_to_local" in body:
            bodies.append(body)
    return bodies


def pipelining(ttgir: str, ptx: str, constexprs: dict) -> dict:
    """K/V buffers per load and the waits inside each key loop, from the TTGIR; waits in the PTX."""
    shape = rf"!ttg\.memdesc<(\d+)x{constexprs['BLOCK_N']}x{constexprs['HEAD_DIM_P']}x"
    buffers = [int(n) for n in re.findall(r"local_alloc[^\n]*-> " + shape, ttgir)]
    loops = key_loops(ttgir)
    waits = [[int(n) for n in re.findall(r"async_wait[^\n]*\{num = (\d+)", body)] for body in loops]
    ptx_waits = sorted({int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)})
    return {"buffers": buffers, "loops": len(loops), "loop_waits": waits, "ptx_waits": ptx_waits,
            "overlap": wgmma_overlap(ptx)}


def wgmma_overlap(ptx: str) -> list:
    """Per PTX loop that issues wgmma: (exp2 executed while a wgmma group is in flight, exp2 in the loop).

    A loop body is the text from a label to a branch back to it; its instructions are walked twice (the
    second pass starts with the groups left pending by the first, as the next iteration does): a
    wgmma.commit_group adds a pending group, wgmma.wait_group N leaves at most N, and each ex2.approx of
    the second pass counts as overlapped when a group is pending, i.e. the softmax runs on the CUDA cores
    while the tensor cores still work."""
    lines = ptx.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$L__BB\d+_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if not (m and labels.get(m[1], i) < i):
            continue
        body = lines[labels[m[1]]:i]
        if not any("wgmma.mma_async" in b for b in body):
            continue
        pending, under, total = 0, 0, 0
        for second in (False, True):
            for b in body:
                if "wgmma.commit_group" in b:
                    pending += 1
                wait = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", b)
                if wait:
                    pending = min(pending, int(wait[1]))
                if second and "ex2.approx" in b:
                    total += 1
                    under += pending > 0
        loops.append((under, total))
    return loops


def attention_problems(variant, constexprs, options, signature, metadata, res, failures, label):
    """The attention-kernel assertions of the module docstring; returns the report line."""
    dtype = DTYPES[signature["q_ptr"][1:]]
    tile = launch.AttentionTile(constexprs["BLOCK_Q"], constexprs["GROUP_P"], constexprs["BLOCK_N"],
                                constexprs["HEAD_DIM_P"], options.get("num_warps", 4), options.get("num_stages", 3),
                                bool(constexprs.get("OVERLAP", False)))
    model_smem, model_regs = launch.tile_resources(tile, dtype)
    pipe = variant
    line = (f"K/V buffers {pipe['buffers']}, waits in {pipe['loops']} key loops {pipe['loop_waits']}, "
            f"ptx wait_group {pipe['ptx_waits']}; model smem {model_smem} regs {model_regs}, "
            f"{launch.ctas_per_sm(tile, dtype)} CTAs/SM; exp2 under wgmma in flight per wgmma loop "
            f"{[f'{u}/{t}' for u, t in pipe['overlap']]}")
    if constexprs.get("OVERLAP"):
        if not any(u > 0 and u == t for u, t in pipe["overlap"]):
            failures.append(f"{label}: OVERLAP variant without a loop whose softmax runs under a wgmma in flight "
                            f"({pipe['overlap']})")
        if res and (res["stack"] or res["local"]):
            failures.append(f"{label}: OVERLAP variant spills registers (stack {res['stack']}, local {res['local']})")
    if dtype != torch.float32:
        if not pipe["buffers"] or min(pipe["buffers"]) < 2:
            failures.append(f"{label}: K/V buffers {pipe['buffers']} < 2")
        if pipe["loops"] == 0 or any(not w or max(w) < 2 for w in pipe["loop_waits"]):
            failures.append(f"{label}: a key loop waits for every copy (waits {pipe['loop_waits']})")
        if not any(n >= 2 for n in pipe["ptx_waits"]):
            failures.append(f"{label}: no partial cp.async.wait_group in the PTX ({pipe['ptx_waits']})")
    if model_smem < metadata.shared:
        failures.append(f"{label}: model smem {model_smem} < compiled {metadata.shared}")
    if res and model_regs < res["regs"]:
        failures.append(f"{label}: model regs {model_regs} < compiled {res['regs']}")
    return line


def workloads(quick: bool):
    """Calls of the bench shapes (bf16, Hq 32 / Hkv 8, D 128, block 16) plus the other head dims."""
    def attention_call(seqs, head_dim=128, q_heads=32, kv_heads=8, dtype=torch.bfloat16, window=0, softcap=0.0,
                       layout="block-major"):
        lens = [c + n for c, n in seqs]
        blocks = max(-(-n // 16) for n in lens)
        q = torch.empty((sum(n for _, n in seqs), q_heads, head_dim), dtype=dtype)
        table = torch.zeros((len(seqs), blocks), dtype=torch.int32)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        args = (table, cu, torch.tensor(lens, dtype=torch.int32), 0.1, torch.empty_like(q), window, softcap)
        if layout == "block-major":
            tk.paged_attention(q, torch.empty((4, 1, 2, kv_heads, 16, head_dim), dtype=dtype), 0, *args)
        elif layout == "vllm":      # kv[0], kv[1] of [2, num_blocks, block_size, H, D]
            kv = torch.empty((2, 4, 16, kv_heads, head_dim), dtype=dtype)
            tk.paged_attention_kv(q, kv[0], kv[1], *args)
        else:                       # FlashInfer HND: kv[:, 0].transpose(1, 2) of [num_blocks, 2, H, bs, D]
            kv = torch.empty((4, 2, kv_heads, 16, head_dim), dtype=dtype)
            tk.paged_attention_kv(q, kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2), *args)

    calls = [("prefill 2048 on 32K", lambda: attention_call([(32768, 2048)])),
             *[(f"prefill 2048 on 32K tile {spec}",
                lambda s=spec: with_prefill_tile(s, attention_call, [(32768, 2048)])) for spec in PREFILL_TILES],
             ("decode 64 x 8K", lambda: attention_call([(8191, 1)] * 64)),
             ("decode 1 x 128K (split)", lambda: attention_call([(131071, 1)])),
             ("chunk 256 on 32K (split)", lambda: attention_call([(32768, 256)])),
             ("mixed 64 decodes + chunk", lambda: attention_call([(8191, 1)] * 64 + [(16384, 2048)])),
             ("decode 64 x 8K vLLM layout", lambda: attention_call([(8191, 1)] * 64, layout="vllm"))]
    if not quick:
        for head_dim in (64, 80, 96, 256):
            calls.append((f"mixed D{head_dim}", lambda d=head_dim: attention_call([(100, 1), (50, 300)], head_dim=d)))
        calls.append(("mixed fp16 window softcap", lambda: attention_call([(100, 1), (50, 300)], dtype=torch.float16,
                                                                           window=64, softcap=30.0)))
        calls.append(("mixed fp32", lambda: attention_call([(100, 1), (50, 300)], dtype=torch.float32)))
        calls.append(("mixed fp32 D256", lambda: attention_call([(100, 1), (50, 300)], head_dim=256,
                                                                 dtype=torch.float32)))
        calls.append(("prefill FlashInfer HND", lambda: attention_call([(4096, 2048)], layout="hnd")))
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


def with_prefill_tile(spec, attention_call, seqs):
    with launch.forced_tiles(prefill=spec):
        attention_call(seqs)


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


def report(quick: bool) -> int:
    print(f"triton {triton.__version__}, target sm_90")
    seen, failures, compile_failures = set(), [], 0
    for name, call in workloads(quick):
        for kernel, kargs, kwargs in capture_launches(call):
            signature, constexprs, attrs, options = specialise(kernel, kargs, dict(kwargs))
            key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), tuple(sorted(options.items())),
                   tuple(sorted(signature.items())))
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
                compile_failures += 1
                failures.append(f"{name}: {kernel.fn.__name__} does not compile")
                print(f"FAIL {label}\n     {type(e).__name__}: {str(e)[-1500:]}")
                continue
            ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
            res = resources(compiled.asm["cubin"])
            extra = ""
            if kernel is attention.paged_attention_kernel:
                extra = "\n     " + attention_problems(pipelining(ttgir, ptx, constexprs), constexprs, options,
                                                        signature, compiled.metadata, res, failures, name)
                if ttgir.count("warp_group_dot "):
                    under, total = sass_ex2_under_hgmma(sass(compiled.asm["cubin"]))
                    extra += f"; SASS: MUFU.EX2 between an HGMMA and its wait {under}/{total}"
                    if constexprs.get("OVERLAP") and total and not under:
                        failures.append(f"{name}: OVERLAP variant whose SASS waits for every HGMMA before an exp2")
            if kernel is pack.pack_kernel and constexprs["QUANT"]:
                divisions = sorted(set(re.findall(r"\bdiv\.[a-z.]*f32", ptx)))
                extra = f"\n     fp32 divisions {divisions}"
                if not constexprs["SOFT_FP8"] and divisions != ["div.rn.f32"]:
                    failures.append(f"{name}: fp8 pack divides with {divisions}, not only div.rn.f32")
            regs = f"regs {res['regs']} stack {res['stack']} local {res['local']}" if res else "regs ?"
            print(f"ok   {label} {options}\n     smem {compiled.metadata.shared} B, {regs}, "
                  f"wgmma {ttgir.count('warp_group_dot ')}, async copies {ttgir.count('async_copy_global_to_local')}, "
                  f"ld/st.v4 {ptx.count('.v4.')}, {time.time() - start:.1f} s{extra}", flush=True)
    for failure in failures:
        print(f"ASSERTION {failure}")
    print(f"triton {triton.__version__}: {len(seen)} variants, {compile_failures} failed to compile, "
          f"{len(failures) - compile_failures} assertion(s) failed")
    return 1 if failures else 0


def run_with_triton_36(args) -> int:
    """This script again under Triton 3.6.0 (installed into .venv/triton-3.6 on first use)."""
    if not os.path.exists(os.path.join(TRITON_36, "triton", "__init__.py")):
        print(f"installing triton==3.6.0 into {TRITON_36} (first use)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TRITON_36,
                        "triton==3.6.0"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (TRITON_36, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, os.path.abspath(__file__), "--triton", "current"] + (["--quick"] if args.quick else [])
    return subprocess.run(command, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the main bench shapes + copies")
    parser.add_argument("--triton", choices=("current", "3.6", "both"), default="current",
                        help="which Triton compiles (see above)")
    args = parser.parse_args()
    rc = 0
    if args.triton in ("current", "both"):
        rc |= report(args.quick)
    if args.triton in ("3.6", "both"):
        sys.stdout.flush()
        rc |= run_with_triton_36(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
