# gradkit: `make demo` runs the main job, `make test` the test suite; both set up .venv first.
# The pinned CPU wheel of torch is installed only when the venv has no torch yet, so GPU users
# can pre-install their own build (or override TORCH_SPEC).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: help setup setup-dev setup-bench setup-docs torch demo test test-gpu lint format bench bench-gpu \
	docs dist clean

help:
	@echo "make demo   set up .venv and run 'gradkit demo' (report under runs/)"
	@echo "make test   set up .venv with the dev extra and run the whole test suite"
	@echo "make lint   ruff + mypy on src/"
	@echo "make bench  gradkit against its peers, side by side (benchmarks/results/)"
	@echo "make test-gpu / make bench-gpu  the same on CUDA (needs a CUDA torch in .venv)"
	@echo "make docs   the documentation site with the API reference, into site/ (mkdocs --strict)"
	@echo "make dist   the sdist and wheel into dist/ (python -m build), version checked"

$(PY):
	$(PYTHON) -m venv $(VENV)

torch: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"

setup: torch
	$(PIP) install -e ".[demo]"

setup-dev: torch
	$(PIP) install -e ".[dev,demo,hf,lightning,monitor]"

setup-docs: torch
	$(PIP) install -e ".[docs]"

setup-bench: setup-dev
	$(PIP) install -e ".[bench]"
	$(PIP) install --no-deps backpack-for-pytorch

demo: setup
	$(VENV)/bin/gradkit demo $(DEMO_ARGS)

test: setup-dev
	$(PY) -m pytest

# Every test on the GPU (CPU-only tests are skipped, with the reason). The venv must hold a CUDA
# build of torch: install it before the first make, as the CPU wheel is installed otherwise.
test-gpu: setup-dev
	GRADKIT_TEST_DEVICE=cuda $(PY) -m pytest tests

lint: setup-dev
	$(PY) -m ruff check src tests benchmarks examples tools
	$(PY) -m ruff format --check src tests benchmarks examples tools
	$(PY) -m mypy

format: setup-dev
	$(PY) -m ruff format src tests benchmarks examples tools
	$(PY) -m ruff check --fix src tests benchmarks examples tools

bench: setup-bench
	$(PY) benchmarks/run.py $(BENCH_ARGS)

bench-gpu: setup-bench
	$(PY) benchmarks/run.py --device cuda --out benchmarks/results/cuda $(BENCH_ARGS)

# The site's pages are docs/*.md (doctested by make test) and one API page per public package,
# generated from the docstrings (tools/check_api_pages.py: none missing); --strict turns every
# warning (a broken link, a docstring mkdocstrings cannot parse) into an error.
docs: setup-docs
	$(PY) tools/check_api_pages.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# The wheel and sdist as published; the version is gradkit/_version.py's, checked in both.
dist: $(PY)
	$(PIP) install -q build
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) tools/check_dist.py dist

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
