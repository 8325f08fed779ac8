#!/usr/bin/env bash
# Create .venv-ray: Ray from PyPI beside this checkout's package, for `make test-ray`.
#   - torch is pinned to the project's CPU wheel (torch==2.13.0, found on disk through pip's find-links
#     where the machine has it): an unpinned torch would pull a multi-GB CUDA build;
#   - the package itself comes from this checkout through a .pth file (as an editable install does), so its
#     C++ extension, which `make install` already built in the tree for the same Python and torch, is not
#     rebuilt; its runtime dependencies are installed here.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${RAY_VENV:-$ROOT/.venv-ray}"
PYTHON="${PYTHON:-python3}"
RAY_VERSION="${RAY_VERSION:-2.60.0}"
STAMP="$VENV/.ray-ready-$RAY_VERSION"
if [[ -f "$STAMP" ]]; then echo "[ray] $VENV ready"; exit 0; fi
echo "[ray] creating $VENV (ray==$RAY_VERSION)"
"$PYTHON" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"               # keep the venv out of git without editing the repo's .gitignore
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "ray==$RAY_VERSION" numpy tqdm matplotlib pytest
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/shadowprefill-checkout.pth"
"$VENV/bin/python" -c "import ray, shadowprefill._C, shadowprefill.sim.study; print('[ray] ray', ray.__version__, '+ shadowprefill from', shadowprefill.__path__[0])"
touch "$STAMP"
