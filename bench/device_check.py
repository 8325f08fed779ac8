"""GPU check of the Triton kernels: correctness, then speed against measured ceilings and in-run peers.

    python3 bench/device_check.py [--dry-run] [--out DIR] [--budget-s SECONDS]

Order (issue 3, Performance): GPU correctness checks (bf16 included, vs float64); the two ceilings
(device-to-device copy GB/s counting read + write, bf16 matmul TFLOP/s); then, bf16, head_dim 128,
Hq 32 / Hkv 8, block 16:
  - chunked prefill: a 2,048-token chunk on cached contexts 0 / 8K / 32K / 64K, TFLOP/s of causal FLOPs,
    peer: torch's flash attention (aten._scaled_dot_product_flash_attention, is_causal, which for
    seq_q < seq_k is the bottom-right causal mask = the same problem) on the gathered dense K/V expanded to
    32 heads (gather not timed);
  - decode: batch 1 / 8 / 64 / 256 x context 1K / 8K / 32K / 128K, GB/s of KV read (shapes whose KV
    exceeds --max-kv-gib are skipped and listed);
  - mixed batch: 64 decodes at 8K + one 2,048-token chunk at 16K in one call vs the two run separately;
  - pack / unpack (bf16 and fp8) and copy_blocks GPU <-> pinned host, 256 pages of a Llama-3-8B page
    (32 layers x 8 heads x 16 x 128 bf16 = 2 MiB), vs one contiguous copy of the same bytes.
Each timing is the median over CUDA-graph replays of calls rotating over inputs larger than 4x L2.
--dry-run runs every section on the CPU (Triton interpreter) with tiny shapes: it tests this script, its
numbers mean nothing. The table is printed last and written to DIR/device_check.md (DIR: --out or $OUT).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

if "--dry-run" in sys.argv:  # before the kernels are imported: run them under the interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import devcheck_correctness as correctness  # noqa: E402
import devcheck_timing as timing  # noqa: E402
import devcheck_shapes as shapes  # noqa: E402


def environment(device: torch.device) -> dict:
    import triton
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": "cpu (dry run)"}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (tests the script)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for device_check.md/.json")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip timing sections after this")
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="largest decode KV pool to allocate")
    args = parser.parse_args()
    start = time.time()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the script on the CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        timing.CPU_MIN_REPS = 1
    torch.manual_seed(0)
    env = environment(device)
    print("environment:", json.dumps(env))
    table = timing.Table()
    deadline = start + args.budget_s

    print("== correctness ==", flush=True)
    correctness.check_attention(table, device, args.dry_run)
    correctness.check_copies(table, device, args.dry_run)
    failures = [r for r in table.rows if "FAIL" in r.note]

    print("== ceilings ==", flush=True)
    ceilings = shapes.ceilings(table, device, args.dry_run)
    sections = [("prefill", shapes.prefill), ("decode", shapes.decode), ("mixed", shapes.mixed),
                ("pack/unpack", shapes.pack_unpack), ("copy_blocks", shapes.copy_blocks)]
    for name, section in sections:
        print(f"== {name} ==", flush=True)
        if time.time() > deadline:
            table.add(name, "all", None, "", note=f"skipped: time budget {args.budget_s:.0f} s spent")
            continue
        try:
            section(table, device, ceilings, args.dry_run, args.max_kv_gib, deadline)
        except Exception as e:  # noqa: BLE001 - report and go on with the other sections
            table.add(name, "error", None, "", note=f"{type(e).__name__}: {e}"[:200])
            failures.append(table.rows[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()

    elapsed = time.time() - start
    markdown = (f"device_check ({'DRY RUN on CPU: numbers mean nothing' if args.dry_run else 'GPU'}), "
                f"{elapsed:.0f} s\n\n`{json.dumps(env)}`\n\n{table.render()}\n")
    print("\n" + markdown)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "device_check.md"), "w") as f:
            f.write(markdown)
        with open(os.path.join(args.out, "device_check.json"), "w") as f:
            json.dump({"environment": env, "seconds": elapsed, "rows": [r.__dict__ for r in table.rows]}, f,
                      indent=1)
    print(f"{len(failures)} failed check(s)" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
