"""What the README promises about the package matches pyproject.toml and CI."""

import importlib.util
import re
from pathlib import Path

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
