#!/usr/bin/env bash
# Create .venv beside the project and install elastic_trainer with everything it needs.
# Safe to re-run. Extras to install: $1 (e.g. "test" or "test,bench"), default none.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

# torch first, so the project's range (torch>=2.5,<3) is already met and pip does
# not pull a multi-GB CUDA build onto a machine with no GPU.
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch>=2.5,<3"
  else
    # TORCH_INDEX_URL may name PyTorch's CPU wheel index where the default index serves CUDA builds.
    pip install "torch==${TORCH_CPU_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
extras=${1:-}
pip install -e ".${extras:+[$extras]}"
# An editable install leaves the package's bytecode to be written on first import, which
# PYTHONDONTWRITEBYTECODE (set on many CI hosts and containers) forbids: every Ray worker
# process would then compile all ~110 modules anew, about 0.15 s of CPU each start.
python -m compileall -q elastic_trainer
