# One Makefile. `make demo` and `make test` each set up .venv on a fresh machine (idempotently), with uv: pip took
# ~4 min for what uv installs in ~1 min (its bytecode compiled, as pip does: this machine sets PYTHONDONTWRITEBYTECODE).
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

.PHONY: setup browser sandbox demo test test-sweeps test-drills test-hosts test-bench test-fast lint bench docs-ref device-carry clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/pip || $(PY) -m venv --clear $(VENV)  # also mends a venv cut off half-made
	@echo ">> installing teleport-lab and its dependencies into $(VENV) with uv (first time: ~1 min)"
	$(BIN)/pip install --quiet --disable-pip-version-check "uv>=0.9,<1"
	$(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode \
	  $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e ".[dev]"
	@touch $(STAMP)

# Debian's chromium for the dashboard's browser tests (tests/web drives it with Playwright; Playwright's own
# browsers are never downloaded). Idempotent: nothing to do when chromium is on PATH.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || { echo ">> installing Debian's chromium for the browser tests (tests/web)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends chromium; }

# Debian's bubblewrap and libseccomp: each job's training runs in a sandbox of its own, behind a seccomp filter
# (workers/job/sandbox.py, docs/security.md). Idempotent: nothing to do when both are here. Without them, tlab up
# says so and refuses users' code.
sandbox:
	@{ command -v bwrap && /sbin/ldconfig -p | grep -q 'libseccomp\.so\.2'; } >/dev/null || { \
	  echo ">> installing Debian's bubblewrap and libseccomp2 for the per-job sandbox"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends bubblewrap libseccomp2; }

demo: setup sandbox
	$(BIN)/tlab demo --home runs/demo

# 3 xdist workers: the tests that run Ray go to two chains, a worker each, in file order, the third takes the
# rest (tests/conftest.py, which also says what the run costs). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS)

test: setup browser sandbox
	$(PYTEST) --ignore=tests/hosts --ignore=tests/benchmarks -m "not drill and not sweeps"

# the sweeps through Ray Tune's searchers and schedulers (ASHA, Optuna, PBT, `tlab compare`), a sweep cancelled, a
# failed trial rerun: each takes the whole head for several trials at once, every trial a process importing torch
# (~4.5 min alone); apart from `make test`, where real sweeps still run (a code package's, the dashboard's, the
# notebook's)
test-sweeps: setup sandbox
	$(PYTEST) --ignore=tests/hosts --ignore=tests/benchmarks -m "sweeps and not drill"

# the drills: a Ray head, Redis, the scheduler, the API, a job's driver or a node killed or restarted mid-run, and
# what survives it (every epoch once, nothing lost); each restarts Ray, so they run apart from `make test` (~8 min)
test-drills: setup browser sandbox
	$(PYTEST) --ignore=tests/hosts -m drill

# real hosts on this machine (network namespaces, tests/hosts/): tlab up --listen, tlab join, a host killed and cut
# off mid-run; needs root, skipped where namespaces cannot be made; one lab for the module, after `make test`
test-hosts: setup sandbox
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=5 tests/hosts

# the benchmarks' own tests: each benchmark's --quick run and the shape of the JSON it writes (~1.5 min)
test-bench: setup
	$(PYTEST) tests/benchmarks

test-fast: setup browser sandbox
	$(PYTEST) -m "not slow"

lint: setup
	$(BIN)/ruff check .

# docs/reference/settings.md and cli.md, read off the settings classes and the CLI's argparse tree
# (tests/test_docs_reference.py fails when a checked-in page differs from what this writes)
docs-ref: setup
	$(BIN)/python scripts/docs_ref.py

bench: setup
	$(BIN)/python -m benchmarks.run_all

# The wheels a lent GPU machine lacks, in .whl (pinned to .venv's versions): then one device call runs every GPU
# check, `bash benchmarks/device/run_checks.sh` with carry [".whl"] (docs/operations.md)
device-carry: setup
	$(PY) benchmarks/device/carry.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# One-line mutations of the guarantees the docs name (tests/mutations.py), each in a temporary copy of the tree with
# the tests that hold it: every one must be caught. Not part of `make test` (about 8 minutes here).
.PHONY: mutation
mutation: setup
	$(BIN)/python -m tests.mutations
