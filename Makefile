# The two set-up commands are `make demo` and `make test`; both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.spdkfac-installed
TORCH_PIN := torch==2.13.0
# Extra arguments for the demo, e.g. `make demo DEMO_ARGS="--epochs 1"`.
DEMO_ARGS ?=
DEMO_WORKERS ?= 2

.PHONY: demo test lint typecheck unit data corpora clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
		|| { echo "spdkfac needs Python >= 3.10 (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' $(TORCH_PIN)
	@# curvlinops' backpack declares torchvision, whose PyPI build is made for another torch
	@# and fails to import beside the CPU one ("torchvision::nms does not exist"), which
	@# breaks transformers' and Lightning's imports; nothing here uses it.
	$(BIN)/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision
	@touch $@

# What the demo reads, and only that: Debian's dataset-fashion-mnist.
data:
	@bash scripts/ensure_fashion_mnist.sh

# The text corpora of `spdkfac train --dataset text|gcide` (fortunes; GCIDE's data file,
# unpacked without the dictd server its package depends on). Not needed by the demo.
corpora:
	@bash scripts/ensure_fortunes.sh
	@bash scripts/ensure_gcide.sh

demo: $(STAMP) data
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(DEMO_WORKERS) \
		-m spdkfac demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
