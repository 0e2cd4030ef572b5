#!/usr/bin/env bash
# The test suite (CPU, gloo; GPU-only tests skip without a GPU). Installs what it needs first.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `-k parity`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
ruff check .
ruff format --check .
python -m pytest tests "$@"
