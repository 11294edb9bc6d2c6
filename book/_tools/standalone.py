"""Run chapters as a reader who downloaded one would: alone, in a fresh virtual environment, from its set-up cell.

    python book/_tools/standalone.py                       # every notebook, book/*.ipynb
    python book/_tools/standalone.py book/05b_does_normalization_help.ipynb ...
    python book/_tools/standalone.py --keep /tmp/standalone   # keep the venv and the runs there

The environment is what a reader starts from: a new virtual environment with
torch (this environment's, linked in with the distributions it requires) and
a Jupyter kernel (``nbclient``, ``ipykernel``), nothing else: no normlib, no
matplotlib, no transformers.
The book's repository is this working tree, copied into a git repository of
its own (tracked and untracked files, not ignored ones), standing in for
NORMLIB_REPOSITORY_URL. Each notebook is copied alone into an empty folder,
and then:

1. its first cell as committed (the cell for a book without a configured
   repository) must stop with a message that names what is missing (every
   notebook's, before anything is installed);
2. with the set-up cell for a configured repository (the one a deployed book
   has, pointed at the stand-in), the notebook must run top to bottom
   without an error: the cell installs the packages (from PyPI, at the
   versions of ``constraints.txt``, so that a run is reproducible) and
   normlib and the records from a clone of the repository.

Outputs are not compared (nbval does that in the book's own environment):
this checks that a chapter has everything it needs. The packages the first
chapter installs stay in the venv, so the later chapters check only what
they need beyond it; each chapter is still run in a folder of its own, so
the records of book/data/ are fetched for each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import nbformat

BOOK = Path(__file__).resolve().parents[1]
ROOT = BOOK.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_book_tool_{name}", BOOK / "_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_cell = _tool("add_setup_cell")

_RUN = """
import sys, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
path, limit = sys.argv[1], float(sys.argv[2])
nb = nbformat.read(path, as_version=4)
try:
    NotebookClient(nb, timeout=limit, kernel_name="python3", resources={"metadata": {"path": sys.argv[3]}}).execute()
except CellExecutionError as e:
    print(str(e)[-4000:])
    sys.exit(1)
nbformat.write(nb, path)
"""


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


def repository(where: Path) -> str:
    """The working tree as a repository of its own at ``where``; its URL."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            dst = where / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    _git("init", "-q", cwd=where)
    _git("add", "-A", cwd=where)
    _git("-c", "user.name=standalone", "-c", "user.email=standalone@localhost", "commit", "-q", "-m", "tree",
         cwd=where)
    return where.resolve().as_uri()


def _torch_only(site: Path) -> None:
    """``site``: links to this environment's torch and the distributions it requires, nothing else."""
    from packaging.requirements import Requirement

    seen, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)


def fresh_venv(where: Path, env: dict) -> Path:
    """A virtual environment with torch and a Jupyter kernel only; its python.

    torch is this environment's, linked in (with the distributions it
    requires) through a ``.pth`` file rather than installed again: the same
    release a reader's torch would be, without a gigabyte of disk per run.
    """
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    python = where / "bin" / "python"
    site = where / "torch-site"
    site.mkdir()
    _torch_only(site)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "torch-only.pth").write_text(str(site.resolve()) + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "nbclient", "nbformat", "ipykernel"],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not set up the fresh venv:\n{done.stderr[-3000:]}")
    found = subprocess.run([str(python), "-c", "import torch, importlib.util as u; "
                            "print(torch.__version__, u.find_spec('matplotlib') is None)"],
                           capture_output=True, text=True, env=env)
    if found.stdout.split() != [metadata.version("torch"), "True"]:
        raise SystemExit(f"the fresh venv is not torch alone: {found.stdout}{found.stderr[-2000:]}")
    return python


def probe(notebook: Path, python: Path, folder: Path, env: dict) -> tuple[bool, str]:
    """``(passed, what happened)`` for the committed set-up cell (no repository configured) of ``notebook``,
    in a venv that has nothing of what it needs: it must stop with the message naming what is missing."""
    folder.mkdir(parents=True)
    committed = nbformat.read(notebook, as_version=4).cells[0]
    done = subprocess.run([str(python), "-c", committed.source], cwd=folder, capture_output=True, text=True,
                          env=env, timeout=120)
    said = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode == 0 or not said.startswith("ModuleNotFoundError: This chapter needs"):
        return False, f"its committed set-up cell did not stop with its message: {done.stderr[-800:]}"
    return True, said.removeprefix("ModuleNotFoundError: ")


def run(notebook: Path, python: Path, url: str, folder: Path, env: dict, limit: float) -> tuple[bool, str]:
    """``(passed, what happened)`` for one notebook downloaded alone into ``folder``, with the set-up cell of a
    book whose repository is ``url``: it installs what is missing, and the chapter runs top to bottom."""
    folder.mkdir(parents=True)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells[0].source = setup_cell.setup_cell_source(url, nb)
    path = folder / notebook.name
    nbformat.write(nb, path)
    t0 = time.monotonic()
    done = subprocess.run([str(python), "-c", _RUN, str(path), str(limit), str(folder)], cwd=folder,
                          capture_output=True, text=True, env=env)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        return False, f"failed after {seconds:.0f} s:\n{(done.stdout + done.stderr)[-4000:]}"
    installed = nbformat.read(path, as_version=4).cells[0].get("outputs", [])
    said = next((line for o in installed for line in o.get("text", "").splitlines() if line.startswith("installing")), "")
    return True, f"ran top to bottom in {seconds:.0f} s" + (f" ({said})" if said else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook, book/*.ipynb")
    parser.add_argument("--keep", type=Path, help="work in this folder (must not exist) and keep it")
    parser.add_argument("--cell-timeout", type=float, default=600, help="seconds a cell may take (default 600)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(BOOK.glob("*.ipynb"))
    for nb in notebooks:
        if not nb.is_file():
            parser.error(f"notebooks: no such file: {nb}")
    if args.keep is not None and args.keep.exists():
        parser.error(f"--keep: {args.keep} exists already")
    work = args.keep or Path(tempfile.mkdtemp(prefix="normlib-standalone-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "NORMLIB_"))}
    env["PIP_CONSTRAINT"] = str(ROOT / "constraints.txt")  # the set-up cells' installs, reproducible
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    for var, sub in (("JUPYTER_DATA_DIR", "jupyter"), ("JUPYTER_CONFIG_DIR", "jupyter-config"), ("IPYTHONDIR", "ipython")):
        env[var] = str(work / sub)  # no kernel spec or profile of this machine's user: the venv's own kernel
    env.pop("JUPYTER_PATH", None)
    failed = 0
    try:
        t0 = time.monotonic()
        url = repository(work / "repository")
        python = fresh_venv(work / "venv", env)
        print(f"a fresh venv with torch and a kernel, the working tree as the repository ({time.monotonic() - t0:.0f} s)",
              flush=True)
        # first every committed cell, while the venv has nothing a chapter needs
        for nb in notebooks:
            ok, what = probe(nb, python, work / "probes" / nb.stem, env)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {nb.name}, as committed: {what}", flush=True)
        for nb in notebooks:
            ok, what = run(nb, python, url, work / "runs" / nb.stem, env, args.cell_timeout)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {nb.name}: {what}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{failed} failure(s); {len(notebooks)} notebooks, each probed as committed and run alone from its set-up cell")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
