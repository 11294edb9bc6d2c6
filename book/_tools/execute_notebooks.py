"""Execute chapters top to bottom in this environment and store their outputs.

    python book/_tools/execute_notebooks.py book/*.ipynb

Each notebook runs in a fresh kernel from the book/ folder (so relative data
paths work the same as under nbval), with a fixed hash seed and the IPython
settings in book/_tools/ipython (tracebacks without machine paths, SVG
figures; book/conftest.py gives nbval's kernels the same); volatile metadata
(execution timestamps, widget state) is dropped so that re-running an
unchanged notebook gives an unchanged file.

The versions of the packages each chapter ran with are recorded in
book/data/executed_with.json, and the page that shows them
(book/versions.ipynb) is re-executed after any chapter, so that its stored
table never lags behind the record (nbval would fail on it otherwise).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
BOOK = Path(__file__).resolve().parents[1]
RECORD = BOOK / "data" / "executed_with.json"
VERSIONS_PAGE = BOOK / "versions.ipynb"
# IPython settings for the chapters' kernels (also used by nbval: book/conftest.py)
IPYTHONDIR = BOOK / "_tools" / "ipython"
PACKAGES = ("torch", "triton", "numpy", "matplotlib", "normlib")
# Pages that only display the record are not themselves recorded in it.
NOT_RECORDED = {"versions.ipynb"}


def environment() -> dict:
    """The versions of this environment, read from the installed packages, not typed by hand."""
    env = {"python": platform.python_version(), "machine": platform.machine()}
    for name in PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    env["executed"] = dt.datetime.now(dt.timezone.utc).date().isoformat()
    return env


def record(paths: list[Path]) -> None:
    text = RECORD.read_text() if RECORD.exists() else ""
    data = json.loads(text) if text.strip() else {"notebooks": {}}
    env = environment()
    for p in paths:
        if p.name not in NOT_RECORDED:
            data["notebooks"][p.name] = env
    data["notebooks"] = dict(sorted(data["notebooks"].items()))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(data, indent=1) + "\n")


def kernel_environment() -> None:
    """The environment the chapters' kernels inherit (the same as under nbval: book/conftest.py)."""
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["TQDM_DISABLE"] = "True"  # progress bars are for runs by hand
    os.environ["IPYTHONDIR"] = str(IPYTHONDIR)


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    kernel_environment()
    os.environ["SOURCE_DATE_EPOCH"] = "0"  # no timestamp in SVG figures (book/matplotlibrc fixes their ids)
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
    chapters = [Path(p) for p in paths if Path(p).name not in NOT_RECORDED]
    for p in chapters:
        seconds = execute(p)
        print(f"executed {p} in {seconds:.1f} s")
    # Record, then show the record: one process at a time (several people may be
    # executing chapters in the same checkout), holding a lock on the record.
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.touch()
    with open(RECORD, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if chapters:
            record(chapters)
        pages = [Path(p) for p in paths if Path(p).name in NOT_RECORDED]
        if chapters and VERSIONS_PAGE.exists() and not any(p.resolve() == VERSIONS_PAGE for p in pages):
            pages.append(VERSIONS_PAGE)
        for p in pages:
            seconds = execute(p)
            print(f"executed {p} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
