"""Execute chapters top to bottom in this environment and store their outputs.

    python book/_tools/execute_notebooks.py book/*.ipynb

Each notebook runs in a fresh kernel from the book/ folder (so relative data
paths work the same as under nbval), with a fixed hash seed; volatile
metadata (execution timestamps, widget state) is dropped so that re-running
an unchanged notebook gives an unchanged file.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["TQDM_DISABLE"] = "True"  # progress bars are for runs by hand (see book/conftest.py)
    start = time.perf_counter()
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
    nb.metadata = {
        "kernelspec": KERNELSPEC,
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return elapsed


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: execute_notebooks.py NOTEBOOK.ipynb ...", file=sys.stderr)
        return 2
    for p in paths:
        seconds = execute(Path(p))
        print(f"executed {p} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
