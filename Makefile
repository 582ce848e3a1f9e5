# MegaCapybara: `make serve` sets everything up and serves the default model; `make test` sets up
# and runs the lint and the tests. Both are safe to rerun: finished steps are skipped.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; GPU users may set TORCH_SPEC to their CUDA build of the same version.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: setup serve test lint format clean

setup: $(VENV)/.mc-deps
	$(PY) ggml-patches/build.py --python $(PY)

$(VENV)/.mc-deps: pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "MegaCapybara needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" numpy
	$(PY) ggml-patches/build.py --python $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

serve: setup
	$(PY) -m orchestrator serve $(ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest $(ARGS)

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
