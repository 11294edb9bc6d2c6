"""Give every chapter a first cell that makes it run anywhere: downloaded alone, on Colab, on Binder.

    python book/_tools/add_setup_cell.py                      # every notebook, book/*.ipynb
    python book/_tools/add_setup_cell.py book/01_layer_norm.ipynb ...
    python book/_tools/add_setup_cell.py --check              # exit 1 if a notebook lacks it or has an old one

A chapter opened on Colab or Binder, or downloaded from the book, runs in an
environment that may have neither normlib nor the packages the chapter's code
imports (matplotlib, tqdm, scikit-learn, transformers, triton), nor the
records it reads from the book's ``book/data/`` folder. Its first cell checks
for each of them, names exactly those found missing, and installs them:
normlib and the records from a clone of the book's repository
(NORMLIB_REPOSITORY_URL, the setting the build reads for the repository and
launch buttons: book/_ext/repository.py), the packages from PyPI at the floors
of ``pyproject.toml``'s ``book`` and ``triton`` extras (one place for them).
When no repository is configured, it stops instead with a message that names
what is missing and how to install it. In the project's own environment
everything is there and the cell does nothing, so it prints nothing and nbval
has nothing to compare.

What a chapter needs is read from its code: the top-level packages of its
import statements (not the standard library, not torch, which normlib brings,
not IPython, which every Jupyter kernel has) and the string constants that
name a file of ``book/data/``. ``tests/test_book.py`` holds every notebook to
the cell this tool writes; ``make test-standalone`` runs every chapter alone
in a fresh virtual environment from its set-up cell.

The cell is tagged ``remove-cell`` (Jupyter Book leaves it out of the
rendered page; nbval runs it like any other) and ``normlib-setup`` (how this
tool finds it again). Running the tool again is a no-op when the cell is
current: it updates the cell's source if the repository, the chapter's needs
or the text changed, moves it back to the top if it moved, and rewrites a
notebook only when something changed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pprint
import re
import sys
import tomllib
from pathlib import Path

import nbformat

BOOK = Path(__file__).resolve().parents[1]
DATA = BOOK / "data"
TAG = "normlib-setup"
TAGS = ["remove-cell", TAG]
CELL_ID = "normlib-setup"
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn"}
# provided without asking: normlib brings torch; every Jupyter kernel has IPython
PROVIDED = {"normlib", "torch", "IPython"}

HEADER = """\
# Set-up for running this chapter outside the book's own environment (Colab,
# Binder, a downloaded notebook): installs what the chapter needs and is missing,
# or says how. In the book's environment everything is there and it does nothing.
import importlib.util
from pathlib import Path

"""

_NEEDS = """\
# import name -> what pip installs
PACKAGES = {packages}
# files of the book's data/ folder that this chapter reads
DATA = {data}
missing = [pip for name, pip in PACKAGES.items() if importlib.util.find_spec(name) is None]
need_normlib = {need_normlib}
need_data = [f for f in DATA if not (Path("data") / f).exists()]
"""

_INSTALL = """\
if missing or need_normlib or need_data:
    import shutil
    import subprocess
    import sys
    import tempfile

    print("installing what this chapter needs:", ", ".join(missing + ["normlib"] * need_normlib + need_data))
    if missing:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", *missing])
    if need_normlib or need_data:
        with tempfile.TemporaryDirectory() as clone:
            subprocess.check_call(["git", "clone", "--quiet", "--depth", "1", {url!r}, clone])
            if need_normlib:
                subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", clone])
            Path("data").mkdir(exist_ok=True)
            for f in need_data:
                shutil.copy(Path(clone, "book", "data", f), Path("data", f))
    importlib.invalidate_caches()
"""

_EXPLAIN = """\
if missing or need_normlib or need_data:
    raise ModuleNotFoundError(
        "This chapter needs what is not installed here. "
        + (f"Install it with: pip install {' '.join(repr(p) for p in missing)}. " if missing else "")
        + ("It needs normlib, the package the book is built on: install it from a clone of the book's "
           "repository (pip install . in its root; `make lab` there sets up everything and opens the "
           "chapters). " if need_normlib else "")
        + (f"It reads {', '.join(need_data)} from the repository's book/data/ folder: copy those files into "
           "a folder data/ beside this notebook. " if need_data else "")
        + "Then restart the kernel and run the notebook again."
    )
"""


def _repository_url() -> str:
    """The configured repository (NORMLIB_REPOSITORY_URL), normalised as the build does."""
    spec = importlib.util.spec_from_file_location("_normlib_book_repository", BOOK / "_ext" / "repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.repository_url()


def _floors() -> dict[str, str]:
    """Distribution name -> its requirement in pyproject.toml's ``book`` and ``triton`` extras."""
    extras = tomllib.loads((BOOK.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = {}
    for req in extras["book"] + extras["triton"]:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        out[name.lower()] = req
    return out


def _code(nb) -> str:
    """The notebook's code, IPython's magics and shell lines left out, the set-up cell too."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type == "code" and not is_setup_cell(cell):
            lines += [ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
            lines.append("")
    return "\n".join(lines)


def _read(nb) -> tuple[set[str], list[str]]:
    """What a notebook's code names, in one parse: the top-level packages it imports, and the files of
    book/data/ that its string constants name."""
    names, data = set(), set()
    for node in ast.walk(ast.parse(_code(nb))):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value:
            name = node.value.removeprefix("data/")
            if "/" not in name and (DATA / name).is_file():
                data.add(name)
    return names, sorted(data)


def _packages(names: set[str]) -> dict[str, str]:
    """``{import name: pip requirement}`` for the imported ``names`` a set-up cell must install."""
    floors = _floors()
    packages = {}
    for name in sorted(names - PROVIDED - set(sys.stdlib_module_names)):
        dist = DISTRIBUTIONS.get(name, name)
        if dist.lower() not in floors:
            raise SystemExit(f"a notebook imports {name!r}, which pyproject.toml's book and triton extras do not "
                             "list: add it there (the set-up cell installs what they list)")
        packages[name] = floors[dist.lower()]
    return packages


def needs(nb) -> tuple[dict[str, str], list[str]]:
    """What a notebook's code needs: ``({import name: pip requirement}, [files of book/data/])``."""
    names, data = _read(nb)
    return _packages(names), data


def setup_cell_source(repository_url: str | None = None, nb=None) -> str:
    """The set-up cell's source for ``nb`` (its needs; normlib alone if ``None``) and ``repository_url``
    (default: the configured one)."""
    url = _repository_url() if repository_url is None else repository_url.strip().rstrip("/")
    names, data = _read(nb) if nb is not None else ({"normlib"}, [])
    body = _NEEDS.format(packages=pprint.pformat(_packages(names), width=100), data=pprint.pformat(data, width=100),
                         need_normlib='importlib.util.find_spec("normlib") is None' if "normlib" in names else "False")
    return HEADER + body + (_INSTALL.format(url=url) if url else _EXPLAIN)


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
    return sorted(BOOK.glob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook, book/*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs updating")
    parser.add_argument("--repository", help="the repository URL (default: $NORMLIB_REPOSITORY_URL)")
    args = parser.parse_args(argv)
    stale = []
    for path in args.notebooks or chapters():
        nb = nbformat.read(path, as_version=4)
        if not update(nb, setup_cell_source(args.repository, nb)):
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
