# The two commands a new user runs: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first, then the project (pip keeps the torch it finds). From PyPI on
# Linux, torch==2.13.0 is the CUDA build: it pulls in the NVIDIA CUDA libraries (gigabytes) and
# runs on CPU too. CPU=1 installs the CPU-only build from the PyTorch CPU wheel index instead,
# with no CUDA libraries: `make CPU=1 demo`, `make CPU=1 test`. For another CUDA version, name
# its index, e.g. `make TORCH_INDEX=https://download.pytorch.org/whl/cu126 test`, or pip
# install your torch into .venv first. CPU and TORCH_INDEX take effect when .venv is created
# (`make clean` first to change an existing one).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= $(if $(filter 1,$(CPU)),https://download.pytorch.org/whl/cpu)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-local test lint typecheck unit docs bench bench-quick clean help

help:
	@echo "make demo   - set up .venv, run 3 daemons on loopback that train the tiny GPT together"
	@echo "make demo-local - one process: train the tiny GPT with a progress bar, print a sample"
	@echo "make test   - set up .venv, run ruff, mypy and the whole test suite (2 workers;"
	@echo "              TEST_WORKERS=0: in one process)"
	@echo "make docs   - build the documentation site into site/ (mkdocs, warnings are errors)"
	@echo "make bench  - run the benchmarks, JSON to stdout (about 100 min on 2 cores)"
	@echo "make bench-quick - the benchmarks' quick variants (a few minutes)"

# constraints.txt pins the test and docs tools (ruff, mypy, pytest and its plugins, mkdocs).
# setuptools >= 77 reads pyproject's license fields (PEP 639); the packaging tests build the
# wheel with it.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=77"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev]" -c constraints.txt
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/atomd demo

demo-local: $(STAMP)
	$(BIN)/atomd demo --local

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# api/ and bench/ install as atomd_api and atomd_bench (pyproject's package-dir); mypy finds
# them under those names through these links (pyproject's mypy_path).
IMPORT_NAMES := $(VENV)/import-names
$(IMPORT_NAMES): | $(STAMP)
	mkdir -p $(IMPORT_NAMES)
	ln -sfn $(CURDIR)/api $(IMPORT_NAMES)/atomd_api
	ln -sfn $(CURDIR)/bench $(IMPORT_NAMES)/atomd_bench
	ln -sfn $(CURDIR)/migrations $(IMPORT_NAMES)/atomd_migrations

typecheck: $(STAMP) $(IMPORT_NAMES)
	$(BIN)/mypy

# The documentation site: docs/ and mkdocs.yml; the reference pages are generated from the
# code (docs/hooks/reference.py). Nothing is fetched from the network.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

# Two pytest workers (pytest-xdist): the suite waits on daemons' I/O as much as it computes,
# so two share two cores well. Tests that run several training daemons are one group
# (xdist_group "swarm"), run one at a time. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: lint typecheck docs
	$(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup

bench: $(STAMP)
	$(BIN)/python -m atomd_bench

bench-quick: $(STAMP)
	$(BIN)/python -m atomd_bench --quick

clean:
	rm -rf $(VENV) runs site .mypy_cache .pytest_cache .ruff_cache
