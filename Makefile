# The README's two commands: `make serve` and `make test`. Both bootstrap .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast check bench-offline clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a CPU build from this machine's disk (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/sluice serve

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not model"

check: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench-offline: $(STAMP)
	$(BIN)/sluice bench offline

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
