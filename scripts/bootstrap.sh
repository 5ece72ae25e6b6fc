#!/usr/bin/env bash
# Create .venv (if missing) and install snapstore with its test and model-runtime extras.
# torch is pinned to the CPU wheel these machines carry; installed first so that no other
# requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.snapstore-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,hf,llamacpp-test,mlx]"
  touch "$stamp"
fi
