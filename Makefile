# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install the pinned dependencies on first use (1-2 minutes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	@echo "Creating $(VENV) and installing autoremat with its pinned dev dependencies..."
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info < (3, 11) and 'the pinned dev dependencies need Python 3.11+: make PYTHON=python3.11 ...')"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]' 2>&1 | grep -E '^(Collecting|Successfully|ERROR)' || true
	$(BIN)/python -c "import autoremat, torch, transformers, mypy"
	touch $(STAMP)

# The library zoo (docs/zoo.md) needs torchvision, timm, diffusers and peft: a venv of its own,
# since torchvision's PyPI wheel does not load beside the CPU torch without the zoo's shim.
ZOO_VENV := .venv-zoo
ZOO_STAMP := $(ZOO_VENV)/.installed

$(ZOO_STAMP): pyproject.toml
	@echo "Creating $(ZOO_VENV) with autoremat's dev and zoo extras..."
	$(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/python -m pip install --progress-bar on -e '.[dev,zoo]' 2>&1 | grep -E '^(Collecting|Successfully|ERROR)' || true
	cd benchmarks && ../$(ZOO_VENV)/bin/python -c "import library_zoo, torchvision, timm, diffusers, peft"
	touch $(ZOO_STAMP)

.PHONY: setup demo test test-fast lint typecheck bench zoo zoo-test
setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/autoremat demo gpt2

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# The tests run in $(JOBS) processes (pytest-xdist, an idle one takes half of the other's queue),
# each with one intra-op thread (conftest.py): docs/architecture.md, "How the suite runs".
JOBS ?= 2
XDIST := -n $(JOBS) --dist worksteal
test: lint typecheck
	$(BIN)/python -m pytest $(XDIST)

# The quick loop while working: lint, types and the tests not marked slow (2-3 minutes).
test-fast: lint typecheck
	$(BIN)/python -m pytest -m "not slow" $(XDIST)

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

# Every architecture of the library zoo, fp32 and bf16, own checkpointing off and on: writes
# benchmarks/results/zoo.md (about half an hour on 2 cores).
zoo: $(ZOO_STAMP)
	cd benchmarks && ../$(ZOO_VENV)/bin/python -m library_zoo

# The zoo's tests (real DenseNet, RegNet, LeViT, Swin, a VAE, MoE, each library's switch).
zoo-test: $(ZOO_STAMP)
	$(ZOO_VENV)/bin/python -m pytest tests/test_library_zoo.py $(XDIST)
