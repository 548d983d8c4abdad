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
# The suite runs in this many pytest-xdist processes, a test file per process at a time (its
# module fixtures are built once). 0: serially. On 2 cores it gains little (measured: 18.6 min
# serial, 18.7 with 2 workers): the torch subprocesses and servers keep both cores busy already.
PYTEST_WORKERS ?= 2
# `make test LINT=0` skips lint and mypy (`make check` runs only those).
LINT ?= 1
# Compose v2 (`docker compose`, Docker's plugin) when it answers, else the `docker-compose` command:
# Debian 12 packages only v1.29 under that name (what `make system-deps` installs), which reads
# docker-compose.yml as well. `make up COMPOSE='docker compose'` forces one.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: help venv install-server install-dev system-deps wheel demo serve up print-compose test check lint typecheck docs bench clean

# The variables the `## ` descriptions name, as `NAME=value` words for env: help prints their values.
HELP_VARS = $(sort $(shell sed -n 's/^[a-z-]*:.*## //p' $(MAKEFILE_LIST) | grep -oE '\$$\([A-Z_]+\)' | tr -d '$$()'))
shell_quote = '$(subst ','\'',$(1))'

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) \
	| env $(foreach v,$(HELP_VARS),$(call shell_quote,$(v)=$($(v)))) awk -F':.*## ' \
	  '{ text = $$2; while (match(text, /\$$\([A-Z_]+\)/)) \
	     text = substr(text, 1, RSTART - 1) ENVIRON[substr(text, RSTART + 2, RLENGTH - 3)] substr(text, RSTART + RLENGTH); \
	     printf "  %-16s %s\n", $$1, text }'

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

wheel: venv ## build dist/stepdoctor-*.whl, as the Dockerfile does (README: Install)
	$(BIN)/python -m pip wheel --no-deps -w dist .

system-deps: ## install Debian chromium (browser tests), docker-compose (compose-file check) and openssl (TLS tests); needs root
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -z "$$missing" ]; then echo "system packages present"; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "missing:$$missing (not root): the tests needing them will be skipped"; fi

demo: install-server ## run the server + dashboard on http://$(HOST):$(PORT) with demo runs uploading to it (data in $(STEPDOCTOR_DATA_DIR))
	$(BIN)/python -m stepdoctor_server.demo --host $(HOST) --port $(PORT)

serve: install-server ## run the server only
	$(BIN)/stepdoctor serve --host $(HOST) --port $(PORT)

up: ## start the team deployment of docker-compose.yml with $(COMPOSE) (POSTGRES_PASSWORD and S3_SECRET_KEY set, or in .env)
	$(COMPOSE) up --build

print-compose: ## print the compose command `make up` uses
	@echo $(COMPOSE)

check: lint typecheck ## lint and type-check only

lint: ## ruff + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: ## mypy on the packages
	$(BIN)/mypy

test: install-dev system-deps ## install what the tests need, `make check` (unless LINT=0) and run the suite
ifneq ($(LINT),0)
	$(MAKE) --no-print-directory check
endif
	$(BIN)/python -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile )$(PYTEST_ARGS)

docs: ## regenerate docs/rules.md and docs/report.schema.json from the code
	$(BIN)/python tools/gen_docs.py

bench: install-dev ## run the benchmarks under bench/
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

clean: ## remove the venv, build output, caches and local data (stepdoctor-data/: database, traces, demo spool)
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache stepdoctor-data
