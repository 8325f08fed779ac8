"""GPU check of the kernels: correctness, then speed against measured ceilings, in-run peers and the goals.

    python3 bench/device_check.py [--dry-run] [--out DIR] [--budget-s SECONDS]

Order (most important first, so a run cut short by its budget still answers the main questions):
  1. the CUDA build (shadowprefill._C_cuda present where nvcc is) and correctness: attention in bf16 / fp16
     / fp32 against the float64 reference (block-major, vLLM and FlashInfer HND layouts, split and window
     cases), write_kv / write_kv_cache, pack / unpack exact, fp8 bits and scales against torch;
  2. ceilings: device-to-device copy (read + write), bf16 matmul, contiguous pinned H2D / D2H;
  3. prefill: a 2,048-token chunk on 0 / 8K / 32K / 64K of context (bf16, D 128, Hq 32 / Hkv 8, block 16),
     causal TFLOP/s, against torch SDPA's flash and cuDNN backends on the same problem;
  4. decode: batch 64 x 8K, 256 x 8K, 64 x 32K, 1 x 128K (GB/s of KV read vs the copy ceiling);
  5. pack / unpack (raw, fp8) of 256 Llama-3-8B pages vs the copy ceiling; copy_blocks spill / reload of
     256 scattered pages vs one contiguous pinned copy; their layer-wise reload under a per-layer matmul
     (overlapped vs copy + compute and the latency model's pipeline);
  6. short chunks (128 / 256 / 512 tokens) on 16K / 32K / 64K of context: the shadow-prefill case;
  7. copy_blocks over 1 / 17 / 64 / 256 runs of 16 KiB and 2 MiB pages on each path (auto / memcpy / kernel);
  8. the other decode shapes, the mixed batch, and a tile sweep while time remains.
A verdict line per goal is printed (and appended to DIR/verdicts.txt) as soon as its section is done:
prefill >= 450 TFLOP/s and >= 1.1x the best SDPA backend; decode >= 80% of the copy ceiling at batch
>= 64 x >= 8K and >= 60% at 1 x 128K; scattered-page spill / reload >= 90% of a contiguous pinned copy;
pack / unpack >= 80% of the copy ceiling. Each row is appended to DIR/rows.jsonl and DIR/device_check.md
(flushed) the moment it is measured. Timings are medians of CUDA-graph replays over inputs rotated to
exceed 4x L2. --dry-run runs every section on the CPU (Triton interpreter) with tiny shapes: it tests this
script, its numbers mean nothing.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

if "--dry-run" in sys.argv:  # before the kernels are imported: run them under the interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import devcheck_copies as copies  # noqa: E402
import devcheck_correctness as correctness  # noqa: E402
import devcheck_shapes as shapes  # noqa: E402
import devcheck_timing as timing  # noqa: E402

GOALS = {"prefill_tflops": 450.0, "prefill_vs_sdpa": 1.1, "decode_large": 0.8, "decode_long": 0.6,
         "spill_reload": 0.9, "pack_unpack": 0.8}


def environment(device: torch.device) -> dict:
    import triton
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": "cpu (dry run)", "nvcc": shutil.which("nvcc") or "not found"}
    try:
        import shadowprefill._C_cuda  # noqa: F401
        env["_C_cuda"] = "built"
    except ImportError as e:
        env["_C_cuda"] = f"MISSING ({e})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30),
                   l2_mib=round(timing.l2_bytes(device) / 2**20), cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "nvidia-smi not available"
    return env


def _fmt_worst(values: dict, fmt) -> str:
    return ", ".join(f"{k}: {fmt(v)}" for k, v in values.items())


def verdict_prefill(table, results, dry):
    rates = {k: v for k, v in results.get("prefill_rate", {}).items() if k[1] >= (32 if dry else 2048)}
    peers = {k: v for k, v in results.get("prefill_vs_peer", {}).items() if k in rates}
    if not rates:
        return table.verdict("prefill >= 450 TFLOP/s and >= 1.1x best SDPA", None, "no prefill shape was timed")
    worst_rate = min(rates.values()) / 1e12
    detail = (f"TFLOP/s by context {_fmt_worst({c: r for (c, _), r in rates.items()}, lambda r: f'{r / 1e12:.0f}')}; "
              f"vs best SDPA {_fmt_worst({c: v for (c, _), v in peers.items()}, lambda v: f'{v:.2f}x')}")
    if not peers:
        return table.verdict("prefill >= 450 TFLOP/s and >= 1.1x best SDPA", None, detail + " (no peer ran)")
    ok = worst_rate >= GOALS["prefill_tflops"] and min(peers.values()) >= GOALS["prefill_vs_sdpa"]
    return table.verdict("prefill >= 450 TFLOP/s and >= 1.1x best SDPA", ok, detail)


def verdict_decode(table, results, dry):
    decode = results.get("decode", {})
    large = {k: v for k, v in decode.items() if k[0] >= (64 if not dry else 2) and k[1] >= (8192 if not dry else 64)}
    long = {k: v for k, v in decode.items() if k[0] == 1 and k[1] >= (131072 if not dry else 1024)}
    for goal, shapes_, need in (("decode >= 80% of copy at batch >= 64 x >= 8K", large, GOALS["decode_large"]),
                                ("decode >= 60% of copy at 1 x 128K", long, GOALS["decode_long"])):
        if not shapes_:
            table.verdict(goal, None, "not timed")
            continue
        table.verdict(goal, min(shapes_.values()) >= need,
                      _fmt_worst({f"{b}x{c}": v for (b, c), v in shapes_.items()}, lambda v: f"{100 * v:.0f}%"))


def verdict_copies(table, results):
    spill = results.get("spill", {})
    if spill:
        table.verdict("scattered spill / reload >= 90% of a contiguous pinned copy",
                      min(spill.values()) >= GOALS["spill_reload"],
                      _fmt_worst(spill, lambda v: f"{100 * v:.0f}%") + " (256 random 2 MiB pages)")
    else:
        table.verdict("scattered spill / reload >= 90% of a contiguous pinned copy", None, "not timed (needs CUDA)")
    pack = results.get("pack", {})
    if pack:
        table.verdict("pack / unpack >= 80% of a device copy", min(pack.values()) >= GOALS["pack_unpack"],
                      _fmt_worst(pack, lambda v: f"{100 * v:.0f}%"))
    else:
        table.verdict("pack / unpack >= 80% of a device copy", None, "not timed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (tests the script)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for device_check.md, rows.jsonl, ...")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip timed shapes after this many seconds")
    args = parser.parse_args()
    start = time.time()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the script on the CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        timing.CPU_MIN_REPS = 1
    torch.manual_seed(0)
    table = timing.Table(out=args.out, dry=args.dry_run)
    env = environment(device)
    table.note(f"device_check ({'DRY RUN on CPU: numbers mean nothing' if args.dry_run else 'GPU'}): "
               f"`{json.dumps(env)}`")
    deadline = start + args.budget_s
    failures = []

    build_ok = env["_C_cuda"] == "built" or env["nvcc"] == "not found"
    table.verdict("CUDA copy extension built where nvcc exists", build_ok,
                  f"_C_cuda {env['_C_cuda']}, nvcc {env['nvcc']}", speed=False)
    if not build_ok:
        failures.append("build")

    table.note("## correctness")
    correctness.check_attention(table, device, args.dry_run)
    correctness.check_copies(table, device, args.dry_run)
    bad = [r.case for r in table.rows if "FAIL" in r.note]
    table.verdict("correctness (kernels vs float64 / exact references)", not bad,
                  f"{len(bad)} failed: {bad}" if bad else f"{len(table.rows)} checks ok", speed=False)
    failures += bad

    table.note("## ceilings")
    ceilings = shapes.ceilings(table, device, args.dry_run)
    results = {}
    sections = [
        ("prefill", shapes.prefill, lambda: verdict_prefill(table, results, args.dry_run)),
        ("decode (goal shapes)", lambda *a: shapes.decode(*a, which="goal"),
         lambda: verdict_decode(table, results, args.dry_run)),
        ("pack / unpack", copies.pack_unpack, None),
        ("copy_blocks spill / reload", copies.copy_blocks, lambda: verdict_copies(table, results)),
        ("short chunks on long contexts", shapes.short_chunks, None),
        ("copy_blocks runs x page sizes x paths", copies.copy_runs, None),
        ("decode (other shapes)", lambda *a: shapes.decode(*a, which="rest"), None),
        ("mixed batch", shapes.mixed, None),
        ("tile sweep", shapes.tile_sweep, None),
    ]
    for name, section, verdict in sections:
        table.note(f"## {name} ({time.time() - start:.0f} s)")
        if time.time() > deadline:
            table.add(name, "all", None, "", note=f"skipped: time budget {args.budget_s:.0f} s spent")
        else:
            try:
                section(table, device, ceilings, args.dry_run, deadline, results)
            except Exception as e:  # noqa: BLE001 - report and go on with the other sections
                table.add(name, "error", None, "", note=f"{type(e).__name__}: {e}"[:200])
                failures.append(name)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if verdict:
            verdict()

    elapsed = time.time() - start
    print("\n" + table.render() + "\n")
    print("\n".join(table.verdicts))
    if args.out:
        with open(os.path.join(args.out, "device_check.json"), "w") as f:
            json.dump({"environment": env, "seconds": elapsed, "rows": [r.__dict__ for r in table.rows],
                       "verdicts": table.verdicts}, f, indent=1)
    table.close()
    print(f"device_check.py done in {elapsed:.0f} s: " +
          (f"{len(failures)} failed check(s) or section(s): {failures}" if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
