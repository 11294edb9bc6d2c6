"""The library tests on every torch the package claims: the lowest, 2.11, the pin, the newest.

    python .ci/torch_matrix.py setup     # one venv per release under .venv-torch/ (downloads)
    python .ci/torch_matrix.py run       # the library tests in each (installing what is missing); a table
    python .ci/torch_matrix.py run --remove --after FILE   # CI: install now, test after FILE, one venv at a time

``make test`` already runs everything on the pin (constraints.txt); this adds
the other releases, each in its own venv holding only torch (with the Triton
and numpy it needs) and the test tools, with this checkout on ``PYTHONPATH``
so pip never swaps torch. Releases other than the pin come from PyPI as CUDA
builds (5 to 7 GB each; they run on CPU), downloaded (a broken download
retried) and installed with the machine's pip configuration ignored (see
``pip_env``), as the disk allows (see ``Disk``). ``.ci/run`` starts
``run --remove --after`` first, so that the first release installs beside
``make test``; the releases' tests then run on both cores, one after another,
each venv removed once tested so that the next fits on CI's disk.

The tests are the library's CORE (see below; ``--all`` for every one) but those
marked ``pin`` (extended dtype coverage of code that does not depend on the
release, run by ``make test`` on the pin only), run
with this checkout on ``PYTHONPATH``. ``run``
prints one row per release: passed / failed / skipped for the whole suite,
and separately for torch.compile and torch.export, and writes the same table
to ``_build/torch-matrix.md``. It fails if any release fails a test.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
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
    # and timm with its torchvision (the floor's partner release), which cannot load against the pin
    # (../shared/TOOLCHAIN.md): swap_norms is tested on timm itself here (tests/test_swap_timm.py, the scan)
    _floor(): ["numpy<2.4", "torchvision==0.23.0", "timm==1.0.31"],
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
# ptxas resource reports, tuning, the benchmarks' plumbing), what needs
# transformers, and two suites of normlib's own logic on eager ops that have
# not changed across these releases: every memory layout through every route
# (tests/test_layouts.py) and the checkers of normlib.testing
# (tests/test_testing.py); together 28 to 60 s of a release's two workers'
# time (2026-11-29), cut when .ci/run took 31 min 52 s on a slow day. Two CPU cores cannot run the whole suite four times within
# CI's 30 minutes; `run --all` runs everything. The compiled-gradient zoo runs
# float32 with static and dynamic shapes and bfloat16 with static ones, in both
# compile modes (float16 and dynamic bfloat16, `pin`, with make test; see
# tests/test_compile_gradients.py): CI runs the releases on both
# cores once `make test` is done. The longest modules come first and
# xdist's workers steal from each other, so that no single long test is left to run
# alone at the end (torch 2.8 on a 2-core Xeon, 2026-11-28: 315 s in file order, 246 s so).
CORE = [
    "tests/test_compile_gradients.py", "tests/test_distributed.py", "tests/test_compile_export.py",
    "tests/test_modules.py", "tests/test_parity.py", "tests/test_backward.py", "tests/test_numerics.py",
    "tests/test_errors.py", "tests/test_attention.py", "tests/test_transforms.py", "tests/test_custom_ops.py",
    "tests/test_swap_api.py", "tests/test_inference_inputs.py",
    "tests/test_swap_scan.py", "tests/test_swap_timm.py",  # timm's norms: where timm is installed
]
GROUPS = {
    "compile": re.compile(r"compile|inductor|dynamo", re.I),
    "export": re.compile(r"export", re.I),
}


def _python(version: str) -> Path:
    return ENVS / version / "bin" / "python"


# Disk, as measured (2026-11-27): a release's wheels are 2.9 GB (2.15.0) to
# 3.7 GB (2.8.0), its venv 4.7 GB (2.11.0) to 6.5 GB (2.8.0), about 1.8 times its
# wheels; the pin's .venv is 2.6 GB. A CI machine has about 17 GB free after the
# clone, so it holds the pin and one release, never all three (their venvs alone
# are 16.6 GB). A release therefore takes the disk in two steps, each waiting
# until there is room for it: download its wheels (network-bound, retried),
# then install them from that folder (no network) and delete it. `run --remove`
# deletes each venv once its tests are done, which is what makes room for the
# next; the next release's download overlaps the tests of the one before
# wherever the disk allows.
WHEELS_GB = 4.0      # room a download may take
VENV_PER_WHEEL = 2.0  # room an install takes, per GB of its wheels
SPARE_GB = 3.0       # kept free for what make test writes beside the installs (caches, the built site):
                     # on CI's disk that is one venv and one download ahead, never two venvs
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


def _requirements(version: str) -> list[str]:
    return [f"torch=={version}", *RELEASES[version], *TEST_TOOLS]


class SetupError(RuntimeError):
    pass


class Disk:
    """The matrix's one rule for the disk: a step starts when ``need`` GB (plus ``SPARE_GB``) are free.
    If they are not, it waits for a tested release's venv to be removed (``removes``: the venvs are
    removed after their tests), and fails at once when no venv is left whose removal could make room."""

    def __init__(self, removes: bool = False, poll_s: float = 5.0):
        self._held: set[str] = set()   # releases installed and not yet removed
        self._cond = threading.Condition()
        self._removes = removes
        self._poll_s = poll_s

    def hold(self, version: str) -> None:
        with self._cond:
            self._held.add(version)

    def release(self, version: str) -> None:
        with self._cond:
            self._held.discard(version)
            self._cond.notify_all()

    def wait_for_room(self, need: float, what: str, owner: str, limit_s: float = 45 * 60) -> None:
        t0 = time.monotonic()
        with self._cond:
            while _free_gb() < need + SPARE_GB:
                waited = time.monotonic() - t0
                if not self._removes or not (self._held - {owner}) or waited > limit_s:
                    why = f" after waiting {waited:.0f} s for a venv's removal" if waited > limit_s else ""
                    raise SetupError(f"{what}: only {_free_gb():.1f} GB free on {ENVS}, it needs about "
                                     f"{need + SPARE_GB:.1f} GB{why}; free some space or test fewer releases "
                                     f"(--torch)")
                self._cond.wait(self._poll_s)


def _download(version: str, disk: Disk) -> tuple[Path, str]:
    """The release's wheels (and its test tools') in a folder of their own, fetched by its venv's pip:
    up to ATTEMPTS tries, each logged, since a multi-GB download can break off."""
    wheels = ENVS / f"wheels-{version}"
    log = ENVS / f"{version}.log"
    t0 = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        disk.wait_for_room(WHEELS_GB, f"torch {version}'s download", version)
        shutil.rmtree(wheels, ignore_errors=True)
        with open(log, "a") as out:
            out.write(f"== download, attempt {attempt} ({_free_gb():.1f} GB free)\n")
            out.flush()
            cmd = [str(_python(version)), "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                   "--no-input", "--no-cache-dir", "--timeout", "120", "--retries", "10", "--dest", str(wheels),
                   *_requirements(version)]
            rc = subprocess.run(cmd, env=pip_env(), stdout=out, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            note = f", attempt {attempt}" if attempt > 1 else ""
            return wheels, f"downloaded in {time.monotonic() - t0:.0f} s ({wheels_gb(wheels):.1f} GB{note})"
        time.sleep(10 * attempt)
    shutil.rmtree(wheels, ignore_errors=True)
    raise SetupError(f"torch {version}: download FAILED {ATTEMPTS} times ({_free_gb():.1f} GB free); "
                     f"the end of {log}:\n{_tail(log)}")


def wheels_gb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir()) / 2**30


def _install(version: str, disk: Disk) -> str:
    """One release's venv, ready to test: an empty venv, the release's wheels downloaded by its pip, then
    installed from that folder alone, which is deleted."""
    env = ENVS / version
    if (env / ".installed").exists():
        disk.hold(version)
        return f"torch {version}: ready"
    log = ENVS / f"{version}.log"
    log.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
    wheels = None
    try:
        wheels, downloaded = _download(version, disk)
        disk.wait_for_room(VENV_PER_WHEEL * wheels_gb(wheels), f"torch {version}'s venv", version)
        disk.hold(version)
        t0 = time.monotonic()
        with open(log, "a") as out:
            out.write(f"== install ({_free_gb():.1f} GB free)\n")
            out.flush()
            # --no-compile: no .pyc for the thousands of files the tests never import (a third of the time)
            cmd = pip_install(_python(version), _requirements(version), "--no-index", "--find-links", str(wheels),
                              "--no-compile")
            rc = subprocess.run(cmd, env=pip_env(), stdout=out, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise SetupError(f"torch {version}: install FAILED; the end of {log}:\n{_tail(log)}")
    except BaseException:
        remove(version, disk)
        raise
    finally:
        if wheels is not None:
            shutil.rmtree(wheels, ignore_errors=True)
    (env / ".installed").touch()
    return f"torch {version}: {downloaded}, installed in {time.monotonic() - t0:.0f} s"


def remove(version: str, disk: Disk) -> None:
    shutil.rmtree(ENVS / version, ignore_errors=True)
    disk.release(version)


def setup(versions: list[str]) -> int:
    """Install the releases one after another and keep them; a failure is reported with the end of its
    pip log."""
    ENVS.mkdir(exist_ok=True)
    disk, failed = Disk(), 0
    for version in versions:
        try:
            print(_install(version, disk), flush=True)
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


def _test(version: str, workers: str, everything: bool, out_dir: Path) -> tuple[list[str], int]:
    """One release's library tests: its row of the table and pytest's exit status."""
    py = _python(version)
    xml = out_dir / f"torch-matrix-{version}.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONHOME", None)
    tests = ["tests", *(f"--ignore={p}" for p in IGNORE)] if everything else [*CORE, "-m", "not pin"]
    cmd = [str(py), "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-n", workers,
           "--dist", "worksteal", f"--junitxml={xml}", "--tb=short"]
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
    return row, rc


def run(versions: list[str], workers: str, everything: bool = False, after: Path | None = None,
        keep: bool = True) -> int:
    """Test every release, installing the ones not installed yet as the disk allows (see ``Disk``).

    The installs run in a thread of their own from the start; the tests run in order, each once its
    release is ready and (with ``after``) once that file exists. ``keep=False`` removes each venv
    after its tests, which on a small disk is what lets the next release in."""
    out_dir = ROOT / "_build"
    out_dir.mkdir(exist_ok=True)
    ENVS.mkdir(exist_ok=True)
    disk = Disk(removes=not keep)
    ready: queue.Queue[tuple[str, str | None]] = queue.Queue()
    stop = threading.Event()

    def installer() -> None:
        for version in versions:
            if stop.is_set():
                return
            try:
                print(_install(version, disk), flush=True)
                ready.put((version, None))
            except (SetupError, subprocess.CalledProcessError) as e:
                ready.put((version, str(e)))

    thread = threading.Thread(target=installer, name="torch-matrix-installer", daemon=True)
    thread.start()
    rows, status = [], 0
    try:
        if after is not None:
            _wait_for(after)
        for _ in versions:
            version, error = ready.get()
            if error is not None:
                print(error, flush=True)
                rows.append([version, "**not installed** (see above)", "—", "—", "—"])
                status = 1
                continue
            row, rc = _test(version, workers, everything, out_dir)
            rows.append(row)
            status = status or (1 if rc else 0)
            if not keep:
                remove(version, disk)
    finally:
        stop.set()
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
    parser.add_argument("--after", type=Path, help="`run`: test once this file exists (waits at most 90 min); "
                        "the installs start at once")
    parser.add_argument("--remove", action="store_true",
                        help="`run`: remove each release's venv once its tests are done (a small disk)")
    args = parser.parse_args()
    unknown = [v for v in args.torch if v not in RELEASES]
    if unknown:
        parser.error(f"--torch: not in the matrix: {unknown} (known: {list(RELEASES)})")
    if args.command == "setup":
        if args.after or args.remove:
            parser.error("--after and --remove are for `run`")
        return setup(args.torch)
    return run(args.torch, args.n, args.all, after=args.after, keep=not args.remove)


if __name__ == "__main__":
    sys.exit(main())
