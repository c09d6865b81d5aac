# Two commands on a fresh machine with Python 3.11 and pip:
#   make bench   builds the default dataset and compares stoker with the DataLoader
#   make test    lint, type-check and run the test suite (all but the longest tests; about 6 minutes on 2 cores: TEST_SPLIT.md)
# and, nightly: make test-long   lint and every test, the longest ones (marker `long`) and long hypothesis runs included
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch goes in first, pinned to a CPU-capable release, so that pip never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

# pytest's parallel workers (pytest-xdist): one per CPU, at most 4 (each worker compiles its own pipelines)
PYTEST_WORKERS ?= auto --maxprocesses=4
# every run prints its 15 slowest tests
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15

.PHONY: venv bench-venv test test-long lint bench clean prebuilt

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

# lint beside the tests (it fills the moments the tests' workers wait: about 30 s of a run on 2 cores); its output
# comes after the tests', and either failing fails the target
LINT_LOG := $(VENV)/lint.log
define beside_lint
	@$(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	$(1); tests=$$?; \
	wait $$lint; linted=$$?; \
	echo "---- make lint (run beside the tests) ----"; cat $(LINT_LOG); \
	if [ $$linted -ne 0 ]; then echo "make lint failed"; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]
endef

# the hypothesis profile `ci` (tests/conftest.py): a few examples of each costly property test; the tests marked
# `long` wait for test-long
test: venv
	$(call beside_lint,HYPOTHESIS_PROFILE=ci $(PYTEST) -m "not long")

# nightly: everything make test runs, the `long` tests too, with the full hypothesis runs (profile `long`), every
# loader on the compiled producer loop (make test runs most on Python producers: tests/conftest.py)
test-long: venv
	$(call beside_lint,HYPOTHESIS_PROFILE=long STOKER_SUITE_COMPILED_LOOP=1 $(PYTEST))

# seed 003's question (300,000 integers in shuffled batches of 300: stoker against the seed's numpy permutation loop
# and its FastDataloader; a few seconds), then the main job (Otto: stoker against the DataLoader). A process that loaded
# the prebuilt kernels compiles them for this CPU in children at its exit; seed 003 goes first, starting none
# (STOKER_HOST_KERNELS=0), so that no benchmark runs beside them. On a fresh install it runs the prebuilt kernels: the
# shuffle's AVX-512 build on a CPU with AVX-512 (2.1x-2.8x the FastDataloader), its AVX2 build on one with AVX2
# (2.1x-2.5x), else the generic x86-64's (1.7x-1.9x; docs/benchmarks.md)
bench: bench-venv
	STOKER_HOST_KERNELS=0 $(VENV)/bin/python benchmarks/seed003.py --out bench-out
	$(VENV)/bin/stoker bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# stoker's own kernels compiled for the generic CPU (and the shuffle for AVX-512 and AVX2 CPUs too) into src/stoker/_prebuilt
# (package data, committed: the README's install and a wheel bring them, so a new environment loads them instead of
# compiling them: stoker.pipeline.prebuilt).
# Run it after editing a kernel or what a kernel imports, and commit the folder (tests/pipeline/test_prebuilt_files.py
# fails while it is stale); about 5 minutes on 2 cores
prebuilt: bench-venv
	$(VENV)/bin/stoker warmup --library
