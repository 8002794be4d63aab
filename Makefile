PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench install clean

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

test: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
