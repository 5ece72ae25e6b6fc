# snapstore developer tasks. `make bench` creates/uses .venv and runs the benchmarks.
# Other targets (test, lint, ...) belong here too; keep `bench` self-contained.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BENCH_ARGS ?=

.PHONY: bench bench-quick bench-deps

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'

# torch is pinned: the benchmark compares against torch.save/torch.load of the same tensors.
bench-deps: $(PY)
	@$(PY) -c "import snapstore" 2>/dev/null || $(PY) -m pip install -q -e '.[dev]'
	@$(PY) -c "import safetensors" 2>/dev/null || $(PY) -m pip install -q safetensors
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0

bench: bench-deps
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

bench-quick: bench-deps
	$(PY) benchmarks/bench.py --quick $(BENCH_ARGS)
