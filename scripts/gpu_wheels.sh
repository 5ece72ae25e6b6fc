#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels scripts/gpu_check.sh installs on a device machine
# that cannot reach any registry: snapstore's own dependencies its image lacks, setuptools new
# enough to build the editable install, and transformers at the version the hf tests pin. They go
# to .whl/ (git-ignored), at the versions this checkout's .venv tests with, for CPython 3.12 on
# x86-64 Linux (the device image). Never torch: the device's CUDA build stays.
#   ./scripts/gpu_wheels.sh      then carry ".whl" with the device call that runs gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
PY=.venv/bin/python
# transformers 5.23 needs huggingface-hub >= 1.31 and tokenizers >= 0.23.1: the image has 1.33 and 0.23.2
names=(apsw zstandard blake3 platformdirs setuptools transformers)
specs=()
for n in "${names[@]}"; do
  specs+=("$n==$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$n")")
done
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "${specs[@]}"
ls -l .whl
du -sh .whl
