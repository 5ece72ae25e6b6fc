#!/usr/bin/env bash
# The device session's one command: set up Python, run the GPU tests, run the GPU benchmark.
#
#   ./scripts/gpu_check.sh        (on the device machine; logs to $OUT/gpu_check.log and writes
#                                  $OUT/gpu.json when $OUT is set)
#
# Python: a venv (.venv-gpu) over the system python that holds the CUDA torch (its site dirs
# added by a .pth), so torch is never replaced. Into it: the wheels in .whl/ when present
# (made beforehand by scripts/gpu_wheels.sh on a machine with PyPI, carried along: the device
# machine reaches no registry), installed --no-index --no-deps; else, where a registry is
# reachable, `pip install -e .[dev]` plus transformers at the hf extra's pin (the hf extra itself
# would name torch). The script fails if torch's version changed.
# Then, each under its own time cap (all of it well inside 8 minutes): pytest -m gpu over every
# test file with gpu tests, tests/engine/torch/test_engine_ordering.py (its cuda variants run the late-execution
# suite against the real device), tests/parts/test_paged.py -k cuda, benchmarks/bench_gpu.py, and, where sglang
# is installed, an SGLang server with snapstore as its HiCache storage tier (benchmarks/bench_sglang.py --server;
# up to 5 minutes more, six server starts).
# The exit status is 0 only when every step passed; the summary at the end says which did not.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
SECONDS=0
BASE=${PYTHON:-python3}
VENV=.venv-gpu
PY=$VENV/bin/python
fail=()

step() {  # step NAME CAP_SECONDS CMD...: run one step under a time cap, record a failure
  local name=$1 cap=$2
  shift 2
  echo "== [$SECONDS s] $name (cap ${cap} s): $*"
  timeout --kill-after=10 "$cap" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    fail+=("$name (rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'))")
  fi
  echo "== [$SECONDS s] $name: rc $rc"
}

echo "== gpu_check on $(hostname), $(uname -m), $(nproc) CPUs; base python: $(command -v "$BASE")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
torch_before=$("$BASE" -c 'import torch; print(torch.__version__)') || {
  echo "gpu_check: $BASE has no torch; set PYTHON to the interpreter that holds the CUDA build"; exit 2; }
if [ ! -x "$PY" ]; then
  # the base may itself be a venv (the device image's python3 is /opt/torch/.venv/bin/python3),
  # whose packages --system-site-packages would not see: add its site dirs through a .pth instead
  # (after the new venv's own, so what is installed here shadows them; torch stays the base's)
  "$BASE" -m venv "$VENV" || exit 2
  site_dirs=$("$BASE" -c 'import sysconfig as s; print(repr(sorted({s.get_paths()["purelib"], s.get_paths()["platlib"]})))')
  "$PY" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/zz-base-site.pth", "w").write(
    "import site; list(map(site.addsitedir, " + sys.argv[1] + "))\n")' "$site_dirs" || exit 2
fi
pip_i() { "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir "$@"; }
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing the carried wheels: $(cd .whl && echo *.whl)"
  pip_i --no-index --no-deps .whl/*.whl || exit 2
  # setuptools from .whl builds the editable install; nothing is fetched
  pip_i --no-index --no-deps --no-build-isolation -e . || exit 2
else
  echo "== no .whl/: installing from the registry (dev extra + transformers; torch left as it is)"
  hf_pin=$("$PY" - <<'PY'
import re
deps = re.search(r'^hf = \[(.*)\]$', open("pyproject.toml").read(), re.M).group(1)
print(next(d.strip(' "') for d in deps.split(",") if "transformers" in d))
PY
)
  pip_i -e ".[dev]" "$hf_pin" || exit 2
fi
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_after" != "$torch_before" ]; then
  echo "gpu_check: torch changed from $torch_before to $torch_after: the install replaced the device's build"; exit 2
fi
"$PY" - <<'PY' || fail+=("cuda visible")
import torch, snapstore, transformers
ok = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name(0) if ok else 'NONE'}; snapstore {snapstore.__version__}; "
      f"transformers {transformers.__version__}")
raise SystemExit(0 if ok else 1)
PY
echo "== [$SECONDS s] set up"

PT=("$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra)
mapfile -t gpu_files < <(grep -rl --include="test_*.py" "mark.gpu" tests)
step "pytest -m gpu" 180 "${PT[@]}" -m gpu "${gpu_files[@]}"
step "engine ordering (late + cuda)" 120 "${PT[@]}" tests/engine/torch/test_engine_ordering.py
step "paged -k cuda" 60 "${PT[@]}" tests/parts/test_paged.py -k cuda
step "bench_gpu" 180 "$PY" benchmarks/bench_gpu.py --dir scratch/bench-gpu ${OUT:+--json "$OUT/gpu.json"}
# SGLang HiCache with snapstore as its storage tier (docs/engine.md §17): real servers on a tiny random
# Llama, a 4096-token prompt after a restart, restored by snapstore vs SGLang's file backend vs
# recomputed. Only where sglang is installed (the carried wheels or the registry); else said and skipped.
if "$PY" -c 'import sglang' 2>/dev/null; then
  mkdir -p scratch
  step "sglang server (HiCache + snapstore)" 300 "$PY" benchmarks/bench_sglang.py --server 4096 --dir scratch \
    ${OUT:+--json "$OUT/sglang.json"}
else
  echo "== sglang not installed in $VENV: the SGLang server run is skipped (pip install 'snapstore[sglang]')"
fi

echo "== [$SECONDS s] done"
if [ ${#fail[@]} -ne 0 ]; then
  printf 'gpu_check: FAILED: %s\n' "${fail[@]}"
  exit 1
fi
echo "gpu_check: all steps passed"
