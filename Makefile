# Two commands on a fresh machine with Python 3.11 and pip:
#   make bench   builds the default dataset and compares stoker with the DataLoader
#   make test    lint, type-check and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch goes in first, pinned to a CPU-capable release, so that pip never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

bench: venv
	$(VENV)/bin/stoker bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
