"""Sphinx extension: the live cells, code the reader edits and runs in the page, with no server.

A code cell tagged ``live`` (pure Python: the standard library and :mod:`normlib.pure`) is
executed by nbval like any other, and its stored output is what the page shows. On a page that
has one, ``live/live-cells.js`` makes it editable and gives it a Run button; the first Run starts
``live/live-worker.mjs``, a worker that loads Pyodide (Python compiled to WebAssembly) from the
build's own ``pyodide/`` folder (``make book`` copies it from npm, like MathJax) and runs the
cell there, with the part of normlib that needs no torch (``MODULES``, copied to
``_static/live/normlib/`` with a list of them that the worker reads). A reader who never presses Run
loads the script and its stylesheet (a few kilobytes) and nothing else; pages without a live
cell load neither.
"""

import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent / "live"
TAG = "live"
# normlib's modules that the live cells can import in the browser: the standard library only, no torch
MODULES = ("errors.py", "pure.py")


def _static_path(app, config):
    config.html_static_path.append(str(HERE))


def _page(app, pagename, templatename, context, doctree):
    if f"tag_{TAG}" in context.get("body", ""):
        app.add_css_file("live-cells.css")
        app.add_js_file("live-cells.js")


def _modules(app, exception):
    if exception is None and app.builder.format == "html":
        dest = Path(app.outdir) / "_static" / "live" / "normlib"
        dest.mkdir(parents=True, exist_ok=True)
        for name in MODULES:
            shutil.copy(Path(app.srcdir) / "normlib" / name, dest / name)
        (dest / "files.json").write_text(json.dumps(list(MODULES)) + "\n", encoding="utf-8")


def setup(app):
    app.connect("config-inited", _static_path)
    app.connect("html-page-context", _page)
    app.connect("build-finished", _modules)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
