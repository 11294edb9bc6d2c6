# Two entry points do all the set-up on a fresh machine:
#   make book   create .venv if missing, install everything, build the HTML book
#   make test   same set-up, then every test (library, notebooks, built site)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS := --quiet --disable-pip-version-check --no-input
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=120

.PHONY: help install book test test-lib test-notebooks notebooks clean

help:
	@echo "make book       build the book into _build/html (sets up $(VENV) first)"
	@echo "make test       run every test (sets up $(VENV) first)"
	@echo "make notebooks  re-execute the chapters in place, storing fresh outputs"
	@echo "make clean      remove _build"

# The environment: torch and triton pinned by constraints.txt (the CPU wheel of
# torch 2.13.0 where it lies on disk), normlib installed editable with all extras.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev]'
	@touch $@

install: $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	@echo
	@echo "The book is built. Open: file://$(CURDIR)/_build/html/index.html"

test: test-lib test-notebooks

test-lib: $(STAMP)
	$(BIN)/python -m pytest tests -n 2

test-notebooks: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks under book/ yet"
else
	$(BIN)/python -m pytest $(NBVAL) $(NOTEBOOKS)
endif

notebooks: $(STAMP)
	$(BIN)/python book/_tools/execute_notebooks.py $(NOTEBOOKS)

clean:
	rm -rf _build
