# One command each: `make install`, `make test`, `make bench`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test test-fast bench lint

install:
	bash tools/install.sh

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q tests -m "not slow"

bench: install
	$(PY) -m benchmarks.kernels --sizes 1e4,1e5,1e6,1e7,2.5e7 --out benchmarks/results/kernels-cpu

lint:
	$(VENV)/bin/ruff check dlgs tests benchmarks
	$(VENV)/bin/mypy dlgs/core
