"""What the README promises about the package matches pyproject.toml and CI."""

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _matrix():
    spec = importlib.util.spec_from_file_location("_torch_matrix", ROOT / ".ci" / "torch_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torch_floor_is_one_decision():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"torch>={floor}" in readme, "the README states another lowest torch than pyproject.toml"
    for page in ("book/using_normlib.md", "normlib/README.md"):
        assert f"torch>={floor}" in (ROOT / page).read_text().replace(" >= ", ">="), f"{page} states another floor"
    assert min(_matrix().RELEASES, key=lambda v: tuple(map(int, v.split(".")))).startswith(floor + ".")
    # every release CI tests appears in the README's table
    for release in _matrix().RELEASES:
        assert re.search(rf"^\| {re.escape(release)}", readme, re.M), f"README's torch table lacks {release}"


def _fake_wheel(folder: Path, name: str, version: str) -> None:
    """A minimal, valid pure-Python wheel of ``name`` ``version`` (no files but its metadata)."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def test_the_matrix_installs_the_newest_torch_where_pip_caps_it(tmp_path):
    """A machine whose pip configuration caps torch (a global constraints file, or PIP_CONSTRAINT)
    must not stop the matrix from installing the newest release: its install command ignores pip's
    configuration. Checked with the matrix's own command and environment against a local index of
    two fake torch wheels, so nothing is downloaded; the same command under the capping
    configuration fails, which is what the matrix's environment prevents."""
    import json
    import os
    import subprocess
    import sys

    matrix = _matrix()
    newest = max(matrix.RELEASES, key=lambda v: tuple(map(int, v.split("."))))
    index = tmp_path / "index"
    index.mkdir()
    for version in ("2.14.1", newest):
        _fake_wheel(index, "torch", version)
    cap = tmp_path / "cap.txt"
    cap.write_text("torch<=2.14.1\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nconstraint = {cap}\n")
    capped = dict(os.environ, PIP_CONFIG_FILE=str(conf), PIP_CONSTRAINT=str(cap))
    report = tmp_path / "report.json"
    cmd = matrix.pip_install(sys.executable, [f"torch=={newest}"], "--dry-run", "--ignore-installed", "--no-deps",
                             "--no-index", "--find-links", str(index), "--report", str(report))

    refused = subprocess.run(cmd, env=capped, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "ResolutionImpossible" in refused.stdout + refused.stderr, (
        "the capping configuration did not cap: the test proves nothing")

    done = subprocess.run(cmd, env=matrix.pip_env(capped), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    chosen = [item["metadata"]["version"] for item in json.loads(report.read_text())["install"]]
    assert chosen == [newest]


def _fake_index(folder: Path, releases) -> Path:
    """Fake wheels of every release the matrix installs and of its test tools, as a local index."""
    folder.mkdir()
    for version in releases:
        _fake_wheel(folder, "torch", version)
    for name, version in (("numpy", "2.3.0"), ("pytest", "8.0.0"), ("pytest_xdist", "3.5.0"),
                          ("hypothesis", "6.100.0")):
        _fake_wheel(folder, name, version)
    pinned = {r for extras in releases.values() for r in extras if "==" in r}  # e.g. the floor's timm
    for name, version in sorted(r.split("==") for r in pinned):
        _fake_wheel(folder, name, version)
    return folder


def _matrix_on_a_simulated_disk(tmp_path, monkeypatch, capacity_gb: float):
    """The matrix with its venvs under ``tmp_path`` and pip reading only a local index of fake wheels;
    the disk it sees has ``capacity_gb`` free before anything is installed; each wheels folder counts as
    the largest download the rule allows and each installed venv as 1.8 times that (as measured); the
    matrix's rule reads the folder's size as 1 GB of wheels. Its tests are replaced by a record of
    which venvs were on the disk when each release was tested."""
    matrix = _matrix()
    envs = tmp_path / "venvs"
    monkeypatch.setattr(matrix, "ENVS", envs)
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_fake_index(tmp_path / "index", matrix.RELEASES)))

    def free_gb():
        used = sum(matrix.WHEELS_GB for _ in envs.glob("wheels-*"))
        used += sum(1.8 * matrix.WHEELS_GB for _ in envs.glob("*/.installed"))
        return capacity_gb - used

    monkeypatch.setattr(matrix, "_free_gb", free_gb)
    monkeypatch.setattr(matrix, "wheels_gb", lambda folder: matrix.WHEELS_GB)
    tested = []

    def fake_test(version, workers, everything, out_dir):
        on_disk = sorted(p.parent.name for p in envs.glob("*/.installed"))
        tested.append((version, on_disk))
        return [version, "pass", "—", "—", "0 s"], 0

    monkeypatch.setattr(matrix, "_test", fake_test)
    return matrix, envs, tested


@pytest.mark.slow
def test_the_matrix_fits_a_disk_that_holds_one_release(tmp_path, monkeypatch):
    """CI's disk holds the pin and one release, not all of them: `run --remove` installs the next
    release only once the one before is tested and removed, downloading it meanwhile, and tests
    every release."""
    # room for one venv and one release's wheels beside it, not for two venvs
    m = _matrix()
    capacity = m.SPARE_GB + (1 + m.VENV_PER_WHEEL) * m.WHEELS_GB + 0.5
    matrix, envs, tested = _matrix_on_a_simulated_disk(tmp_path, monkeypatch, capacity)
    releases = list(matrix.RELEASES)
    assert matrix.run(releases, "2", keep=False) == 0
    assert [v for v, _ in tested] == releases
    assert all(on_disk == [v] for v, on_disk in tested), tested
    assert not list(envs.glob("*/.installed")) and not list(envs.glob("wheels-*"))
    table = (tmp_path / "_build" / "torch-matrix.md").read_text()
    assert all(f"| {v} | pass" in table for v in releases)


@pytest.mark.slow
def test_the_matrix_installs_ahead_where_the_disk_allows_and_refuses_where_it_cannot(tmp_path, monkeypatch):
    """On a large disk every release installs while the first is waiting for `--after`; on a disk
    that cannot hold one release, it says so at once (no wait that nothing can end) and fails."""
    matrix, envs, tested = _matrix_on_a_simulated_disk(tmp_path, monkeypatch, 100.0)
    releases = list(matrix.RELEASES)
    after = tmp_path / "after"
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("rc", matrix.run(releases, "2", after=after)))
    thread.start()
    # A bound on the wait, not an expectation of speed: on a loaded 2-core machine three venvs took
    # over 120 s to create, and the test went on before the last one was installed.
    wait_s = 600
    deadline = time.monotonic() + wait_s
    while len(list(envs.glob("*/.installed"))) < len(releases) and time.monotonic() < deadline:
        thread.join(0.2)
    installed = sorted(p.parent.name for p in envs.glob("*/.installed"))
    assert installed == sorted(releases), f"not every release was installed ahead within {wait_s} s: {installed}"
    assert not tested, "a release was tested before --after's file existed"
    after.touch()
    thread.join(300)
    assert done.get("rc") == 0 and all(on_disk == sorted(releases) for _, on_disk in tested), tested

    small = tmp_path / "small"
    small.mkdir()
    matrix, envs, tested = _matrix_on_a_simulated_disk(small, monkeypatch, matrix.WHEELS_GB * 2)
    t0 = time.monotonic()
    assert matrix.run(releases[:1], "2", keep=False) == 1
    assert time.monotonic() - t0 < 60 and not tested
    assert not tested
    assert "not installed" in (small / "_build" / "torch-matrix.md").read_text()


def _build(tmp_path: Path, env_url: str = "") -> tuple[Path, Path, str]:
    """Build the sdist from a copy of the tracked files, then the wheel from the unpacked sdist (as pip does);
    returns (sdist, wheel, the wheel's METADATA)."""
    import shutil
    import tarfile
    import zipfile

    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    env = {k: v for k, v in os.environ.items() if k != "NORMLIB_REPOSITORY_URL"}
    if env_url:
        env["NORMLIB_REPOSITORY_URL"] = env_url
    backend = ("import sys; from setuptools import build_meta as b; "
               "print(getattr(b, sys.argv[1])(sys.argv[2]))")
    dist = tmp_path / "dist"
    dist.mkdir()
    out = subprocess.run([sys.executable, "-c", backend, "build_sdist", str(dist)], cwd=src, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    sdist = dist / out.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path / "unpacked", filter="data")
    root = next((tmp_path / "unpacked").iterdir())
    out = subprocess.run([sys.executable, "-c", backend, "build_wheel", str(dist)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = dist / out.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return sdist, wheel, meta


def test_the_distributions_are_complete_and_describe_the_package(tmp_path):
    """The sdist builds the wheel by itself, ships no partial test suite, and both carry the user-facing
    description, the classifiers and the torch floor; project URLs exist only where the repository is set."""
    import tarfile
    import zipfile

    sdist, wheel, meta = _build(tmp_path)
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert not any(n.startswith("tests/") for n in names), "the sdist ships tests that cannot run without the book"
    assert {"setup.py", "CHANGELOG.md", "normlib/README.md", "book/_ext/repository.py", "normlib/py.typed"} <= names
    with zipfile.ZipFile(wheel) as z:
        assert {"normlib/py.typed", "normlib/ops/crossover.json"} <= set(z.namelist())
    assert "Requires-Dist: torch>=2.8" in meta
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Classifier: Programming Language :: Python :: {version}" in meta
    body = meta.split("\n\n", 1)[1]
    assert body.strip() == (ROOT / "normlib" / "README.md").read_text().strip()
    assert "Project-URL" not in meta  # no repository configured: no URL that may not exist
    _, _, meta = _build(tmp_path / "with-url", env_url="https://github.com/owner/normlib.git")
    assert "Project-URL: Source, https://github.com/owner/normlib" in meta
    assert "Project-URL: Issues, https://github.com/owner/normlib/issues" in meta
