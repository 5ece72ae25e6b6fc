# snapstore developer tasks. Each target sets up .venv itself (scripts/bootstrap.sh).

PY         := .venv/bin/python
BENCH_ARGS ?=

.PHONY: setup test test-slow test-all test-long lint ci demo bench bench-quick

setup:
	./scripts/bootstrap.sh

# fast tier (no servers, model runtimes, many processes or campaigns; short Hypothesis runs), one
# pytest-xdist worker per core: most of its wall time is fsync and process start, which overlap
test:
	HYPOTHESIS_PROFILE=dev ./test.sh -m "not slow" -n auto

# the slow tier alone: servers, model runtimes, many processes, reliability campaigns
test-slow:
	./test.sh -m slow

# everything CI runs: every tier, the ci Hypothesis profile
test-all:
	./test.sh

# long campaigns and fuzz runs, on demand (see tests/README.md)
test-long:
	SNAPSTORE_LONG=1 HYPOTHESIS_PROFILE=long ./test.sh

ci: lint test-all

lint: setup
	.venv/bin/ruff check snapstore engine tests fuzz benchmarks examples conftest.py
	.venv/bin/mypy
	.venv/bin/python scripts/lint_imports.py

demo:
	./demo.sh

# the benchmark compares against torch.save/torch.load and safetensors of the same tensors
bench: setup
	$(PY) benchmarks/bench.py --doc docs/benchmarks.md $(BENCH_ARGS)

bench-quick: setup
	$(PY) benchmarks/bench.py --quick $(BENCH_ARGS)
