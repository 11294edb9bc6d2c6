"""The instruments stay apart from the runtime: normlib never imports normlib.benchmark.

Benchmarks and tuning tools import the library; the arrows never point the
other way, so the runtime package carries no instrument and none of its
imports. Each instrument keeps its ``python -m`` entry.
"""

import ast
import json
from pathlib import Path

import pytest

import normlib
from normlib import benchmark
from normlib.benchmark import _common, gpu

PACKAGE = Path(normlib.__file__).parent
INSTRUMENTS = PACKAGE / "benchmark"
# examples import the library as a user would; they are not part of the runtime either
OUTSIDE_THE_RUNTIME = (INSTRUMENTS, PACKAGE / "examples")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names (``from X import y`` gives X and X.y)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names]
    return names


def _runtime_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not any(d in p.parents for d in OUTSIDE_THE_RUNTIME)]


def test_the_runtime_never_imports_an_instrument():
    runtime = _runtime_modules()
    assert PACKAGE / "ops" / "dispatch.py" in runtime and len(runtime) > 10
    upward = {
        _module_name(p): [n for n in _imports(p) if n == "normlib.benchmark" or n.startswith("normlib.benchmark.")]
        for p in runtime
    }
    assert not {m: n for m, n in upward.items() if n}, "runtime modules import the instruments"


def test_no_runtime_module_is_an_instrument():
    """A module with a command line (``if __name__ == "__main__"``) or a ``__main__.py`` is an instrument."""
    entries = [_module_name(p) for p in _runtime_modules() if p.name == "__main__.py" or "__main__" in p.read_text()]
    assert not entries


def test_instruments_import_each_other_not_the_package():
    """No instrument imports from ``normlib.benchmark``'s ``__init__`` (which only re-exports)."""
    for p in sorted(INSTRUMENTS.glob("*.py")):
        if p.name == "__init__.py":
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                from_package = (node.level == 1 and not node.module) or node.module == "normlib.benchmark"
                assert not from_package, f"{p.name} imports from the package: {ast.unparse(node)}"


def test_the_package_reexports_the_gpu_benchmark():
    # chapter 07 reads its record through `from normlib import benchmark`
    for name in benchmark.__all__:
        assert getattr(benchmark, name) is getattr(gpu, name)
    assert {"bytes_moved", "report", "plot", "targets"} <= set(benchmark.__all__)


@pytest.mark.parametrize("module", ["gpu", "cpu", "model", "host", "crossover", "tune", "resources", "decode"])
def test_every_instrument_has_a_command_line(module, capsys):
    mod = __import__(f"normlib.benchmark.{module}", fromlist=["main"])
    with pytest.raises(SystemExit) as exit:
        mod.main(["--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m normlib.benchmark")


def test_write_json_replaces_whole_records(tmp_path):
    path = tmp_path / "r.json"
    _common.write_json({"a": [1, 2]}, str(path))
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ]\n}'
    _common.write_json({"b": 1}, str(path), newline=True)
    assert path.read_text() == '{\n "b": 1\n}\n' and json.loads(path.read_text()) == {"b": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind
