PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench faults install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,demo]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python examples/keras_mirrored.py demo_output

bench: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python benchmarks/bench.py

# two pytest workers; the tests that start processes run one after another in one of them
test: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python -m pytest -q -n 2 --dist loadgroup

faults: $(STAMP)   # the multi-process and kill tests at full strength (not part of `make test`)
	KERAS_BACKEND=jax LOCKSTEP_FAULT_TRIALS=20 $(BIN)/python -m pytest -q tests/test_fault_tolerance.py tests/test_multi_worker.py

clean:
	rm -rf $(VENV) build *.egg-info
