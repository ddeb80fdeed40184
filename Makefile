# specrun: `make run` sets up and runs the main job; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= gemma-3-270m
PROMPT_FILE ?= benchmarks/prompts/code_rewrite.txt
# llama-cpp-python is built with ggml's RPC backend (`specrun rpc-worker`, `--rpc`) and, on x86-64,
# with the CPU's instruction sets named from /proc/cpuinfo instead of -march=native, AMX off (its
# kernels crash on some hosts): the flags llama.cpp's own llama-server is built with for
# `make bench-peers` (docs/design.md, "Builds and CPU checks").
LLAMA_CPP_PY  := 0.3.36
cpu_has = $(if $(shell grep -qw '$(1)' /proc/cpuinfo 2>/dev/null && echo y),ON,OFF)
ifeq ($(shell uname -m),x86_64)
CPU_CMAKE_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) -DGGML_AVX2=$(call cpu_has,avx2) \
	-DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) \
	-DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
endif
LLAMA_CMAKE_ARGS ?= -DGGML_RPC=ON $(CPU_CMAKE_FLAGS)
# the installed llama-cpp-python is this build: RPC in, and the instruction sets llama.cpp reports
# are the ones asked for (a wheel from pip's cache may have been built with other flags)
LLAMA_BUILD_OK := import glob, os, re, sys, llama_cpp as L; \
	have = set(re.findall(r'(\w+) = 1', L.llama_print_system_info().decode())); \
	want = dict(re.findall(r'-DGGML_(\w+)=(ON|OFF)', '$(LLAMA_CMAKE_ARGS)')); \
	shown = 'AVX AVX2 FMA F16C BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_INT8'.split(); \
	sys.exit(not glob.glob(os.path.dirname(L.__file__) + '/lib/libggml-rpc.so') \
	         or any((k in have) != (v == 'ON') for k, v in want.items() if k in shown))
RUN_ARGS ?= -m $(MODEL) --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16 --spec-draft-adaptive -n 128 --temp 0 -f $(PROMPT_FILE)

.PHONY: install run test test-full test-fast bench bench-draft-length bench-draft-length-replay bench-copy-bound bench-pass-times bench-rpc bench-peers bench-exact-peers bench-same-text bench-slots bench-prompt-kernels bench-server-loop bench-serve-load bench-stream-gap bench-suffix peers-server lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py kernels/_draftloop.c Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -e '.[dev,models]'
	@# pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS: a wheel cached with other flags is rebuilt once.
	$(BIN)/python -c "$(LLAMA_BUILD_OK)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==$(LLAMA_CPP_PY)
	touch $(STAMP)

run: install
	$(BIN)/specrun $(RUN_ARGS)

# Tests run in TEST_WORKERS processes, one llama.cpp thread each (tests/conftest.py). `make test` is
# every test but the long tail of the exactness grids (marker `full`), which `make test-full` runs;
# CI runs both (.ci/run).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: lint
	$(PYTEST) -m "not full"

test-full: install
	$(PYTEST) -m full

test-fast: lint
	$(PYTEST) -m "not slow and not full"

# Each bench-* target rewrites its own files in benchmarks/results (docs/benchmarks.md reads them).
bench: install
	$(BIN)/python benchmarks/bench_spec.py

# --spec-draft-adaptive against fixed n-gram drafts on the peers workloads, in one process (~4 min)
bench-draft-length: install
	$(BIN)/python benchmarks/draft_length.py

# the same policy replayed without the model on 39 cached greedy texts, against per-pass foresight (~3 min)
bench-draft-length-replay: install
	$(BIN)/python benchmarks/draft_length_replay.py

# the speed any copy drafter could reach on specrun's exact text (foresight), beside what llama-server's best needs;
# then the same on issue 50's sessions (~4 min)
bench-copy-bound: install
	$(BIN)/python benchmarks/copy_bound.py
	$(BIN)/python benchmarks/copy_bound.py --sessions -n 96

# local against two loopback `specrun rpc-worker`s, with 0/1/5/20 ms of added round-trip latency
bench-rpc: install
	$(BIN)/python benchmarks/rpc_bench.py --docs

# `make bench-peers`: specrun serve against llama.cpp's own llama-server, built once from the same
# llama-cpp-python sdist the project pins (the binary is cached under build/peers; delete it to rebuild).
# The CPU flags of specrun's own llama-cpp-python build (CPU_CMAKE_FLAGS, above).
PEERS_DIR     := build/peers
PEERS_SRC     := $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
LLAMA_SERVER  := $(PEERS_DIR)/cmake/bin/llama-server
PEERS_ARGS    ?= --docs
PEERS_CMAKE_FLAGS := $(CPU_CMAKE_FLAGS) -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release

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

# every llama.cpp graph timed inside specrun serve and llama-server exact on the same requests (~2 min;
# PASS_ARGS: --workload, --setting, --systems, --reps)
PASS_ARGS ?=
bench-pass-times: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/pass_times.py $(PASS_ARGS)

# specrun beside llama-server twice: with its defaults and with exact mode's flags (text or engine)
bench-exact-peers: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/exact_peers.py

# specrun's settings on llama-server's own texts, taken from benchmarks/results/peers.json
bench-same-text: install
	$(BIN)/python benchmarks/same_text.py

# two server slots: one request alone, two at once, then alone again
bench-slots: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/slots.py

# the fast prompt path with llama.cpp's tiled K-quant matmul on and off
bench-prompt-kernels: install
	$(BIN)/python benchmarks/prompt_kernels.py

# /health's answer time while heavy requests run (issue 48)
bench-server-loop: install
	$(BIN)/python benchmarks/server_loop.py

# specrun serve (-cb and -nocb) beside llama-server at 1, 2, 4 and 8 clients (issue 49)
bench-serve-load: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/serve_load.py --docs

# busy slots with idle ones between them: their KV streams side by side or not (issue 49)
bench-stream-gap: install
	$(BIN)/python benchmarks/stream_gap.py

# suffix beside the n-gram types and llama-server on sessions where earlier answers recur (issue 50)
bench-suffix: install $(LLAMA_SERVER)
	$(BIN)/python benchmarks/suffix_bench.py --docs

lint: install
	$(BIN)/ruff check gguf_spec kernels cli tests benchmarks
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info kernels/_draftloop*.so
