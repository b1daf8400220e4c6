# Corral: `make up` runs a local fleet, `make test` runs every check. Both set up what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the dependency list changes; pip's cache makes a re-install cheap.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/install-system.sh 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
LINT_DIRS := $(wildcard engine gateway operator cli tests e2e bench conftest.py)

.PHONY: install up test lint typecheck unit e2e k8s-tools otel-tools clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	bash scripts/install-system.sh
	@rm -f $(VENV)/.installed-* && touch $@

up: install
	$(VENV)/bin/corral up --demo

lint: install
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/ruff format --check $(LINT_DIRS)
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy engine/corral_engine gateway/corral_gateway operator/corral_operator cli/corral_cli bench

test: install lint typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm, built from the
# Go module proxy into ~/.cache/corral-e2e/<versions>/bin (minutes when cold, a no-op when cached).
k8s-tools:
	bash e2e/k8s/build.sh

# The OpenTelemetry Collector the tracing e2e sends spans to, built from the Go module proxy into
# ~/.cache/corral-e2e/otelcol-<hash>/ (minutes when cold, a no-op when cached).
otel-tools:
	bash e2e/otel/build.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
