# Two commands on a fresh machine: `make run` (the demo) and `make test` (the whole suite, as CI
# runs it). While working: `make check` (lint, types, import contract and the unit tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# -qq: errors still print; pip's warnings about this machine's index configuration and
# setuptools' advice on editable installs do not (they drowned the demo's URLs).
PIP := $(BIN)/python -m pip install -qq --disable-pip-version-check
DEMO_FLAGS ?=
# pytest-xdist workers of `make check` and `make test`; each takes its own block of ports
# (tests/conftest.py). worksteal: an idle worker takes tests queued at a busy one.
JOBS ?= 2
PARALLEL := -n $(JOBS) --dist worksteal

.PHONY: run check test venv venv-run tools lint bench fuzz soak clean

# The demo needs only the runtime dependencies; the test tools come with `make test` (`venv`).
$(RUN_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing kvobserve into $(VENV) (runtime dependencies only) ..."
	@$(PIP) --upgrade pip
	@$(PIP) -e .
	@$(BIN)/python -m compileall -q kvobserve  # so the first start does not compile (~3 s)
	@touch $(RUN_STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing kvobserve and its test tools into $(VENV) ..."
	@$(PIP) --upgrade pip
	@$(PIP) -e '.[test]'
	@touch $(STAMP) $(RUN_STAMP)

venv: $(STAMP)

venv-run: $(RUN_STAMP)

run: venv-run
	@$(BIN)/kvobserve demo $(DEMO_FLAGS)

tools: venv
	bash scripts/install-tools.sh

lint: venv
	$(BIN)/ruff check kvobserve tests benchmarks deploy
	$(BIN)/ruff format --check kvobserve tests benchmarks deploy
	$(BIN)/mypy
	$(BIN)/mypy deploy/kubernetes/generate.py
	$(BIN)/lint-imports

# The inner loop: what a change must pass before it is worth the whole suite. Hypothesis runs a
# tenth of each property's examples here (tests/examples.py), and the unit tests marked `slow`
# (long replays of the trace fixture) wait for `make test`, which runs everything.
check: lint
	$(BIN)/pytest tests/unit -q $(PARALLEL) --hypothesis-profile=quick -m "not slow"

# CI (.ci/run): the tools, lint, then every test, unit and integration, in parallel.
test: venv tools lint
	$(BIN)/pytest $(PARALLEL)

bench: venv
	$(BIN)/python -m benchmarks.decode
	$(BIN)/python -m benchmarks.ingest
	$(BIN)/python -m benchmarks.e2e
	$(BIN)/python -m benchmarks.relay
	$(BIN)/python -m benchmarks.scale
	$(BIN)/python -m benchmarks.memory
	$(BIN)/python -m benchmarks.overlap
	$(BIN)/python -m benchmarks.misses

# Coverage-guided fuzzing of the wire decoders (atheris); not part of `make test`.
fuzz: venv
	$(BIN)/python -m pip install --quiet --disable-pip-version-check atheris
	$(BIN)/python fuzz/fuzz_wire.py -atheris_runs=$${FUZZ_RUNS:-1000000}

# 10 minutes at 20k batches/s with faults; RSS growth and exact counts. Not part of `make test`.
soak: venv
	$(BIN)/python -m benchmarks.soak

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
