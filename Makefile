# Two commands on a fresh machine with Python 3.11 and pip:
#   make bench   builds the default dataset and compares stoker with the DataLoader
#   make test    lint, type-check and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch goes in first, pinned to a CPU-capable release, so that pip never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv bench-venv test lint bench clean prebuilt

# the environment both share: the virtualenv, pip and torch (first, from TORCH_SPEC)
$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	touch $@

# make bench: stoker and what `stoker bench` imports (its dependencies and the bench extra), nothing the tests need
$(VENV)/.bench-installed: $(VENV)/.base
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

# make test: also the test extra (pytest, ruff, mypy and the optional integrations the suite tests: ray, pyarrow, datasets)
$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

venv: $(VENV)/.installed

bench-venv: $(VENV)/.bench-installed

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

bench: bench-venv
	$(VENV)/bin/stoker bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# stoker's own kernels compiled for the generic CPU into src/stoker/_prebuilt (package data): run before building a
# wheel, so that a new environment loads them instead of compiling them (stoker.pipeline.prebuilt); a few minutes
prebuilt: bench-venv
	$(VENV)/bin/stoker warmup --library
