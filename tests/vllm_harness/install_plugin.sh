#!/usr/bin/env bash
# Install this package into the vLLM venv (editable, so the servers run the working tree) without touching
# vLLM's torch: --no-deps, and SHADOWPREFILL_CUDA=0 (the CPU page-copy extension is pure pybind11 and builds
# in any venv; the CUDA one is not needed by the scheduler). Also pytest for units_shadow_kv.py.
# Re-runs when pyproject.toml or setup.py changed (entry points, packages).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
STAMP="$VENV/.shadowprefill-plugin"
if [[ -f "$STAMP" && "$STAMP" -nt "$ROOT/pyproject.toml" && "$STAMP" -nt "$ROOT/setup.py" ]]; then
  echo "[vllm-harness] shadowprefill installed in $VENV"; exit 0; fi
TORCH_BEFORE=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
SHADOWPREFILL_CUDA=0 "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
"$VENV/bin/python" -m pip install -q pytest
TORCH_AFTER=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
if [[ "$TORCH_BEFORE" != "$TORCH_AFTER" ]]; then
  echo "[vllm-harness] installing shadowprefill changed the venv's torch ($TORCH_BEFORE -> $TORCH_AFTER)"; exit 1; fi
"$VENV/bin/python" -c "from shadowprefill.integrations.vllm import ShadowScheduler; print('[vllm-harness]', ShadowScheduler.__module__, 'imports in', '$VENV')"
touch "$STAMP"
