#!/usr/bin/env bash
# Create .venv and install the project's requirements; does nothing when they are already installed.
#
# torch is installed first and pinned, so no later package pulls another build. On a machine
# without an NVIDIA driver this must resolve to the CPU build: here pip finds the local
# torch-2.13.0+cpu wheel; elsewhere set TORCH_SPEC (e.g. "torch==2.13.0+cpu" with your CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.installed"
want=$( (echo "$TORCH_SPEC"; cat requirements.txt requirements-dev.txt) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setup: installing requirements into $VENV (once)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
if ! command -v nvidia-smi >/dev/null 2>&1 && "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
  echo "setup: error: CUDA packages were installed on a machine without a GPU" >&2
  exit 1
fi
echo "$want" > "$stamp"
