# Two set-up commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The exact pin takes the CPU wheel that lies on disk here; any other spec may pull a multi-GB CUDA
# build. GPU users: TORCH_SPEC="torch" (or their own build) make install.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/samestep demo

# Tests run in TEST_WORKERS processes (pytest-xdist), each handed the next test module as it frees up, the
# modules with the most tests first (xdist's order; by seconds measured no faster: docs/performance.md, "The
# test suite"). Each waits on its trainers and ranks at times, so three fill a 2-core machine (four made the
# suite slower). TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 3

# PYTHONDONTWRITEBYTECODE= : pytest rewrites samestep's asserts (its plugin's package) once, not in every worker.
test: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

# The edit-test loop: the unit tests but the slow ones (in two workers), and the demo end to end.
test-fast: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not opinfo" tests/unit
	$(BIN)/python -m pytest -q -m smoke tests/integration

bench: install
	$(BIN)/python bench/bench_foundation.py
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 bench/bench_layout.py
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 bench/bench_layout.py --fsdp
	$(BIN)/python bench/bench_production.py
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 bench/bench_checkpoint.py
	$(BIN)/python bench/bench_receipts.py
	$(BIN)/python bench/bench_checks.py
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 bench/bench_checks.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
