# stepdoctor — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is the user's choice; the package never pins it. This default is the CPU wheel this machine carries.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
export STEPDOCTOR_DATA_DIR ?= $(CURDIR)/stepdoctor-data
PYTEST_ARGS ?=
# Compose v2 (`docker compose`, Docker's plugin) when it answers, else the `docker-compose` command:
# Debian 12 packages only v1.29 under that name (what `make system-deps` installs), which reads
# docker-compose.yml as well. `make up COMPOSE='docker compose'` forces one.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: help venv install-server install-dev system-deps demo serve up print-compose test lint typecheck docs bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel

venv: $(BIN)/python ## create the virtual environment

install-server: venv ## install torch ($(TORCH_SPEC)) and stepdoctor with the server extra
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[server]"

install-dev: venv ## install torch and stepdoctor with server, HTA and test tooling
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"

system-deps: ## install Debian chromium (browser tests), docker-compose (compose-file check) and openssl (TLS tests); needs root
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -z "$$missing" ]; then echo "system packages present"; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "missing:$$missing (not root): the tests needing them will be skipped"; fi

demo: install-server ## run the server + dashboard on http://$(HOST):$(PORT) with a demo training run uploading to it
	$(BIN)/python -m stepdoctor_server.demo --host $(HOST) --port $(PORT)

serve: install-server ## run the server only
	$(BIN)/stepdoctor serve --host $(HOST) --port $(PORT)

up: ## start the team deployment of docker-compose.yml with $(COMPOSE) (set POSTGRES_PASSWORD and S3_SECRET_KEY first)
	$(COMPOSE) up --build

print-compose: ## print the compose command `make up` uses
	@echo $(COMPOSE)

lint: ## ruff + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: ## mypy on the packages
	$(BIN)/mypy

test: install-dev system-deps ## install what the tests need, lint, type-check and run the whole suite
	$(MAKE) --no-print-directory lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

docs: ## regenerate docs/rules.md and docs/report.schema.json from the code
	$(BIN)/python tools/gen_docs.py

bench: install-dev ## run the benchmarks under bench/
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

clean: ## remove the venv, caches and local data
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache stepdoctor-data
