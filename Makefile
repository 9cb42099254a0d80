# Two commands for a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/qwen.toml

.PHONY: setup serve test test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

setup: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"

serve: setup
	$(BIN)/launch --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
