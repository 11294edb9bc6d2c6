"""The library tests on every torch the package claims: the lowest, 2.11, the pin, the newest.

    python .ci/torch_matrix.py setup     # one venv per release under .venv-torch/ (downloads)
    python .ci/torch_matrix.py run       # the library tests in each; a table of the results

``make test`` already runs everything on the pin (constraints.txt); this adds
the other releases, each in its own venv holding only torch (with the Triton
and numpy it needs) and the test tools, with this checkout on ``PYTHONPATH``
so pip never swaps torch. Releases other than the pin come from PyPI as CUDA
builds (5 to 7 GB each; they run on CPU): ``setup`` installs them one after
another, retrying a broken download, with the machine's pip configuration
ignored (see ``pip_env``). ``.ci/run`` starts it first, so that the downloads
overlap ``make test``, then runs the releases' tests on both cores.

The tests are the library's CORE (see below; ``--all`` for every one), run
with this checkout on ``PYTHONPATH``. ``run``
prints one row per release: passed / failed / skipped for the whole suite,
and separately for torch.compile and torch.export, and writes the same table
to ``_build/torch-matrix.md``. It fails if any release fails a test.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / ".venv-torch"


def _floor() -> str:
    """The lowest torch pyproject.toml allows (``torch>=2.8`` gives ``2.8.0``): the one place it is decided."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch>=(\d+)\.(\d+)(?:\.(\d+))?"', text)
    if not m:
        raise SystemExit("pyproject.toml: no \"torch>=X.Y\" dependency found")
    return f"{m.group(1)}.{m.group(2)}.{m.group(3) or 0}"


# The releases and what each needs beside torch: the lowest allowed, the CUDA
# images' 2.11, and the newest (the pin is make test's). numpy always (torch
# does not require it, but Triton's interpreter and torch's opcheck do); below
# 2.4 for the older Tritons (3.6, which torch 2.11 brings, fails in its
# interpreter on numpy 2.4's scalars).
RELEASES = {
    _floor(): ["numpy<2.4"],
    "2.11.0": ["numpy<2.4"],
    "2.15.0": ["numpy"],
}
TEST_TOOLS = ["pytest>=7.4", "pytest-xdist>=3.3", "hypothesis>=6.80"]
# Not the library's tests: the notebooks, the built site and the translations (make test runs them).
IGNORE = ["tests/test_book.py", "tests/test_site.py", "tests/test_zh_edition.py"]
# What CI runs on each release: every test of torch's behaviour that normlib
# depends on (modules, state_dicts, reprs, parity, gradients, bad input,
# autocast, torch.func, compile and export, custom ops, torch.distributed,
# swap_norms on torch's own norms). Left to the pin's run (make test): the
# Triton machinery that torch does not touch (the interpreter's kernel sweep,
# ptxas resource reports, tuning, the benchmarks' plumbing) and what needs
# transformers. Two CPU cores cannot run the whole suite four times within
# CI's 30 minutes; `run --all` runs everything. The compiled-gradient zoo runs
# whole (every dtype, static and dynamic shapes, both compile modes): CI runs
# the releases on both cores once `make test` is done.
CORE = [
    "tests/test_modules.py", "tests/test_parity.py", "tests/test_backward.py", "tests/test_numerics.py",
    "tests/test_errors.py", "tests/test_attention.py", "tests/test_transforms.py",
    "tests/test_compile_gradients.py", "tests/test_compile_export.py", "tests/test_custom_ops.py",
    "tests/test_distributed.py", "tests/test_swap_api.py", "tests/test_testing.py",
]
GROUPS = {
    "compile": re.compile(r"compile|inductor|dynamo", re.I),
    "export": re.compile(r"export", re.I),
}


def _python(version: str) -> Path:
    return ENVS / version / "bin" / "python"


# A release's venv is about 5-7 GB; pip also needs room for the wheels it
# downloads (kept in a cache of the matrix's own, removed once installed).
NEEDS_GB = 10
ATTEMPTS = 3


def _free_gb() -> float:
    return shutil.disk_usage(ENVS).free / 2**30


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "    (no log)"


# A machine's own pip configuration must not decide which torch the matrix
# gets: a global constraints file (a fresh CI machine carries one that caps
# torch at the releases on its disk) makes `torch==<newest>` unresolvable.
# The releases therefore install with every pip configuration file ignored
# (PIP_CONFIG_FILE=os.devnull is pip's documented switch for that) and without
# the environment's constraint and requirement variables; the index, certificate
# and proxy settings the environment gives stay. The pin (make install) keeps
# the machine's configuration, which is what finds the local CPU wheel.
_PIP_RESOLUTION_VARS = ("PIP_CONSTRAINT", "PIP_REQUIREMENT", "PIP_BUILD_CONSTRAINT")


def pip_env(base: dict | None = None) -> dict:
    """The environment of the matrix's pip: ``base`` (default ``os.environ``) with pip's configuration
    files and its resolution-changing variables set aside."""
    env = dict(os.environ if base is None else base)
    for var in _PIP_RESOLUTION_VARS:
        env.pop(var, None)
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip_install(python: Path | str, requirements: list[str], *options: str) -> list[str]:
    """The matrix's one install command: ``python -m pip install`` the ``requirements`` (run it with
    :func:`pip_env`)."""
    return [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
            *options, *requirements]


def _setup_one(version: str) -> str:
    """One release's venv: up to ATTEMPTS tries (a multi-GB download can break off), each logged."""
    env = ENVS / version
    stamp = env / ".installed"
    if stamp.exists():
        return f"torch {version}: ready"
    log = ENVS / f"{version}.log"
    cache = ENVS / "pip-cache"
    t0 = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        if _free_gb() < NEEDS_GB:
            raise SetupError(f"torch {version}: only {_free_gb():.1f} GB free on {ENVS}, a release needs about "
                             f"{NEEDS_GB} GB (venv and downloads); free some space or run fewer releases (--torch)")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        with open(log, "a") as out:
            out.write(f"== attempt {attempt} ({_free_gb():.1f} GB free)\n")
            out.flush()
            cmd = pip_install(_python(version), [f"torch=={version}", *RELEASES[version], *TEST_TOOLS],
                              "--cache-dir", str(cache), "--timeout", "120", "--retries", "10")
            rc = subprocess.run(cmd, env=pip_env(), stdout=out, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            shutil.rmtree(cache, ignore_errors=True)
            stamp.touch()
            note = f" (attempt {attempt})" if attempt > 1 else ""
            return f"torch {version}: installed in {time.monotonic() - t0:.0f} s{note}"
        time.sleep(10 * attempt)
    shutil.rmtree(cache, ignore_errors=True)
    raise SetupError(f"torch {version}: install FAILED {ATTEMPTS} times ({_free_gb():.1f} GB free); "
                     f"the end of {log}:\n{_tail(log)}")


class SetupError(RuntimeError):
    pass


def setup(versions: list[str]) -> int:
    """Install the releases one after another, so that the disk holds one release's downloads at a time; a
    failure is reported with the end of its pip log."""
    ENVS.mkdir(exist_ok=True)
    failed = 0
    for version in versions:
        try:
            print(_setup_one(version), flush=True)
        except (SetupError, subprocess.CalledProcessError) as e:
            failed += 1
            print(e, flush=True)
    return 1 if failed else 0


def _counts(cases: list[ET.Element]) -> dict[str, int]:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            c["failed"] += 1
        elif case.find("skipped") is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return c


def _cell(c: dict[str, int]) -> str:
    if not any(c.values()):
        return "—"
    verdict = "pass" if c["failed"] == 0 else f"**{c['failed']} failed**"
    return f"{verdict} ({c['passed']} passed, {c['skipped']} skipped)"


def _wait_for(path: Path, limit_s: float = 90 * 60) -> None:
    """Block until ``path`` exists (CI: until the pin's own tests are done), at most ``limit_s``."""
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > limit_s:
            raise SystemExit(f"waited {limit_s:.0f} s for {path}; giving up")
        time.sleep(2)


def run(versions: list[str], workers: str, everything: bool = False) -> int:
    out_dir = ROOT / "_build"
    out_dir.mkdir(exist_ok=True)
    rows, status = [], 0
    for version in versions:
        py = _python(version)
        if not (ENVS / version / ".installed").exists():
            print(f"torch {version}: no venv (run `python .ci/torch_matrix.py setup` first)", flush=True)
            return 2
        xml = out_dir / f"torch-matrix-{version}.xml"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("PYTHONHOME", None)
        tests = ["tests", *(f"--ignore={p}" for p in IGNORE)] if everything else CORE
        cmd = [str(py), "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-n", workers,
               f"--junitxml={xml}", "--tb=short"]
        print(f"\n== torch {version}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        seconds = time.monotonic() - t0
        cases = list(ET.parse(xml).getroot().iter("testcase")) if xml.exists() else []
        version_seen = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"],
                                      capture_output=True, text=True).stdout.strip()
        row = [version_seen or version, _cell(_counts(cases))]
        for pattern in GROUPS.values():
            row.append(_cell(_counts([c for c in cases if pattern.search(c.get("classname", "") + "." + c.get("name", ""))])))
        row.append(f"{seconds:.0f} s")
        rows.append(row)
        if rc != 0:
            status = 1
    table = ["| torch | library tests | compile | export | time |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(table) + "\n"
    (out_dir / "torch-matrix.md").write_text(text)
    print("\n" + text, flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "run"])
    parser.add_argument("--torch", nargs="*", default=list(RELEASES), help="releases (default: all)")
    parser.add_argument("-n", default="2", help="pytest-xdist workers for `run`")
    parser.add_argument("--all", action="store_true", help="`run`: every library test, not only CORE")
    parser.add_argument("--after", type=Path, help="`run`: start once this file exists (waits at most 90 min)")
    args = parser.parse_args()
    unknown = [v for v in args.torch if v not in RELEASES]
    if unknown:
        parser.error(f"--torch: not in the matrix: {unknown} (known: {list(RELEASES)})")
    if args.command == "setup":
        return setup(args.torch)
    if args.after:
        _wait_for(args.after)
    return run(args.torch, args.n, args.all)


if __name__ == "__main__":
    sys.exit(main())
