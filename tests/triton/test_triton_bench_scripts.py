"""The GPU-run scripts of bench/ work before a GPU run spends device time on them.

- bench/device_check.sh --dry-run runs bench/device_check.py on the CPU with tiny shapes through every
  section (plan, pre-compilation, correctness checks, ceilings, tile sweep, goal shapes with their verdict
  lines, short chunks, copies, layer slice, mixed batch) and streams its rows and verdicts into $OUT, under
  Triton 3.9 and under Triton 3.6 (the GPU machine's);
- bench/sm90_compile_report.py --quick --triton both compiles the main kernel variants for sm_90
  (H100/H200) without a GPU under Triton 3.9 and 3.6 (the GPU machine's; installed into .venv/triton-3.6
  on first use) and asserts the pipelining (two K/V buffers, partial waits), the occupancy model and the
  exact fp8 division: regressions that the interpreter cannot see fail here.
Both run in subprocesses (each needs its own TRITON_INTERPRET setting).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, env_overrides, timeout):
    env = dict(os.environ, **env_overrides)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


TRITON_36 = os.path.join(ROOT, ".venv", "triton-3.6")


def triton_36_path():
    """Triton 3.6.0 (the GPU machine's), installed where bench/sm90_compile_report.py puts it."""
    if not os.path.exists(os.path.join(TRITON_36, "triton", "__init__.py")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TRITON_36,
                        "triton==3.6.0"], check=True)
    return TRITON_36


@pytest.mark.parametrize("triton_version", ["current", "3.6"])
def test_device_check_dry_run(tmp_path, triton_version):
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path), "PYTHON": sys.executable}
    if triton_version == "3.6":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_36_path(), os.environ.get("PYTHONPATH")) if p)
    result = run(["bash", "bench/device_check.sh", "--dry-run"], env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all checks passed" in result.stdout
    version = "3.6.0" if triton_version == "3.6" else ""
    assert f'"triton": "{version}' in result.stdout
    # the plan comes first, within 6 minutes of device time
    plan = result.stdout.split("== plan (planned device seconds per step) ==")[1]
    total = int(plan.split("total")[1].split()[0])
    assert total <= 360 and result.stdout.index("== plan") < result.stdout.index("## correctness")
    table = (tmp_path / "device_check.md").read_text()
    # the prefill tile sweep is the first timing section; pre-compilation comes before any of them
    assert table.index("| precompile |") < table.index("| check |") < table.index("| tile sweep |") < table.index(
        "| prefill |")
    for section in ("| check |", "| ceiling |", "| prefill |", "| decode |", "| pack/unpack |", "| copy_blocks |",
                    "| short chunk |", "| copy runs |", "| mixed |", "| tile sweep |", "| layer slice |"):
        assert section in table, f"{section} missing from the dry-run table"
    assert "error" not in table and "FAIL" not in table
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == table.count("\n| ") - table.count("| section |") and all("time" in r for r in rows)
    verdicts = (tmp_path / "verdicts.txt").read_text()
    for goal in ("correctness", "prefill >= 450 TFLOP/s", "(ctx >= 8K)", "short chunks", "decode >= 80%",
                 "decode >= 60%", "spill / reload", "layer slice", "pack / unpack", "CUDA copy extension"):
        assert goal in verdicts
    assert "VERDICT PASS       correctness" in verdicts and "DRY-RUN    prefill" in verdicts
    assert (tmp_path / "device_check.json").exists() and (tmp_path / "device_check.log").exists()


def test_device_check_shell_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "device_check.sh")]).returncode == 0


@pytest.mark.skipif(sys.platform != "linux", reason="Triton ships ptxas for Linux only")
def test_kernels_compile_for_sm90_with_pipelined_kv_loads():
    result = run([sys.executable, "bench/sm90_compile_report.py", "--quick", "--triton", "both"],
                 {"TRITON_INTERPRET": "0"}, timeout=900)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-3000:]
    for version in ("3.9", "3.6"):
        assert f"triton {version}." in out and "0 failed to compile, 0 assertion(s) failed" in out
    assert out.count("K/V buffers [2, 2") >= 2 and out.count("K/V buffers [3, 3") >= 2  # decode / prefill
    assert "fp32 divisions ['div.rn.f32']" in out
    # the overlapped prefill loop: every exp2 of its main loop runs while a wgmma group is in flight, in both
    # versions; the previous loop (128x64w8s3) none
    assert out.count("exp2 under wgmma in flight per wgmma loop ['34/34'") >= 2
    assert out.count("exp2 under wgmma in flight per wgmma loop ['0/34'") >= 2
    assert out.count("SASS: MUFU.EX2 between an HGMMA and its wait 0/68") >= 2  # the previous loop: none
