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
  # SGLang's storage interface for the HiCache backend tests (snapstore[sglang] pins the version): --no-deps,
  # since sglang pins a CUDA torch and another transformers; what its storage modules import comes next.
  # Not torchvision: its wheels for this torch are CUDA builds whose operators fail to load here.
  .venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"
  .venv/bin/python -m pip install -q orjson pybase64 triton starlette msgspec pyzmq ipython
  touch "$stamp"
fi
