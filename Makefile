# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install the pinned dependencies on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

.PHONY: setup demo test lint bench
setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/autoremat demo gpt2

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
