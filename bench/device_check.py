"""GPU check of the kernels: correctness first, then speed against measured ceilings, in-run peers and goals.

    python3 bench/device_check.py [--dry-run] [--plan] [--out DIR] [--budget-s SECONDS]

Order (bench/device_check.sh runs preflight and build before, the GPU pytest selection after; the planned
seconds of every section are printed up front, PLAN below, 6 minutes in all):
  1. pre-compilation of every kernel variant the run launches, in parallel on the CPU cores
     (devcheck_precompile.py), so no timed section compiles;
  2. correctness: attention in bf16 / fp16 / fp32 against the float64 reference (block-major, vLLM and
     FlashInfer HND layouts, split and window cases, int64 offsets), write_kv / write_kv_cache, pack /
     unpack exact, fp8 payload and scales against the CPU reference (exact division), copy_blocks GPU <->
     pinned host exact on each path (whole pages and a layer range);
  3. the prefill tile sweep, the first timing rows: the overlapped main loop (default) against the previous
     loop and the two-CTA tiles, on a 2,048- and a 256-token chunk at 32K;
  4. ceilings: device-to-device copy (read + write), bf16 matmul, contiguous pinned H2D / D2H;
  5. prefill: a 2,048-token chunk on 0 / 8K / 32K / 64K of context (bf16, D 128, Hq 32 / Hkv 8, block 16)
     against torch SDPA's flash and cuDNN backends, each reported on its own;
  6. short chunks (128 / 256 / 512 tokens) on 16K / 32K / 64K of context: the shadow-prefill case;
  7. decode: batch 64 x 8K, 256 x 8K, 64 x 32K, 1 x 128K (GB/s of KV read vs the copy ceiling);
  8. pack / unpack (raw, fp8); copy_blocks spill / reload of 256 scattered pages vs one contiguous pinned
     copy and the layer-wise reload under compute; one layer slice of the scattered pages (the gather
     kernel) vs a contiguous pinned copy of the same bytes; copy_blocks over 1 / 17 / 64 / 256 runs;
  9. while time remains: the other decode shapes, the mixed batch, the decode tile sweep.
A VERDICT line per goal is printed (and appended to DIR/verdicts.txt) as soon as its section is done:
prefill >= 450 TFLOP/s and >= 1.1x the best SDPA backend over contexts >= 8K; short chunks on >= 16K
>= 1.0x the best SDPA backend; decode >= 80% of the copy ceiling at batch >= 64 x >= 8K and >= 60% at
1 x 128K; scattered-page spill / reload >= 90% of a contiguous pinned copy; a layer slice >= 50% of a
contiguous pinned copy; pack / unpack >= 80% of the copy ceiling. Each row is appended to DIR/rows.jsonl
and DIR/device_check.md (flushed) the moment it is measured. Timings are medians of CUDA-graph replays over
inputs rotated to exceed 4x L2. --dry-run runs every section on the CPU (Triton interpreter; the
pre-compilation compiles a few variants for sm_90 ahead of time) with tiny shapes: it tests this script,
its numbers mean nothing. --plan prints the plan and exits.
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
import devcheck_precompile as precompile  # noqa: E402
import devcheck_shapes as shapes  # noqa: E402
import devcheck_timing as timing  # noqa: E402

GOALS = {"prefill_tflops": 450.0, "prefill_vs_sdpa": 1.1, "short_vs_sdpa": 1.0, "decode_large": 0.8,
         "decode_long": 0.6, "spill_reload": 0.9, "layer_slice": 0.5, "pack_unpack": 0.8}
LONG_CONTEXT = 8192  # the prefill verdict's contexts (a chunk on little context is its own case)

# (step, planned device seconds): device_check.sh's steps and this script's sections, in run order. The
# timed sections stop starting new shapes past their planned time (x 1.3); "while time remains" sections
# get no planned time. Total 360 s = 6 minutes.
PLAN = [("preflight (device_check.sh)", 15), ("build, CUDA for sm_90 only (device_check.sh)", 75),
        ("pre-compile kernel variants", 45), ("correctness", 35), ("prefill tile sweep", 30), ("ceilings", 10),
        ("prefill", 30), ("short chunks on long contexts", 30), ("decode (goal shapes)", 20),
        ("pack / unpack", 8), ("copy_blocks spill / reload", 12), ("layer slice reload", 6),
        ("copy_blocks runs x page sizes x paths", 14), ("decode (other shapes)", 0), ("mixed batch", 0),
        ("decode tile sweep", 0), ("GPU pytest selection, in the time left (device_check.sh)", 30)]
PLANNED = dict(PLAN)


def print_plan() -> None:
    print("== plan (planned device seconds per step) ==")
    for step, seconds in PLAN:
        print(f"  {step:<60} {seconds:>4} s" if seconds else f"  {step:<60} while time remains")
    print(f"  {'total':<60} {sum(s for _, s in PLAN):>4} s", flush=True)


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
    """Over contexts >= 8K (a chunk on little context is bounded by its causal diagonal); each peer apart."""
    goal = f"prefill >= {GOALS['prefill_tflops']:.0f} TFLOP/s and >= {GOALS['prefill_vs_sdpa']}x best SDPA (ctx >= 8K)"
    long_ctx = 64 if dry else LONG_CONTEXT
    rates = {k: v for k, v in results.get("prefill_rate", {}).items() if k[0] >= long_ctx}
    if not rates:
        return table.verdict(goal, None, "no prefill shape with context >= 8K was timed")
    detail = f"TFLOP/s by context {_fmt_worst({c: r for (c, _), r in rates.items()}, lambda r: f'{r / 1e12:.0f}')}"
    detail += "; " + _peer_detail(results.get("prefill_peers", {}), rates)
    peers = {k: v for k, v in results.get("prefill_vs_peer", {}).items() if k in rates}
    if not peers:
        return table.verdict(goal, None, detail + " (no peer ran)")
    ok = min(rates.values()) / 1e12 >= GOALS["prefill_tflops"] and min(peers.values()) >= GOALS["prefill_vs_sdpa"]
    return table.verdict(goal, ok, detail)


def _peer_detail(peers: dict, shapes) -> str:
    """'ours / flash 1.05x, ours / cudnn 0.97x at ctx ...' for each timed shape, each peer on its own."""
    parts = []
    for shape in shapes:
        for name, ratio in peers.get(shape, {}).items():
            parts.append(f"vs {name} {ratio:.2f}x at {shape[1]} on {shape[0]}")
    return ", ".join(parts) or "no peer timed"


def verdict_short(table, results, dry):
    goal = f"short chunks (128-512 on >= 16K) >= {GOALS['short_vs_sdpa']}x best SDPA"
    peers = results.get("short_vs_peer", {})
    rates = results.get("short_rate", {})
    if not rates:
        return table.verdict(goal, None, "not timed")
    detail = (f"TFLOP/s {_fmt_worst({f'{n} on {c}': r for (c, n), r in rates.items()}, lambda r: f'{r / 1e12:.0f}')}; "
              + _peer_detail(results.get("short_peers", {}), rates))
    if not peers:
        return table.verdict(goal, None, detail + " (no peer ran)")
    return table.verdict(goal, min(peers.values()) >= GOALS["short_vs_sdpa"], detail)


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


def verdict_spill(table, results):
    goal = "scattered spill / reload >= 90% of a contiguous pinned copy"
    spill = results.get("spill", {})
    if not spill:
        return table.verdict(goal, None, "not timed (needs CUDA)")
    table.verdict(goal, min(spill.values()) >= GOALS["spill_reload"],
                  _fmt_worst(spill, lambda v: f"{100 * v:.0f}%") + " (256 random 2 MiB pages)")


def verdict_layer_slice(table, results):
    goal = "one layer slice of 256 scattered pages >= 50% of a contiguous pinned copy"
    if "layer_slice" not in results:
        return table.verdict(goal, None, "not timed")
    table.verdict(goal, results["layer_slice"] >= GOALS["layer_slice"], f"{100 * results['layer_slice']:.0f}%")


def verdict_pack(table, results):
    pack = results.get("pack", {})
    if not pack:
        return table.verdict("pack / unpack >= 80% of a device copy", None, "not timed")
    table.verdict("pack / unpack >= 80% of a device copy", min(pack.values()) >= GOALS["pack_unpack"],
                  _fmt_worst(pack, lambda v: f"{100 * v:.0f}%"))


def run_precompile(table, device, dry) -> None:
    """devcheck_precompile: every variant compiled in parallel before timing. Never fails the run: a variant
    that does not compile fails the correctness section, and one not compiled in time compiles in the
    untimed warm-up call of its first timing."""
    workers = 2 if dry else max(1, min(16, (os.cpu_count() or 2) - 1))
    tiles = shapes.DRY_SWEEP_PREFILL if dry else shapes.SWEEP_PREFILL
    got = precompile.precompile("sm90" if dry else "gpu", workers, quick=dry, sweep_tiles=() if dry else tiles,
                                timeout_s=PLANNED["pre-compile kernel variants"], limit=3 if dry else 0)
    note = (f"{workers} processes, {got['failed_workers']} with a variant that failed to compile, "
            f"{got['timed_out_workers']} stopped at the planned time"
            + (" (sm_90 ahead of time, 3 variants)" if dry else ""))
    table.add("precompile", "parallel compile", got["seconds"], "s", note=note)
    if not dry and not got["timed_out_workers"]:  # this process's JIT: disk-cache hits if the keys matched
        count, seconds = precompile.warm_up_here(False, tiles)
        table.add("precompile", f"warm-up of {count} variants in this process", seconds, "s",
                  note="all compiled before timing")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (tests the script)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for device_check.md, rows.jsonl, ...")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip timed shapes after this many seconds")
    parser.add_argument("--plan", action="store_true", help="print the plan (planned seconds per step) and exit")
    args = parser.parse_args()
    print_plan()
    if args.plan:
        return 0
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

    table.note(f"## pre-compile ({time.time() - start:.0f} s)")
    try:
        run_precompile(table, device, args.dry_run)
    except Exception as e:  # noqa: BLE001 - the run compiles on first use instead
        table.add("precompile", "not run", None, "", note=f"{type(e).__name__}: {e}"[:200])

    table.note(f"## correctness ({time.time() - start:.0f} s)")
    correctness.check_attention(table, device, args.dry_run)
    correctness.check_copies(table, device, args.dry_run)
    correctness.check_copy_blocks(table, device, args.dry_run)
    bad = [r.case for r in table.rows if r.section == "check" and "FAIL" in r.note]
    table.verdict("correctness (kernels vs float64 / exact references)", not bad,
                  f"{len(bad)} failed: {bad}" if bad else f"{sum(r.section == 'check' for r in table.rows)} checks ok",
                  speed=False)
    failures += bad

    results, ceilings = {}, {}
    sections = [
        ("prefill tile sweep", shapes.prefill_tile_sweep, None),
        ("ceilings", lambda t, d, c, dry, *rest: ceilings.update(shapes.ceilings(t, d, dry)), None),
        ("prefill", shapes.prefill, lambda: verdict_prefill(table, results, args.dry_run)),
        ("short chunks on long contexts", shapes.short_chunks, lambda: verdict_short(table, results, args.dry_run)),
        ("decode (goal shapes)", lambda *a: shapes.decode(*a, which="goal"),
         lambda: verdict_decode(table, results, args.dry_run)),
        ("pack / unpack", copies.pack_unpack, lambda: verdict_pack(table, results)),
        ("copy_blocks spill / reload", copies.copy_blocks, lambda: verdict_spill(table, results)),
        ("layer slice reload", copies.layer_slice_reload, lambda: verdict_layer_slice(table, results)),
        ("copy_blocks runs x page sizes x paths", copies.copy_runs, None),
        ("decode (other shapes)", lambda *a: shapes.decode(*a, which="rest"), None),
        ("mixed batch", shapes.mixed, None),
        ("decode tile sweep", shapes.decode_tile_sweep, None),
    ]
    for name, section, verdict in sections:
        table.note(f"## {name} ({time.time() - start:.0f} s)")
        planned = PLANNED[name]
        section_deadline = min(deadline, time.time() + 1.3 * planned) if planned and not args.dry_run else deadline
        if time.time() > deadline:
            table.add(name, "all", None, "", note=f"skipped: time budget {args.budget_s:.0f} s spent")
        else:
            try:
                section(table, device, ceilings, args.dry_run, section_deadline, results)
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
