# Two entry points do all the set-up on a fresh machine:
#   make book   create .venv if missing, install everything, build the HTML book
#   make test   same set-up, then every test (library, notebooks, built site)
# and one to read the chapters interactively:
#   make lab    same set-up plus JupyterLab (installed by this target only), opened on book/
# The repository the book links to is one setting, read by the build and the tests:
#   NORMLIB_REPOSITORY_URL=https://github.com/<owner>/<repo> make book
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS := --quiet --disable-pip-version-check --no-input
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
# MathJax is served from the build itself (no CDN): installed from npm, trimmed, and
# copied into the HTML output through html_extra_path (see _config.yml).
MATHJAX := _assets/mathjax/tex-mml-chtml.js
MATHJAX_SRC := node_modules/mathjax/es5
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=120

# JupyterLab for `make lab`: an optional extra, installed into $(VENV) by that target only.
JUPYTERLAB := jupyterlab>=4,<5
LAB_STAMP := $(VENV)/.lab-installed

.PHONY: help install book test test-lib test-notebooks test-site test-cuda test-torch-matrix notebooks setup-cells lab clean

help:
	@echo "make book       build the book, English and Chinese, into _build/html (sets up $(VENV) first)"
	@echo "make test       run every test (sets up $(VENV) first)"
	@echo "make test-cuda  on a CUDA machine: the compiled kernels at realistic shapes"
	@echo "make test-torch-matrix  the library tests on the other torch releases (CI runs it; ~15 GB of venvs)"
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

$(MATHJAX_SRC)/tex-mml-chtml.js: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

$(MATHJAX): $(MATHJAX_SRC)/tex-mml-chtml.js
	rm -rf _assets/mathjax
	mkdir -p _assets/mathjax/output/chtml/fonts _assets/mathjax/input/tex
	cp $(MATHJAX_SRC)/tex-mml-chtml.js _assets/mathjax/
	cp -r $(MATHJAX_SRC)/output/chtml/fonts/woff-v2 _assets/mathjax/output/chtml/fonts/
	cp -r $(MATHJAX_SRC)/input/tex/extensions _assets/mathjax/input/tex/

# Both editions: the English book into _build/html, then the Chinese edition
# (the same chapters with translated prose, book/zh/) into _build/html/zh.
book: $(STAMP) $(MATHJAX)
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	$(BIN)/python book/_tools/zh_edition.py build
	@echo
	@echo "The book is built. Open: file://$(CURDIR)/_build/html/index.html (中文版: _build/html/zh/index.html)"
	@test -n "$$NORMLIB_REPOSITORY_URL" || echo "(NORMLIB_REPOSITORY_URL is not set: no repository or launch buttons; see the README)"

test: test-lib test-notebooks test-site

test-lib: $(STAMP)
	$(BIN)/python -m pytest tests -n 2
	$(BIN)/python -m pytest --doctest-modules normlib -p no:cacheprovider -q
	$(BIN)/python -m mypy

# The library tests on the lowest torch pyproject.toml allows, on 2.11 and on the
# newest release, each in its own venv under .venv-torch/ (the pin is test-lib's).
test-torch-matrix: $(STAMP)
	$(BIN)/python .ci/torch_matrix.py setup
	$(BIN)/python .ci/torch_matrix.py run

# Every chapter twice: once as this machine runs it, once as another CPU would.
# ATen picks its vector kernels by CPU (AVX-512 on many Intel machines, AVX2 on
# others), and reductions and matrix products round differently between them and
# between thread counts; a stored output has to hold on every x86-64 CPU, so the
# second pass forces ATen's portable kernels and one thread
# (ATEN_CPU_CAPABILITY=default, OMP_NUM_THREADS=1), which round differently
# from this machine's own. The first failing pass stops the target.
PORTABLE_CPU := ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

test-notebooks: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks under book/ yet"
else
	$(BIN)/python -m pytest $(NBVAL) $(NOTEBOOKS)
	@echo "The chapters again, as another CPU computes them: $(PORTABLE_CPU)"
	$(PORTABLE_CPU) $(BIN)/python -m pytest $(NBVAL) $(NOTEBOOKS)
endif

# The built book: its links and buttons (always), then every page in headless
# Chromium (Debian's chromium + chromium-driver). Without Chromium the browser
# checks are skipped with a message and the target still passes; CI sets
# NORMLIB_REQUIRE_BROWSER=1, which turns a missing browser into a failure.
test-site: book
	NORMLIB_SITE_DIR=_build/html $(BIN)/python -m pytest tests/test_site.py -rs

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
