# One Makefile. `make demo` and `make test` each set up .venv on a fresh machine (idempotently).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Torch stays at the local CPU wheel (pyproject's range); one BLAS thread avoids 2-core oversubscription.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export RAY_AUTH_MODE ?= disabled
export TMPDIR ?= /tmp

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo ">> installing teleport-lab and its dependencies into $(VENV) (first time: ~2 min)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(BIN)/tlab demo --home runs/demo

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
