# The two commands a new user runs: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV   ?= .venv
# The CPU build works everywhere; on a GPU box install your CUDA build of torch first
# (`make TORCH_SPEC=torch ...` or pip install it into .venv), pip then keeps it.
TORCH_SPEC ?= torch==2.13.0
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
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
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
