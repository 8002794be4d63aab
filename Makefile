PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-full bench faults install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	@echo "installing lockstep and its dependencies into $(VENV) (JAX, Keras, TensorFlow for the tf.data tests: a few minutes)"
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,demo,tf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python examples/keras_mirrored.py demo_output

bench: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python benchmarks/bench.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/efficiency.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/input.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/small_steps.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/sharded.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/memory_peak.py

# two pytest workers; the tests that start processes run one after another in one of them
test: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

# the whole suite with its costly variants (every model and worker shape, 20 kills)
test-full: $(STAMP)
	KERAS_BACKEND=jax LOCKSTEP_FULL_SUITE=1 LOCKSTEP_FAULT_TRIALS=20 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

# fault injection, 20 trials of every scenario with 2 and 3 workers, and of partitions between two
# nodes (network namespaces: root and `ip`): writes benchmarks/FAULTS.md
faults: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python benchmarks/faults.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/partitions.py

clean:
	rm -rf $(VENV) build *.egg-info
