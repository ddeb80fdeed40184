# specrun: `make run` sets up and runs the main job; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= gemma-3-270m
PROMPT_FILE ?= benchmarks/prompts/code_rewrite.txt
# llama-cpp-python is built with ggml's RPC backend (`specrun rpc-worker`, `--rpc`).
LLAMA_CPP_PY  := 0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_RPC=ON
RUN_ARGS ?= -m $(MODEL) --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16 --spec-draft-adaptive -n 128 --temp 0 -f $(PROMPT_FILE)

.PHONY: install run test test-fast bench bench-draft-length bench-rpc bench-peers peers-server lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -e '.[dev,models]'
	@# pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS: a wheel cached without RPC is rebuilt once.
	test -n "$$(ls $(VENV)/lib/python3*/site-packages/llama_cpp/lib/libggml-rpc.so 2>/dev/null)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==$(LLAMA_CPP_PY)
	touch $(STAMP)

run: install
	$(BIN)/specrun $(RUN_ARGS)

test: lint
	$(BIN)/python -m pytest -q

test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python benchmarks/bench_spec.py

# --spec-draft-adaptive against fixed n-gram drafts on the peers workloads, in one process (~4 min)
bench-draft-length: install
	$(BIN)/python benchmarks/draft_length.py

# local against two loopback `specrun rpc-worker`s, with 0/1/5/20 ms of added round-trip latency
bench-rpc: install
	$(BIN)/python benchmarks/rpc_bench.py --readme

# `make bench-peers`: specrun serve against llama.cpp's own llama-server, built once from the same
# llama-cpp-python sdist the project pins (the binary is cached under build/peers; delete it to rebuild).
# AVX-512 / AVX-VNNI only where /proc/cpuinfo lists them; AMX always off (its kernels crash on some hosts).
PEERS_DIR     := build/peers
PEERS_SRC     := $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
LLAMA_SERVER  := $(PEERS_DIR)/cmake/bin/llama-server
PEERS_ARGS    ?= --readme
cpu_has = $(if $(shell grep -qw '$(1)' /proc/cpuinfo 2>/dev/null && echo y),ON,OFF)
PEERS_CMAKE_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512_vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
	-DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release

peers-server: $(LLAMA_SERVER)

$(LLAMA_SERVER):
	mkdir -p $(PEERS_DIR)
	test -f $(PEERS_SRC)/CMakeLists.txt || { \
	  $(BIN)/python -m pip download --no-deps --no-binary :all: -d $(PEERS_DIR) llama-cpp-python==$(LLAMA_CPP_PY) && \
	  tar -xzf $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(PEERS_DIR); }
	cmake -S $(PEERS_SRC) -B $(PEERS_DIR)/cmake $(PEERS_CMAKE_FLAGS)
	cmake --build $(PEERS_DIR)/cmake --target llama-server -j2

bench-peers: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/peers.py --llama-server $(LLAMA_SERVER) $(PEERS_ARGS)

lint: install
	$(BIN)/ruff check gguf_spec kernels cli tests benchmarks
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
