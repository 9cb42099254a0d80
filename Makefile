# Two commands for a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/qwen.toml

.PHONY: setup kernels serve test test-all test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

setup: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@$(MAKE) --no-print-directory kernels

# The CPU kernels for stored weight formats (native/: an MLX extension built with CMake against
# the venv's own mlx, hence no build isolation). Optional: without a compiler the server still
# runs, through the fallback (runtime.weights), and says so at launch.
KERNEL_SOURCES := $(shell find native -type f -not -path '*/build/*' -not -name '*.pyc' 2>/dev/null)
kernels: $(VENV)/.kernels-built

$(VENV)/.kernels-built: $(KERNEL_SOURCES) | $(BIN)/python
	@$(BIN)/python -m pip install --quiet -r native/build-requirements.txt \
	  && $(BIN)/python -m pip install --quiet --no-build-isolation ./native \
	  && touch $@ \
	  || echo "make: the CPU kernels (native/) were not built; the server runs without them" \
	          "(runtime.weights falls back to jit and says so at launch)" >&2

serve: setup
	$(BIN)/launch --config $(CONFIG)

# The extended matrices (marker `matrix`) stay out of `make test`; `make test-all` runs
# everything. `make test-fast` runs the layers that start no process and load no real model
# (marker `slow` deselected: tests/conftest.py marks it by layer and fixture, and fails a fast
# test that starts a process).
# Two workers (pytest-xdist), each given whole test files so a module's graph starts once:
# the in-process layers use one core each and the graphs leave cores idle while they wait
# (on 2 cores: 7:17 against 10:43 in one process). JOBS=0 runs in one process.
JOBS ?= 2
PARALLEL = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

test: setup
	$(BIN)/python -m pytest -q -m "not matrix" $(PARALLEL) --durations=15

test-all: setup
	$(BIN)/python -m pytest -q $(PARALLEL)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
