"""Consistency of the book's sources: table of contents, notebooks, recorded versions."""

import json
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
RECORD = json.loads((BOOK / "data" / "executed_with.json").read_text())["notebooks"]


def _toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [c["file"] for c in part["chapters"]]
    return files


def test_every_notebook_is_in_the_table_of_contents():
    listed = set(_toc_files())
    for nb in NOTEBOOKS:
        assert f"book/{nb.stem}" in listed, nb.name


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_executed_and_clean(nb):
    book = nbformat.read(nb, as_version=4)
    nbformat.validate(book)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert code, "a chapter without code"
    counts = [c.execution_count for c in code]
    assert all(counts), f"{nb.name}: unexecuted cells (run `make notebooks`)"
    assert counts == sorted(counts), f"{nb.name}: cells were not executed top to bottom"
    for c in code:
        assert "execution" not in c.metadata, f"{nb.name}: volatile execution metadata"
        for out in c.get("outputs", []):
            if out.output_type == "error":
                assert "raises-exception" in c.metadata.get("tags", []), f"{nb.name}: unexpected error output"


def test_versions_record_matches_this_environment():
    chapters = {nb.name for nb in NOTEBOOKS} - {"versions.ipynb"}
    assert set(RECORD) == chapters, "book/data/executed_with.json must list every chapter: run `make notebooks`"
    for name, env in RECORD.items():
        for pkg in ("torch", "triton"):
            assert env[pkg] == metadata.version(pkg), (
                f"{name} was executed with {pkg} {env[pkg]} but {metadata.version(pkg)} is installed: "
                "run `make notebooks` and commit the outputs"
            )
