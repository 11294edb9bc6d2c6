"""Execute chapters top to bottom in this environment and store their outputs.

    python book/_tools/execute_notebooks.py book/*.ipynb

Each notebook runs in a fresh kernel from the book/ folder (so relative data
paths work the same as under nbval), with a fixed hash seed; volatile
metadata (execution timestamps, widget state) is dropped so that re-running
an unchanged notebook gives an unchanged file.
"""

from __future__ import annotations

import datetime as dt
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
RECORD = Path(__file__).resolve().parents[1] / "data" / "executed_with.json"
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
    data = json.loads(RECORD.read_text()) if RECORD.exists() else {"notebooks": {}}
    env = environment()
    for p in paths:
        if p.name not in NOT_RECORDED:
            data["notebooks"][p.name] = env
    data["notebooks"] = dict(sorted(data["notebooks"].items()))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(data, indent=1) + "\n")


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["TQDM_DISABLE"] = "True"  # progress bars are for runs by hand (see book/conftest.py)
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
    chapters = sorted((Path(p) for p in paths), key=lambda p: p.name in NOT_RECORDED)
    done = []
    for p in chapters:
        if p.name in NOT_RECORDED:
            record(done)  # the record must be complete before the page that shows it runs
            done = []
        seconds = execute(p)
        print(f"executed {p} in {seconds:.1f} s")
        done.append(p)
    record(done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
