#!/usr/bin/env bash
# One command to set up lily in ./.venv: `bash scripts/install.sh`.
# Without an NVIDIA GPU it installs PyTorch's CPU build; Triton comes along so its
# interpreter can run the kernels' tests on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch
else
    .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[dev]"
echo "lily installed in .venv: activate with 'source .venv/bin/activate'"
