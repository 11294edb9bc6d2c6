"""Give every chapter a first cell that makes `import normlib` work anywhere.

    python book/_tools/add_setup_cell.py                      # every chapter, book/[0-9]*.ipynb
    python book/_tools/add_setup_cell.py book/01_layer_norm.ipynb ...
    python book/_tools/add_setup_cell.py --check              # exit 1 if a chapter lacks it or has an old one

A chapter opened on Colab or Binder, or downloaded from the book, runs in an
environment that may not have normlib. Its first cell installs normlib there,
from the book's repository (NORMLIB_REPOSITORY_URL, the setting the build
reads for the repository and launch buttons: book/_ext/repository.py), or,
when no repository is configured, stops with a message that says how to
install it. In the project's own environment normlib is importable and the
cell does nothing, so it prints nothing and nbval has nothing to compare.

The cell is tagged ``remove-cell`` (Jupyter Book leaves it out of the
rendered page; nbval runs it like any other) and ``normlib-setup`` (how this
tool finds it again). Running the tool again is a no-op when the cell is
current: it updates the cell's source if the repository or the text changed,
moves it back to the top if it moved, and rewrites a notebook only when
something changed. After adding the cell, re-execute the chapters
(`make notebooks`) so that their execution counts run from the top again.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import nbformat

BOOK = Path(__file__).resolve().parents[1]
TAG = "normlib-setup"
TAGS = ["remove-cell", TAG]
CELL_ID = "normlib-setup"

HEADER = """\
# Set-up for running this chapter outside the book's own environment (Colab,
# Binder, a downloaded notebook): if normlib cannot be imported, install it from
# the book's repository when one was configured, or explain how to install it.
# In the book's environment normlib is installed and this cell does nothing.
import importlib.util
"""

_INSTALL = """\
if importlib.util.find_spec("normlib") is None:
    import subprocess
    import sys

    print("normlib is not installed here: installing it from {url} ...")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "git+{url}"])
    importlib.invalidate_caches()
"""

_EXPLAIN = """\
if importlib.util.find_spec("normlib") is None:
    raise ModuleNotFoundError(
        "This chapter needs normlib, the package the book is built on. Install it from a clone "
        "of the book's repository (pip install -e . in its root; `make lab` there sets up "
        "everything and opens the chapters), or with pip install git+<the repository's URL>; "
        "then restart the kernel and run the notebook again."
    )
"""


def _repository_url() -> str:
    """The configured repository (NORMLIB_REPOSITORY_URL), normalised as the build does."""
    spec = importlib.util.spec_from_file_location("_normlib_book_repository", BOOK / "_ext" / "repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.repository_url()


def setup_cell_source(repository_url: str | None = None) -> str:
    """The set-up cell's source for ``repository_url`` (default: the configured one)."""
    url = _repository_url() if repository_url is None else repository_url.strip().rstrip("/")
    return HEADER + (_INSTALL.format(url=url) if url else _EXPLAIN)


def is_setup_cell(cell) -> bool:
    return cell.cell_type == "code" and TAG in cell.get("metadata", {}).get("tags", [])


def update(nb, source: str) -> bool:
    """Put the current set-up cell first in ``nb``; return whether anything changed."""
    found = [i for i, c in enumerate(nb.cells) if is_setup_cell(c)]
    changed = False
    if found:
        cell = nb.cells[found[0]]
        for i in reversed(found[1:]):  # keep one
            del nb.cells[i]
            changed = True
        if found[0] != 0:
            nb.cells.insert(0, nb.cells.pop(found[0]))
            changed = True
        if cell.source != source:
            cell.source = source
            cell.outputs = []
            changed = True
        tags = cell.metadata.get("tags", [])
        if any(t not in tags for t in TAGS):
            cell.metadata["tags"] = tags + [t for t in TAGS if t not in tags]
            changed = True
    else:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": list(TAGS)})
        if nb.nbformat_minor >= 5:
            ids = {c.get("id") for c in nb.cells}
            cell.id = CELL_ID if CELL_ID not in ids else cell.id
        else:
            cell.pop("id", None)
        nb.cells.insert(0, cell)
        changed = True
    return changed


def chapters() -> list[Path]:
    return sorted(BOOK.glob("[0-9]*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every chapter, book/[0-9]*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs updating")
    parser.add_argument("--repository", help="the repository URL (default: $NORMLIB_REPOSITORY_URL)")
    args = parser.parse_args(argv)
    source = setup_cell_source(args.repository)
    stale = []
    for path in args.notebooks or chapters():
        nb = nbformat.read(path, as_version=4)
        if not update(nb, source):
            continue
        stale.append(path)
        if not args.check:
            nbformat.validate(nb)
            nbformat.write(nb, path)
            print(f"set-up cell written: {path}")
    if args.check and stale:
        print("set-up cell missing or out of date (run book/_tools/add_setup_cell.py):", *map(str, stale), sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
