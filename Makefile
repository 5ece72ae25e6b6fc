# snapstore developer tasks. Each target sets up .venv itself (scripts/bootstrap.sh).

PY         := .venv/bin/python
BENCH_ARGS ?=

.PHONY: setup test lint demo bench bench-quick

setup:
	./scripts/bootstrap.sh

test:
	./test.sh

lint: setup
	.venv/bin/ruff check snapstore engine tests fuzz benchmarks examples
	.venv/bin/mypy

demo:
	./demo.sh

# the benchmark compares against torch.save/torch.load and safetensors of the same tensors
bench: setup
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

bench-quick: setup
	$(PY) benchmarks/bench.py --quick $(BENCH_ARGS)
