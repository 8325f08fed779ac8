#!/usr/bin/env bash
# One-shot GPU check of shadowprefill's kernels (issue 3), for a GPU machine with no internet:
#   1. build the package with the machine's own python3 (pip install -e . --no-build-isolation --no-deps),
#   2. run the kernel tests on the GPU (tests/triton, and the Triton half of tests/ops), time-capped,
#   3. bench/device_check.py: GPU correctness (bf16 vs float64 included), ceilings, timed shapes, one table.
# Whole run: under 8 minutes. Results: stdout (the table is printed last) and $OUT (default ./out):
# build.log, pytest.log, device_check.md, device_check.json.
#   bash bench/device_check.sh            # on the GPU machine
#   bash bench/device_check.sh --dry-run  # anywhere: skips build and GPU tests, tiny CPU shapes
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-450}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

if [[ "${1:-}" == "--dry-run" ]]; then
    exec "$PY" bench/device_check.py --dry-run --out "$OUT"
fi

echo "== machine =="
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

echo "== build ($(elapsed) s) =="
if "$PY" -m pip install -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1; then
    echo "build ok"
else
    echo "BUILD FAILED (tail of $OUT/build.log below); falling back to a source tree without the extensions"
    tail -n 30 "$OUT/build.log"
fi
if ! "$PY" -c "import shadowprefill.triton_kernels" 2>/dev/null; then
    # shadowprefill.triton_kernels lives in triton_kernels/ (setup.py's package_dir): mirror that layout
    rm -rf /tmp/shadowprefill_src && mkdir -p /tmp/shadowprefill_src
    cp -r shadowprefill /tmp/shadowprefill_src/ && cp -r triton_kernels /tmp/shadowprefill_src/shadowprefill/
    export PYTHONPATH=/tmp/shadowprefill_src${PYTHONPATH:+:$PYTHONPATH}
    echo "using PYTHONPATH=$PYTHONPATH (copy_blocks needs the compiled extension and may fail)"
fi

echo "== kernel tests on the GPU ($(elapsed) s) =="
# (tests/triton/test_triton_bench_scripts.py checks these scripts on the CPU: not needed here)
timeout "${PYTEST_TIMEOUT_S:-150}" "$PY" -m pytest -q --maxfail=5 -p no:cacheprovider tests/triton tests/ops \
    -k "triton and not bench_scripts" >"$OUT/pytest.log" 2>&1
rc=$?
tail -n 15 "$OUT/pytest.log"
[[ $rc == 124 ]] && echo "pytest stopped by its time cap (PYTEST_TIMEOUT_S); see $OUT/pytest.log"
echo "pytest exit code $rc"

echo "== device_check.py ($(elapsed) s) =="
budget=$(( TOTAL_BUDGET_S - $(elapsed) - 60 ))
(( budget < 60 )) && budget=60
"$PY" bench/device_check.py --out "$OUT" --budget-s "$budget"
check_rc=$?
echo "device_check.sh done in $(elapsed) s (pytest rc $rc, device_check rc $check_rc)"
exit $(( rc != 0 || check_rc != 0 ))
