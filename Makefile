# Two commands on a fresh machine: `make run` (the demo) and `make test` (the whole suite).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv tools lint bench fuzz soak clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

run: venv
	$(BIN)/kvobserve demo

tools: venv
	bash scripts/install-tools.sh

lint: venv
	$(BIN)/ruff check kvobserve tests benchmarks deploy
	$(BIN)/ruff format --check kvobserve tests benchmarks deploy
	$(BIN)/mypy
	$(BIN)/mypy deploy/kubernetes/generate.py
	$(BIN)/lint-imports

test: venv tools lint
	$(BIN)/pytest

bench: venv
	$(BIN)/python -m benchmarks.decode
	$(BIN)/python -m benchmarks.ingest
	$(BIN)/python -m benchmarks.e2e
	$(BIN)/python -m benchmarks.scale
	$(BIN)/python -m benchmarks.memory

# Coverage-guided fuzzing of the wire decoders (atheris); not part of `make test`.
fuzz: venv
	$(BIN)/python -m pip install --quiet --disable-pip-version-check atheris
	$(BIN)/python fuzz/fuzz_wire.py -atheris_runs=$${FUZZ_RUNS:-1000000}

# 10 minutes at 20k batches/s with faults; RSS growth and exact counts. Not part of `make test`.
soak: venv
	$(BIN)/python -m benchmarks.soak

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
