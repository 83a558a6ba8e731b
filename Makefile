# The two commands: `make run` (main job) and `make test` (whole suite). Both set up .venv themselves.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
JOBS    ?= 2

.PHONY: run test setup lint bench clean conformance timing

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/heterog main

# --dist loadscope: a module's tests stay on one worker, so its module-scoped fixtures (captured graphs and
# the plans made on them, an ILP) and cached captures are built once, not once per worker
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadscope --timeout 600 --durations=25 -m "not timing" tests

# checks of real timings (emulated links, profiled costs): the machine must be otherwise idle
timing: $(STAMP)
	$(BIN)/python -m pytest -q --timeout 600 -m timing tests

# the runtime conformance suites: 16 random seeds per model and cluster (make test runs 2), split and grid
# plans of every model under every combination of cluster and micro-batches (make test: half of them, no
# recurrent models), eighteen more transformers families, runs that survive (a transformers model resumed
# across plans, a device that comes back, torchrun's processes, its restarts and a node that joins through
# its rendezvous), sharded state under every mix on both clusters, and more planners' plans as plan actions
conformance: $(STAMP)
	HETEROG_CONFORMANCE_SEEDS=16 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 600 tests/runtime/test_conformance.py
	HETEROG_DIVIDED_ALL=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 900 tests/runtime/test_split_conformance.py \
		tests/compiler/test_splits_models.py \
		tests/runtime/test_grid_conformance.py
	HETEROG_TRANSFORMERS_MORE=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 600 \
		tests/runtime/test_transformers_conformance.py
	HETEROG_SURVIVE_MORE=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 900 tests/runtime/test_checkpoint.py \
		tests/runtime/test_elastic.py tests/runtime/test_torchrun.py
	HETEROG_SHARDED_SWEEP=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 600 tests/runtime/test_sharded_conformance.py
	HETEROG_PLANNER_ACTIONS=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout 600 tests/test_extended_actions.py

lint: $(STAMP)
	$(BIN)/ruff check heterog simulator envs agents experiments tests
	$(BIN)/mypy heterog simulator envs agents

bench: $(STAMP)
	$(BIN)/heterog bench

clean:
	rm -rf $(VENV) .heterog-cache
