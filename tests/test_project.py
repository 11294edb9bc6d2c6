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
