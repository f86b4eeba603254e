# The two commands: `make up` and `make test`. Both bootstrap .venv from nothing but Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint typecheck venv clean bench llama

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/llmgw up

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONASYNCIODEBUG=1 $(PY) -X dev -m pytest -n 2 --dist loadgroup -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/router_overhead.py
	$(PY) bench/sim_engine.py
	$(PY) bench/controlplane_scale.py

clean:
	rm -rf $(VENV) .llmgw .pytest_cache .mypy_cache .ruff_cache test-artifacts
