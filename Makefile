# One command each: `make install`, `make test`, `make bench`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test test-fast bench bench-kernels lint

install:
	bash tools/install.sh

# Every test, the slow (convergence) ones included, one at a time (tools/run_tests.py;
# docs/testing.md says why not two at once on this 2-core machine).
test: install
	$(PY) tools/run_tests.py

# The developers' loop: every test that runs in this process or one child
# (no horovodrun, torchrun or local cluster; those skip), no slow ones, on
# two pytest workers (about 2.5 minutes here).
test-fast:
	DLGS_QUICK_CHECK=1 bash tools/install.sh
	DLGS_TEST_FAST=1 $(PY) -m pytest -q tests -m "not slow and not parallel" -n 2

# The main job: dense Horovod against dlgs on the PTB LSTM, 2 workers on a 1 Gbit/s
# local cluster (network namespaces + tc when root; plain loopback otherwise), the
# methods interleaved in 3 rounds so that each sees the same machine. dlgs profiles
# 8 steps (its default; the guard's samples) and names the link (--link-bandwidth's
# default: the cluster's --bandwidth), so that each round plans the same.
# Results go to bench-results/main (ignored by git); `make bench BENCH_OUT=benchmarks/results/main`
# refreshes the committed ones.
BENCH_OUT ?= bench-results/main

bench: install
	$(PY) -m benchmarks.cluster --workers 2 --bandwidth 1gbit -- \
	  $(PY) -m benchmarks.train --model lstm --batch 20 --methods no-comm,dense,dlgs \
	  --steps 20 --warmup 10 --rounds 3 --profile-steps 8 --out $(BENCH_OUT)

bench-kernels: install
	$(PY) -m benchmarks.kernels --sizes 1e4,1e5,1e6,1e7,2.5e7 --out benchmarks/results/kernels-cpu

lint:
	$(VENV)/bin/ruff check dlgs tests benchmarks examples
	$(VENV)/bin/mypy dlgs/core
