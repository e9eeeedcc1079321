# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install the pinned dependencies on first use (about a minute).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	@echo "Creating $(VENV) and installing autoremat with its pinned dev dependencies..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]' | grep -E '^(Collecting|Successfully)' || true
	$(BIN)/python -c "import autoremat, torch, transformers, mypy"
	touch $(STAMP)

.PHONY: setup demo test test-fast lint typecheck bench
setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/autoremat demo gpt2

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest

# The quick loop while working: lint, types and the tests not marked slow (about a minute).
test-fast: lint typecheck
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
