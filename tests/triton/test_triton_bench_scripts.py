"""The GPU-run scripts of bench/ work before a GPU run spends device time on them.

- bench/device_check.py --dry-run runs every section (correctness checks, ceilings, all timed sections)
  on the CPU with tiny shapes and writes its markdown table;
- bench/sm90_compile_report.py --quick compiles the main kernel variants for sm_90 (H100/H200) without a
  GPU: lowering errors that the interpreter cannot see (e.g. return-type mismatches, shared memory
  overflow) fail here.
Both run in subprocesses (each needs its own TRITON_INTERPRET setting).
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(args, env_overrides, timeout):
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_device_check_dry_run(tmp_path):
    result = run_script(["bench/device_check.py", "--dry-run", "--out", str(tmp_path)],
                        {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all checks passed" in result.stdout
    table = (tmp_path / "device_check.md").read_text()
    for section in ("| check |", "| ceiling |", "| prefill |", "| decode |", "| mixed |", "| pack/unpack |",
                    "| copy_blocks |"):
        assert section in table, f"{section} missing from the dry-run table"
    assert "error" not in table and "FAIL" not in table
    assert (tmp_path / "device_check.json").exists()


def test_device_check_shell_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "device_check.sh")]).returncode == 0


@pytest.mark.skipif(sys.platform != "linux", reason="Triton ships ptxas for Linux only")
def test_kernels_compile_for_sm90():
    result = run_script(["bench/sm90_compile_report.py", "--quick"], {"TRITON_INTERPRET": "0"}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " 0 failed" in result.stdout
