# Two entry points do all the set-up on a fresh machine:
#   make book   create .venv if missing, install everything, build the HTML book
#   make test   same set-up, then every test (library, notebooks, built site)
# and one for the edit-test loop (under a minute once set up):
#   make check  lint, type check and the fast library tests
# and one to read the chapters interactively:
#   make lab    same set-up plus JupyterLab (installed by this target only), opened on book/
# The repository the book links to is one setting, read by the build, the tests and setup.py (the project URLs):
#   NORMLIB_REPOSITORY_URL=https://github.com/<owner>/<repo> make book
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS := --quiet --disable-pip-version-check --no-input
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
# What the book serves itself (no CDN) comes from npm (package.json, package-lock.json), installed once:
# MathJax, trimmed, and Pyodide, the Python the live cells run in the browser (book/_ext/live_cells.py);
# both are copied into _assets/, which lands at the root of the HTML output (html_extra_path, _config.yml).
NPM_STAMP := node_modules/.installed
MATHJAX := _assets/mathjax/tex-mml-chtml.js
MATHJAX_SRC := node_modules/mathjax/es5
PYODIDE := _assets/pyodide/pyodide.mjs
# the loader, the interpreter, the standard library and the package list Pyodide reads when it starts
PYODIDE_FILES := pyodide.mjs pyodide.asm.mjs pyodide.asm.wasm python_stdlib.zip pyodide-lock.json
# The cell timeout catches a hung cell, not a slow machine: chapter 05b's longest cell takes
# 26 s alone on a 2-core Xeon and more than 120 s while make test's phases share the cores.
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

# JupyterLab for `make lab`: an optional extra, installed into $(VENV) by that target only.
JUPYTERLAB := jupyterlab>=4,<5
LAB_STAMP := $(VENV)/.lab-installed

.PHONY: help install book check test test-lib test-unit test-doctests test-types test-notebooks test-notebooks-here \
	test-notebooks-portable test-site test-standalone test-cuda test-torch-matrix notebooks setup-cells lab clean

help:
	@echo "make book       build the book, English and Chinese, into _build/html (sets up $(VENV) first)"
	@echo "make test       run every test (sets up $(VENV) first; its phases side by side)"
	@echo "make check      lint, types and the fast library tests: the edit-test loop (under a minute)"
	@echo "make test-cuda  on a CUDA machine: the compiled kernels at realistic shapes"
	@echo "make test-torch-matrix  the library tests on the other torch releases (CI runs it; keeps ~17 GB of venvs)"
	@echo "make test-standalone  every chapter alone in a fresh venv, from its set-up cell (~8 minutes)"
	@echo "make notebooks  re-execute the chapters in place, storing fresh outputs"
	@echo "make lab        open the chapters in JupyterLab with this environment (installs JupyterLab)"
	@echo "make setup-cells  give every chapter its set-up cell (then: make notebooks)"
	@echo "make clean      remove _build"

# The environment: torch and triton pinned by constraints.txt (the CPU wheel of
# torch 2.13.0 where it lies on disk), normlib installed editable with all extras.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev]'
	@touch $@

install: $(STAMP)

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

$(MATHJAX): $(NPM_STAMP)
	rm -rf _assets/mathjax
	mkdir -p _assets/mathjax/output/chtml/fonts _assets/mathjax/input/tex
	cp $(MATHJAX_SRC)/tex-mml-chtml.js _assets/mathjax/
	cp -r $(MATHJAX_SRC)/output/chtml/fonts/woff-v2 _assets/mathjax/output/chtml/fonts/
	cp -r $(MATHJAX_SRC)/input/tex/extensions _assets/mathjax/input/tex/

$(PYODIDE): $(NPM_STAMP)
	rm -rf _assets/pyodide
	mkdir -p _assets/pyodide
	cp $(addprefix node_modules/pyodide/,$(PYODIDE_FILES)) _assets/pyodide/

# Both editions: the English book into _build/html, then the Chinese edition
# (the same chapters with translated prose, book/zh/) into _build/html/zh.
# The Chinese font the book serves (Noto Sans SC from npm, the slices holding the characters the
# pages use): book/_tools/cjk_font.py writes _assets/cjk/ before each build (a second or two).
book: $(STAMP) $(MATHJAX) $(PYODIDE)
	$(BIN)/python book/_tools/cjk_font.py
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	$(BIN)/python book/_tools/zh_edition.py build
	@echo
	@echo "The book is built. Open: file://$(CURDIR)/_build/html/index.html (中文版: _build/html/zh/index.html)"
	@test -n "$$NORMLIB_REPOSITORY_URL" || echo "(NORMLIB_REPOSITORY_URL is not set: no repository or launch buttons; see the README)"

# `make test` runs its phases side by side: the library tests keep both cores
# busy, the notebooks (two passes), the book build with its browser checks,
# the doctests and mypy are mostly one core each, and they interleave. Each
# phase's output is printed whole when it ends (--output-sync), then one line
# of times. TEST_JOBS phases run at once.
TEST_PHASES := test-unit test-notebooks-here test-notebooks-portable test-site test-doctests test-types
TEST_JOBS ?= 4
test: $(STAMP)
	@echo "make test: $(TEST_PHASES), $(TEST_JOBS) at a time; each phase's output appears when it ends"
	@mkdir -p _build/phases && rm -f _build/phases/*
	@start=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target -k $(TEST_PHASES) || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s in all; by phase: $$(cat _build/phases/* 2>/dev/null | tr '\n' ' ')"; \
	exit $$status

# One phase's wall time, for the summary line above.
TIMED = @mkdir -p _build/phases; t0=$$(date +%s); trap 'echo "$@ $$(( $$(date +%s) - t0 ))s" > _build/phases/$@' EXIT;

# The library's tests, doctests and type check (test-lib: the three in turn).
test-lib: test-unit test-doctests test-types

test-unit: $(STAMP)
	$(TIMED) $(BIN)/python -m pytest tests -n 2 --dist worksteal -p no:cacheprovider

test-doctests: $(STAMP)
	$(TIMED) $(BIN)/python -m pytest --doctest-modules normlib -p no:cacheprovider -q

test-types: $(STAMP)
	$(TIMED) $(BIN)/python -m mypy

# The edit-test loop: pyflakes' checks, mypy and the library tests not marked
# slow (tests/conftest.py names the slow modules), side by side.
check: $(STAMP)
	@start=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory -j3 --output-sync=target -k check-lint test-types check-fast || status=$$?; \
	echo "make check: $$(( $$(date +%s) - start )) s"; exit $$status

check-lint: $(STAMP)
	$(BIN)/ruff check

check-fast: $(STAMP)
	$(BIN)/python -m pytest tests -n 2 -q -m "not slow" -p no:cacheprovider

# The library tests on the lowest torch pyproject.toml allows, on 2.11 and on the
# newest release, each in its own venv under .venv-torch/ (the pin is test-lib's).
test-torch-matrix: $(STAMP)
	$(BIN)/python .ci/torch_matrix.py run

# Every chapter twice: once as this machine runs it, once as another CPU would.
# ATen picks its vector kernels by CPU (AVX-512 on many Intel and AMD Zen 4
# machines, AVX2 on others), MKL picks the code path of its matrix products by
# CPU and vendor, and reductions and matrix products round differently between
# them and between thread counts; a stored output has to hold on every x86-64
# CPU, so the second pass forces ATen's portable kernels, MKL's CPU-independent
# code path and one thread (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE,
# OMP_NUM_THREADS=1). The two passes run side by side under `make test`. Every
# combination this CPU offers: book/_tools/stability.py (see the README).
PORTABLE_CPU := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

test-notebooks: test-notebooks-here test-notebooks-portable

test-notebooks-here: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks under book/ yet"
else
	$(TIMED) $(BIN)/python -m pytest $(NBVAL) -p no:cacheprovider $(NOTEBOOKS)
endif

test-notebooks-portable: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks under book/ yet"
else
	@echo "The chapters as another CPU computes them: $(PORTABLE_CPU)"
	$(TIMED) $(PORTABLE_CPU) $(BIN)/python -m pytest $(NBVAL) -p no:cacheprovider $(NOTEBOOKS)
endif

# The built book: its links and buttons (always), then every page in headless
# Chromium (Debian's chromium + chromium-driver). Without Chromium the browser
# checks are skipped with a message and the target still passes; CI sets
# NORMLIB_REQUIRE_BROWSER=1, which turns a missing browser into a failure.
test-site: book
	$(TIMED) NORMLIB_SITE_DIR=_build/html $(BIN)/python -m pytest tests/test_site.py -rs -p no:cacheprovider

# Every notebook as a reader who downloaded it runs it: alone, in a fresh venv (torch and a
# Jupyter kernel only), from its set-up cell, which installs the rest (book/_tools/standalone.py).
# make test runs two of them (tests/test_standalone.py); this runs all, about eight minutes.
test-standalone: $(STAMP)
	$(BIN)/python book/_tools/standalone.py

# The compiled kernels on a GPU (skipped without one); not part of CI, which has none.
test-cuda: $(STAMP)
	TRITON_INTERPRET=0 $(BIN)/python -m pytest tests/test_ops_cuda.py tests/test_fused_api.py -n 0

notebooks: $(STAMP)
	$(BIN)/python book/_tools/execute_notebooks.py $(NOTEBOOKS)

# The first cell of every chapter, which installs normlib on Colab/Binder/a download
# (from NORMLIB_REPOSITORY_URL when set). Re-execute the chapters afterwards.
setup-cells: $(STAMP)
	$(BIN)/python book/_tools/add_setup_cell.py

$(LAB_STAMP): $(STAMP)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt '$(JUPYTERLAB)'
	@touch $@

# The chapters in JupyterLab, with the kernel of $(VENV) (normlib installed editable,
# so changes to normlib/ show after a kernel restart).
lab: $(LAB_STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=book

clean:
	rm -rf _build _assets .venv-torch
