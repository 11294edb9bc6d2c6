"""Execute chapters top to bottom in this environment and store their outputs.

    python book/_tools/execute_notebooks.py book/*.ipynb

Each notebook runs in a fresh kernel from the book/ folder (so relative data
paths work the same as under nbval), with a fixed hash seed and the IPython
settings in book/_tools/ipython (tracebacks without machine paths, SVG
figures; book/conftest.py gives nbval's kernels the same); volatile metadata
(execution timestamps, widget state) is dropped so that re-running an
unchanged notebook gives an unchanged file.

What each chapter ran with is recorded in book/data/executed_with.json: the
Python, torch, Triton and normlib versions; the machine (CPU model, its
AVX2/AVX-512 flags, the ATen CPU capability torch picked and its default thread
count, which decide how floats round); and the version of every package the
chapter's code cells import, found by scanning them. The page that shows the
record (book/versions.ipynb) is re-executed after any chapter, so that its
stored tables never lag behind the record (nbval would fail on it otherwise).
"""

from __future__ import annotations

import ast
import datetime as dt
import fcntl
import json
import os
import platform
import subprocess
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


# CPU flags that select ATen's vector kernels (and so how reductions round)
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "amx_tile")


def _version(distribution: str):
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def cpu() -> dict:
    """The CPU model and the instruction-set flags that change float results (Linux: /proc/cpuinfo)."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or None,
        "cpu_flags": " ".join(f for f in ISA_FLAGS if f in flags) or None,
    }


def torch_cpu_settings() -> dict:
    """What torch picks in a fresh process of this environment, as a chapter's kernel starts:
    the ATen CPU capability (ATEN_CPU_CAPABILITY overrides it) and the default thread count."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
        capability, threads = out.stdout.split()
        return {"aten_cpu_capability": capability, "threads": int(threads)}
    except (subprocess.SubprocessError, ValueError, OSError):
        return {"aten_cpu_capability": None, "threads": None}


def environment() -> dict:
    """This environment, read from the installed packages and the machine, not typed by hand."""
    env = {"python": platform.python_version(), "machine": platform.machine(), **cpu(), **torch_cpu_settings()}
    for name in PACKAGES:
        env[name] = _version(name)
    env["executed"] = dt.datetime.now(dt.timezone.utc).date().isoformat()
    return env


def imported_packages(nb) -> dict:
    """The third-party distributions a notebook's code cells import, with their installed versions."""
    modules = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        # IPython magics and shell escapes are not Python
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module.split(".")[0])
    owners = metadata.packages_distributions()
    packages = {}
    for module in sorted(modules - set(sys.stdlib_module_names)):
        for dist in sorted(set(owners.get(module, [module]))):
            packages[dist] = _version(dist)
    return dict(sorted(packages.items()))


def record(paths: list[Path]) -> None:
    text = RECORD.read_text() if RECORD.exists() else ""
    data = json.loads(text) if text.strip() else {"notebooks": {}}
    env = environment()
    for p in paths:
        if p.name not in NOT_RECORDED:
            data["notebooks"][p.name] = {**env, "imports": imported_packages(nbformat.read(p, as_version=4))}
    data["notebooks"] = dict(sorted(data["notebooks"].items()))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(data, indent=1) + "\n")


def kernel_environment() -> None:
    """The environment the chapters' kernels inherit (the same as under nbval: book/conftest.py)."""
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["TQDM_DISABLE"] = "True"  # progress bars are for runs by hand
    os.environ["IPYTHONDIR"] = str(IPYTHONDIR)


def run(path: Path):
    """Execute the notebook at ``path`` top to bottom in a fresh kernel, in this process's environment
    (plus the chapters' kernel settings), and return it with volatile metadata dropped; nothing is
    written. The one way a chapter is executed: ``execute`` stores the result, and
    book/_tools/stability.py compares it across CPUs and thread counts."""
    nb = nbformat.read(path, as_version=4)
    kernel_environment()
    os.environ["SOURCE_DATE_EPOCH"] = "0"  # no timestamp in SVG figures (book/matplotlibrc fixes their ids)
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
    nb.metadata = {
        "kernelspec": KERNELSPEC,
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    return nb


def execute(path: Path) -> float:
    """Execute the notebook and store its outputs in place; returns the seconds it took."""
    start = time.perf_counter()
    nb = run(path)
    elapsed = time.perf_counter() - start
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
