#!/usr/bin/env bash
# One-shot GPU check of shadowprefill's kernels, for an H100/H200 machine with no internet (its own python3,
# torch and triton). Planned 6 minutes (bench/device_check.py --plan prints the plan per step); the script
# re-runs itself under `timeout`, and every step has its own cap inside that.
#   1. preflight: GPU, driver, torch / triton versions, Python.h, pybind11, CMake, nvcc: one verdict line each;
#   2. build: pip install -e . (no build isolation, no deps) with SHADOWPREFILL_CUDA=1 where nvcc exists, CUDA
#      code for the GPU's own architecture only (CUDAARCHS=90 on Hopper); a missing _C_cuda is a loud FAIL;
#   3. bench/device_check.py: pre-compile every kernel variant in parallel, correctness against float64 /
#      CPU references, ceilings, then the timed goal shapes (prefill tile sweep first) with a VERDICT each;
#   4. the GPU pytest selection last, in the time left, each test capped (pytest-timeout).
# Results in $OUT (default ./out): build.log, pytest.log, device_check.md, rows.jsonl, verdicts.txt,
# device_check.json (written last), device_check.log (all output).
#   bash bench/device_check.sh            # on the GPU machine
#   bash bench/device_check.sh --dry-run  # anywhere: no build, no GPU tests, tiny CPU shapes (tests the script)
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL_S=${DEVICE_CHECK_TIMEOUT_S:-360}
if [[ -z "${DEVICE_CHECK_UNDER_TIMEOUT:-}" ]]; then
    export DEVICE_CHECK_UNDER_TIMEOUT=1
    exec timeout -k 10 "$TOTAL_S" bash "$0" "$@"
fi
PY=${PYTHON:-python3}  # the machine's own python3 (the one with CUDA torch); PYTHON=... to override
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

if [[ "${1:-}" == "--dry-run" ]]; then
    [[ -z "${PYTHON:-}" && -x .venv/bin/python ]] && PY=.venv/bin/python  # the project's venv, where one exists
    "$PY" bench/device_check.py --dry-run --out "$OUT" --budget-s "${BUDGET_S:-120}" 2>&1 | tee "$OUT/device_check.log"
    exit "${PIPESTATUS[0]}"
fi

"$PY" bench/device_check.py --plan
echo "== preflight =="
pre_ok=1
verdict() { printf '%-10s %-12s %s\n' "PREFLIGHT" "$1" "$2"; [[ "$1" == OK ]] || pre_ok=0; }
if gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>&1); then
    verdict OK "GPU and driver: $gpu"
else
    verdict FAIL "nvidia-smi: $gpu"
fi
if v=$("$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1); then
    verdict OK "$v"
else
    verdict FAIL "torch / triton: ${v##*$'\n'}"
fi
if h=$("$PY" -c "import os, sysconfig; p = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); assert os.path.exists(p), p + ' missing'; print(p)" 2>&1); then
    verdict OK "Python.h: $h"
else
    verdict FAIL "Python.h: ${h##*$'\n'}"
fi
if p=$("$PY" -c "import pybind11; print(pybind11.__version__, pybind11.get_cmake_dir())" 2>&1); then
    verdict OK "pybind11 $p"
else
    verdict FAIL "pybind11: ${p##*$'\n'}"
fi
if c=$(cmake --version 2>&1 | head -n 1); then verdict OK "$c"; else verdict FAIL "cmake: $c"; fi
if command -v nvcc >/dev/null 2>&1; then
    verdict OK "nvcc: $(command -v nvcc) ($(nvcc --version | tail -n 1))"
else
    verdict WARN "nvcc not found: building without shadowprefill._C_cuda (copy_blocks on CUDA will not work)"
fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_flag="--timeout=${PYTEST_PER_TEST_S:-20}"; verdict OK "pytest-timeout: per-test cap ${PYTEST_PER_TEST_S:-20} s"
else
    timeout_flag=""; verdict WARN "pytest-timeout missing: the GPU pytest step is capped as a whole only"
fi

echo "== build ($(elapsed) s) =="
build_rc=0
if command -v nvcc >/dev/null 2>&1; then
    export SHADOWPREFILL_CUDA=1  # nvcc is here: the CUDA module must be built, or the build fails
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
    [[ -n "$cap" ]] && export CUDAARCHS="$cap"  # this GPU's architecture only (90 on H100 / H200)
    echo "building with SHADOWPREFILL_CUDA=1, CUDAARCHS=${CUDAARCHS:-default (80;90)}"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
timeout 150 "$PY" -m pip install -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1 || build_rc=$?
if (( build_rc != 0 )); then
    echo "BUILD FAILED (rc $build_rc); tail of $OUT/build.log:"
    tail -n 30 "$OUT/build.log"
fi
grep -m 2 "building shadowprefill._C_cuda for" "$OUT/build.log" || true
if "$PY" -c "import shadowprefill._C_cuda as m; print('shadowprefill._C_cuda built:', m.__file__, 'devices', m.device_count())"; then
    cuda_ok=1
else
    cuda_ok=0
    command -v nvcc >/dev/null 2>&1 && echo "FAIL: nvcc exists but shadowprefill._C_cuda is missing (see $OUT/build.log)"
fi
if ! "$PY" -c "import shadowprefill.triton_kernels" 2>/dev/null; then
    # shadowprefill.triton_kernels lives in triton_kernels/ (setup.py's package_dir): mirror that layout
    rm -rf /tmp/shadowprefill_src && mkdir -p /tmp/shadowprefill_src
    cp -r shadowprefill /tmp/shadowprefill_src/ && cp -r triton_kernels /tmp/shadowprefill_src/shadowprefill/
    export PYTHONPATH=/tmp/shadowprefill_src${PYTHONPATH:+:$PYTHONPATH}
    echo "using PYTHONPATH=$PYTHONPATH (no compiled extensions: copy_blocks will fail)"
fi

PYTEST_RESERVE_S=${PYTEST_RESERVE_S:-30}
echo "== device_check.py ($(elapsed) s) =="
budget=$(( TOTAL_S - $(elapsed) - PYTEST_RESERVE_S - 15 ))
(( budget < 60 )) && budget=60
"$PY" bench/device_check.py --out "$OUT" --budget-s "$budget" 2>&1 | tee "$OUT/device_check.log"
check_rc=${PIPESTATUS[0]}

left=$(( TOTAL_S - $(elapsed) - 10 ))
echo "== GPU pytest selection, last ($(elapsed) s; ${left} s left) =="
rc=0
if (( left >= 15 )); then
    timeout "$left" "$PY" -m pytest -q --maxfail=5 -p no:cacheprovider $timeout_flag tests/triton tests/ops \
        -k "(triton or cuda) and not bench_scripts" >"$OUT/pytest.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/pytest.log"
    (( rc == 124 )) && echo "pytest stopped by the time left (${left} s): a partial run, not a failure" && rc=0
    echo "pytest exit code $rc"
else
    echo "pytest skipped: ${left} s left"
fi
echo "device_check.sh done in $(elapsed) s (preflight ok $pre_ok, build rc $build_rc, _C_cuda $cuda_ok, device_check rc $check_rc, pytest rc $rc)"
exit $(( build_rc != 0 || cuda_ok == 0 || check_rc != 0 || rc != 0 ))
