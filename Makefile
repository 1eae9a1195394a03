# The README's two commands: `make serve` and `make test`. Both bootstrap .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast check bench-offline clean system-deps

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a CPU build from this machine's disk (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Debian packages the observability tests use: promtool + prometheus (rules, a real
# scrape), chromium + chromium-driver (the status page). Tests skip without them.
SYSTEM_DEPS := prometheus chromium chromium-driver
system-deps:
	@if command -v promtool >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_DEPS); \
	else echo "install $(SYSTEM_DEPS) for the observability tests"; fi

serve: $(STAMP)
	$(BIN)/sluice serve

test: $(STAMP) system-deps
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
