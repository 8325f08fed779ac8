#!/usr/bin/env bash
# One-shot GPU check of shadowprefill's kernels, for an H100/H200 machine with no internet (its own python3,
# torch and triton). Whole run <= 6 minutes: the script re-runs itself under `timeout`, and every step has
# its own cap inside that.
#   1. build: pip install -e . (no build isolation, no deps) with SHADOWPREFILL_CUDA=1 where nvcc exists, so
#      a CMake that misses nvcc fails the build instead of silently leaving out shadowprefill._C_cuda; the
#      result is reported, and a missing _C_cuda where nvcc exists is a loud FAIL (the rest still runs);
#   2. the kernel tests on the GPU (tests/triton, the Triton half of tests/ops, copy tests), capped;
#   3. bench/device_check.py: correctness, ceilings, the goal shapes with a VERDICT line per goal, the
#      short-chunk-on-long-context case, copies over 1/17/64/256 runs, then other shapes and a tile sweep
#      while time remains. Each row goes to $OUT as it is measured (appended and flushed).
# Results in $OUT (default ./out): build.log, pytest.log, device_check.md, rows.jsonl, verdicts.txt,
# device_check.json (written last), device_check.log (all output).
#   bash bench/device_check.sh            # on the GPU machine
#   bash bench/device_check.sh --dry-run  # anywhere: no build, no GPU tests, tiny CPU shapes (tests the script)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${DEVICE_CHECK_UNDER_TIMEOUT:-}" ]]; then
    export DEVICE_CHECK_UNDER_TIMEOUT=1
    exec timeout -k 10 "${DEVICE_CHECK_TIMEOUT_S:-360}" bash "$0" "$@"
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

echo "== machine =="
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

echo "== build ($(elapsed) s) =="
build_rc=0
if command -v nvcc >/dev/null 2>&1; then
    export SHADOWPREFILL_CUDA=1  # nvcc is here: the CUDA module must be built, or the build fails
    echo "nvcc: $(command -v nvcc) ($(nvcc --version | tail -n 1)); building with SHADOWPREFILL_CUDA=1"
else
    echo "nvcc not found: building without shadowprefill._C_cuda (copy_blocks on CUDA will not work)"
fi
timeout 150 "$PY" -m pip install -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1 || build_rc=$?
if (( build_rc != 0 )); then
    echo "BUILD FAILED (rc $build_rc); tail of $OUT/build.log:"
    tail -n 30 "$OUT/build.log"
fi
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

echo "== kernel tests on the GPU ($(elapsed) s) =="
timeout "${PYTEST_TIMEOUT_S:-90}" "$PY" -m pytest -q --maxfail=5 -p no:cacheprovider tests/triton tests/ops \
    -k "(triton or cuda) and not bench_scripts" >"$OUT/pytest.log" 2>&1
rc=$?
tail -n 15 "$OUT/pytest.log"
(( rc == 124 )) && echo "pytest stopped by its time cap (PYTEST_TIMEOUT_S); see $OUT/pytest.log"
echo "pytest exit code $rc"

echo "== device_check.py ($(elapsed) s) =="
budget=$(( ${DEVICE_CHECK_TIMEOUT_S:-360} - $(elapsed) - 45 ))
(( budget < 60 )) && budget=60
"$PY" bench/device_check.py --out "$OUT" --budget-s "$budget" 2>&1 | tee "$OUT/device_check.log"
check_rc=${PIPESTATUS[0]}
echo "device_check.sh done in $(elapsed) s (build rc $build_rc, _C_cuda $cuda_ok, pytest rc $rc, device_check rc $check_rc)"
exit $(( build_rc != 0 || cuda_ok == 0 || rc != 0 || check_rc != 0 ))
