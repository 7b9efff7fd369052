#!/usr/bin/env bash
# The CUDA/NCCL checks on this machine's GPUs: one command, at most 10 minutes, one table.
# Uses the torch already installed (a GPU machine needs no download): the project's
# .venv if it has a CUDA build, else python3. Extra arguments go to benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
if ! "$PY" -c 'import torch, ray, pydantic, pyarrow, yaml' 2>/dev/null; then
  echo "gpu_check: $PY lacks torch, ray, pydantic, pyarrow or pyyaml; install the project first (pip install -e .)" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec timeout 600 "$PY" benchmarks/gpu_check.py "$@"
