"""The chapters' live cells (code cells tagged ``live``, book/_ext/live_cells.py): what lets the page run them.

The page runs a live cell's code in Pyodide, with the standard library and normlib.pure only, and shows what it
prints; nbval runs the same code in the notebook and checks the stored output. So a live cell may import nothing
else, must print everything it shows (a bare last expression would be displayed by Jupyter but not by the page),
and is followed by the normlib cell it is the pure-Python twin of. The browser runs them in tests/test_site.py.
"""

import ast
import sys
from pathlib import Path

import nbformat
import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
TAG = "live"
CHAPTERS = ("01_layer_norm", "03_layer_norm_vs_batch_norm", "05_normalization_families", "06_attention_by_hand")


def _live_cells():
    for path in sorted(BOOK.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        for i, cell in enumerate(code):
            if TAG in cell.metadata.get("tags", []):
                yield path.stem, cell, code[i + 1] if i + 1 < len(code) else None


LIVE = list(_live_cells())


def test_the_chapters_named_have_live_cells():
    have = {chapter for chapter, _, _ in LIVE}
    assert set(CHAPTERS) <= have, set(CHAPTERS) - have


@pytest.mark.parametrize("chapter,cell,twin", LIVE, ids=[f"{ch}:{c.id}" for ch, c, _ in LIVE])
def test_a_live_cell_runs_in_the_browser_as_in_the_notebook(chapter, cell, twin):
    tree = ast.parse(cell.source)
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {f"{n.module}.{a.name}" if n.module == "normlib" else n.module
                for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    outside = {m for m in modules if m != "normlib.pure" and m.split(".")[0] not in sys.stdlib_module_names}
    assert not outside, f"{chapter}:{cell.id} imports what the page's Python lacks: {outside}"
    assert not any(line.lstrip().startswith(("%", "!")) for line in cell.source.splitlines()), "IPython syntax"
    assert cell.outputs and all(o.output_type == "stream" and o.name == "stdout" for o in cell.outputs), (
        f"{chapter}:{cell.id}: the page shows only what a cell prints (stdout), and it must print something")
    assert not set(cell.metadata.get("tags", [])) & {"raises-exception", "nbval-ignore-output", "remove-cell",
                                                     "remove-input", "hide-input"}, cell.metadata["tags"]
    assert twin is not None and "nl." in twin.source, f"{chapter}:{cell.id} is not followed by its normlib twin"
