"""A chapter downloaded alone runs from its set-up cell in a fresh venv (book/_tools/standalone.py).

``make test-standalone`` runs every notebook that way (about eight minutes);
here, in every ``make test``, two that cover the two kinds of need the
set-up cell meets: the versions page (a record of ``book/data/``, no
package) and chapter 03 (a package from PyPI and normlib from the
repository; the shortest such chapter to run).
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("_book_tool_standalone", ROOT / "book" / "_tools" / "standalone.py")
standalone = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standalone)


def test_two_chapters_downloaded_alone_run_from_their_set_up_cell(tmp_path, capsys):
    rc = standalone.main(["--keep", str(tmp_path / "work"), str(ROOT / "book" / "versions.ipynb"),
                          str(ROOT / "book" / "03_layer_norm_vs_batch_norm.ipynb")])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert any(l.startswith("ok   versions.ipynb, as committed") and "It reads executed_with.json" in l
               for l in lines), out
    assert any(l.startswith("ok   03_layer_norm_vs_batch_norm.ipynb, as committed") and "pip install 'matplotlib>=3.7'" in l
               and "It needs normlib" in l for l in lines), out
    assert any(l.startswith("ok   versions.ipynb: ran") and "executed_with.json" in l for l in lines), out
    assert any(l.startswith("ok   03_layer_norm_vs_batch_norm.ipynb: ran") and "matplotlib" in l and "normlib" in l
               for l in lines), out
    # the chapter came in alone: nothing of book/ beside it but the records its set-up cell fetched
    assert sorted(p.name for p in (tmp_path / "work" / "runs" / "versions").iterdir()) == ["data", "versions.ipynb"]


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        standalone.main([str(tmp_path / "missing.ipynb")])
    assert e.value.code == 2 and "notebooks: no such file" in capsys.readouterr().err
    (tmp_path / "there").mkdir()
    with pytest.raises(SystemExit) as e:
        standalone.main(["--keep", str(tmp_path / "there")])
    assert e.value.code == 2 and "--keep" in capsys.readouterr().err
