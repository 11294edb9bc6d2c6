"""Consistency of the book's sources: table of contents, notebooks, recorded versions."""

import base64
import importlib.util
import json
import re
import struct
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
CHAPTERS = sorted(BOOK.glob("[0-9]*.ipynb"))
RECORD = json.loads((BOOK / "data" / "executed_with.json").read_text())["notebooks"]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_book_tool_{name}", BOOK / "_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_cell = _load_tool("add_setup_cell")


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


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_chapters_start_with_the_setup_cell(nb):
    """A chapter opened on Colab/Binder or downloaded installs what it needs first (book/_tools/add_setup_cell.py)."""
    book = nbformat.read(nb, as_version=4)
    first = book.cells[0]
    assert setup_cell.is_setup_cell(first), f"{nb.name}: no set-up cell first: run `make setup-cells`, then `make notebooks`"
    assert first.source == setup_cell.setup_cell_source(None, book), (
        f"{nb.name}: the set-up cell is out of date (another text, other imports or records, or another "
        "NORMLIB_REPOSITORY_URL): run `make setup-cells`"
    )
    assert "remove-cell" in first.metadata["tags"]  # not shown on the rendered page
    assert first.get("outputs", []) == [], "the set-up cell prints nothing where everything is installed"


def test_the_setup_cell_names_what_each_chapter_needs():
    """Read from the code: the packages beyond the standard library and the records of book/data/."""
    def needs(name):
        return setup_cell.needs(nbformat.read(BOOK / f"{name}.ipynb", as_version=4))

    packages, data = needs("05b_does_normalization_help")
    assert set(packages) == {"matplotlib", "sklearn", "tqdm"} and packages["sklearn"].startswith("scikit-learn>=")
    assert data == []
    packages, data = needs("07_fused_gpu")
    assert {"matplotlib", "transformers", "triton"} <= set(packages)
    assert {"benchmark.json", "tune_bwd.json", "interop_check.json"} <= set(data)
    assert needs("versions") == ({}, ["executed_with.json"])
    # a package the extras do not list is refused: the cell could not install it at a known floor
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import seaborn")]
    with pytest.raises(SystemExit, match="seaborn"):
        setup_cell.needs(nb)


def test_the_setup_cell_without_a_repository_names_what_is_missing(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('import json, normlib, matplotlib\njson.loads(open("data/executed_with.json").read())')]
    source = setup_cell.setup_cell_source("", nb)
    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(ModuleNotFoundError, match=r"It reads executed_with.json .*book/data/"):
        exec(compile(source, "setup-cell", "exec"), {})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "executed_with.json").write_text("{}")
    exec(compile(source, "setup-cell", "exec"), {})  # everything there: nothing happens


def test_setup_cell_tool_is_idempotent_and_does_what_it_says(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A chapter"), nbformat.v4.new_code_cell("import normlib as nl")]
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    assert setup_cell.main(["--check", str(path)]) == 1
    assert setup_cell.main(["--repository", "https://github.com/o/r", str(path)]) == 0
    once = path.read_bytes()
    assert setup_cell.main(["--repository", "https://github.com/o/r", str(path)]) == 0
    assert path.read_bytes() == once  # a second run changes nothing
    cells = nbformat.read(path, as_version=4).cells
    assert setup_cell.is_setup_cell(cells[0]) and [c.source for c in cells[1:]] == ["# A chapter", "import normlib as nl"]
    assert "'https://github.com/o/r'" in cells[0].source and '"git", "clone"' in cells[0].source
    # without a repository: a message saying how to install, instead of an install
    assert setup_cell.main(["--repository", "", str(path)]) == 0
    cells = nbformat.read(path, as_version=4).cells
    assert "ModuleNotFoundError" in cells[0].source and "pip install" in cells[0].source
    assert sum(setup_cell.is_setup_cell(c) for c in cells) == 1
    # the cell is valid Python that does nothing where normlib is importable
    exec(compile(cells[0].source, "setup-cell", "exec"), {})


def test_markdown_tables_in_outputs_render_as_tables():
    """myst-nb renders text/markdown outputs as CommonMark unless told otherwise: no tables."""
    for nb in NOTEBOOKS:
        for cell in nbformat.read(nb, as_version=4).cells:
            for out in cell.get("outputs", []):
                md = out.get("data", {}).get("text/markdown", "")
                if re.search(r"^\|.*\|\s*$\n^\|[\s:|-]*-{3,}", md, flags=re.M):
                    fmt = cell.metadata.get("mystnb", {}).get("markdown_format")
                    assert fmt in ("gfm", "myst"), (
                        f"{nb.name}: a Markdown table in an output renders as raw pipes: give the cell "
                        'the metadata {"mystnb": {"markdown_format": "gfm"}}'
                    )


# Paths of the machine that executed a notebook, as a traceback would show them.
_MACHINE_PATH = re.compile(r"(/work/|/home/|/Users/|/tmp/|site-packages|[A-Z]:\\\\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_tracebacks_carry_no_machine_paths(nb):
    """Error outputs are executed with %xmode Docs (book/_tools/ipython): the cell's line and the error."""
    for cell in nbformat.read(nb, as_version=4).cells:
        for out in cell.get("outputs", []):
            text = _ANSI.sub("", "\n".join(out.get("traceback", [])) + out.get("text", ""))
            found = _MACHINE_PATH.search(text)
            assert not found, f"{nb.name}: a path of the build machine in an output: ...{text[max(0, found.start() - 80):found.end() + 40]}..."


def _png_width(data: str) -> int:
    raw = base64.b64decode(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", raw[16:20])[0]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_figures_are_crisp_on_high_dpi_screens(nb):
    """SVG, or a PNG drawn at least 1.5 times its displayed size (e.g. InlineBackend 'retina')."""
    for cell in nbformat.read(nb, as_version=4).cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data and "image/svg+xml" not in data:
                shown = out.get("metadata", {}).get("image/png", {}).get("width")
                pixels = _png_width(data["image/png"])
                assert shown and pixels >= 1.5 * shown, (
                    f"{nb.name}: a PNG figure shown at its pixel size ({pixels} px) is blurry on high-DPI "
                    "screens: execute the chapter with `make notebooks` (SVG figures) or use the 'retina' format"
                )


execute_tool = _load_tool("execute_notebooks")


def test_execution_record_names_the_machine_and_the_imports():
    """The tool records what decides the last digits (CPU, ISA flags, ATen capability, threads)."""
    env = execute_tool.environment()
    for key in ("python", "machine", "cpu", "cpu_flags", "aten_cpu_capability", "threads", "torch", "triton", "normlib"):
        assert key in env, key
    assert env["torch"] == metadata.version("torch")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%config InlineBackend.figure_formats = ['svg']\nimport json, torch\nfrom torch import nn"),
        nbformat.v4.new_code_cell("import numpy as np\nfrom normlib.testing import check_layer_norm\nfrom . import local"),
        nbformat.v4.new_markdown_cell("import matplotlib"),  # prose is not code
    ]
    found = execute_tool.imported_packages(nb)
    assert set(found) == {"torch", "numpy", "normlib"}, found  # json is stdlib, '.' is relative
    assert found["numpy"] == metadata.version("numpy")


@pytest.mark.parametrize("nb", [nb for nb in NOTEBOOKS if "imports" in RECORD.get(nb.name, {})], ids=lambda p: p.name)
def test_recorded_imports_match_the_chapter(nb):
    """A chapter's recorded packages are the ones its code imports now (re-execute it after changing them)."""
    scanned = execute_tool.imported_packages(nbformat.read(nb, as_version=4))
    assert set(RECORD[nb.name]["imports"]) == set(scanned), (
        f"{nb.name} imports {sorted(scanned)} but was recorded with {sorted(RECORD[nb.name]['imports'])}: "
        "run `make notebooks` (or book/_tools/execute_notebooks.py on it)"
    )


# ---- the errata chapter: one grade per entry, the same in the heading, the summary and the counts

ERRATA = BOOK / "08_errata.ipynb"
GRADES = ("Error", "Overstatement", "Note")


def _errata_markdown():
    return [c.source for c in nbformat.read(ERRATA, as_version=4).cells if c.cell_type == "markdown"]


def test_errata_grades_agree_between_headings_summary_and_counts():
    text = "\n".join(_errata_markdown())
    # every entry: a label, then a heading ending in its grade
    headed = dict(re.findall(r"^\((erratum-[a-z0-9-]+)\)=\n### .+ — \*(\w+)\*$", text, re.M))
    assert headed, "no errata entries found"
    assert set(headed.values()) <= set(GRADES), set(headed.values())
    labels = re.findall(r"^\((erratum-[a-z0-9-]+)\)=", text, re.M)
    assert sorted(labels) == sorted(headed), "an erratum label without a graded heading"
    # the Notes on wording: one bullet each in the section labelled errata-slips
    slips_section = text.split("(errata-slips)=", 1)[1].split("\n## ", 2)[1]
    slips = re.findall(r"^\* \*\*(\d{3}) · ", slips_section, re.M)
    # the summary table: one row per entry and per slip, linking to it, with its grade
    summary = text.split("(errata-summary)=", 1)[1]
    rows = re.findall(r"^\| (\d+) \| ([\d, ]+) \| \{ref\}`[^`]*<([a-z0-9-]+)>` \| (\w+) \|$", summary, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)), "rows not numbered 1..n"
    entry_rows = {label: grade for _, _, label, grade in rows if label.startswith("erratum-")}
    assert entry_rows == headed, "summary table and headings disagree"
    slip_rows = [(article.split(",")[0], grade) for _, article, label, grade in rows if label == "errata-slips"]
    assert [a for a, _ in slip_rows] == slips and {g for _, g in slip_rows} == {"Note"}
    # the counts printed below the table
    book = nbformat.read(ERRATA, as_version=4)
    (counts_cell,) = [c for c in book.cells if c.cell_type == "code" and "summary_grades = {" in c.source]
    printed = "".join(o.get("text", "") for o in counts_cell.outputs)
    total = re.search(r"^\s+all\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", printed, re.M)
    grades_in_table = [grade for *_, grade in rows]
    assert [int(n) for n in total.groups()] == [grades_in_table.count(g) for g in GRADES] + [len(rows)]
    for article in ("000", "001", "002", "003", "004"):
        line = re.search(rf"^\s+{article}\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", printed, re.M)
        mine = [grade for _, arts, _, grade in rows if arts.split(",")[0] == article]
        assert [int(n) for n in line.groups()] == [mine.count(g) for g in GRADES] + [len(mine)], article


def test_errata_cells_check_behaviour_not_third_party_source():
    # reading an installed package's source text ties a page to one release of it
    book = nbformat.read(ERRATA, as_version=4)
    for c in book.cells:
        if c.cell_type == "code":
            assert ".read_text()" not in c.source, c.source[:80]
            assert 'find_spec("transformers")' not in c.source, c.source[:80]


stability = _load_tool("stability")


def test_stability_compares_what_nbval_compares():
    """Streams written in pieces are one text, ignored cells and figures are left out, sanitizing applies."""
    nb = {"cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [
            {"output_type": "stream", "name": "stdout", "text": "a = 1"},
            {"output_type": "stream", "name": "stdout", "text": ".5\nb at 0x7f00deadbeef\n"},
            {"output_type": "display_data", "data": {"image/svg+xml": "<svg/>", "text/plain": "<Figure>"}},
        ]},
        {"cell_type": "markdown", "metadata": {}, "source": "text"},
        {"cell_type": "code", "metadata": {"tags": ["nbval-ignore-output"]},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "12.3 s\n"}]},
        {"cell_type": "code", "metadata": {}, "outputs": [
            {"output_type": "error", "ename": "ValueError", "evalue": "bad eps", "traceback": []}]},
    ]}
    lines = stability.compared_lines(nb, stability.sanitizers())
    assert lines == {0: ["a = 1.5", "b at 0xADDRESS", "<Figure>"], 3: ["ValueError: bad eps"]}


def test_stability_runs_only_the_capabilities_this_cpu_has():
    assert stability.runnable_capabilities(set()) == ["default"]
    assert stability.runnable_capabilities({"avx2", "fma"}) == ["default", "avx2"]
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert stability.runnable_capabilities(avx512) == ["default", "avx2", "avx512"]
    assert stability.runnable_capabilities(avx512 - {"avx512vl"}) == ["default", "avx2"]


def test_stability_finds_a_line_that_depends_on_the_thread_count(tmp_path, capsys):
    """End to end: a chapter printing its thread count is stable under one thread count, not under two."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch\nprint('threads', torch.get_num_threads())\nprint('same')")]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="threads 1\nsame\n")]
    path = tmp_path / "threads.ipynb"
    nbformat.write(nb, path)
    assert stability.main(["--capabilities", "default", "--threads", "1", "--blas", "auto", str(path)]) == 0
    assert stability.main(["--capabilities", "default", "--threads", "1,2", "--blas", "auto", str(path)]) == 1
    out = capsys.readouterr().out
    assert "default/2t/auto  threads 2   <- differs" in out and "1 line(s) differ" in out
    assert "'same'" not in out and "  same" not in out.split("1 line(s) differ")[-1]


def test_stability_runs_mkls_code_paths(tmp_path, capsys):
    """Each MKL code path runs with its own setting (and none leaks in from the caller's environment)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.environ.get('MKL_CBWR'))")]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="None\n")]
    path = tmp_path / "blas.ipynb"
    nbformat.write(nb, path)
    assert stability.main(["--capabilities", "default", "--threads", "1", "--blas", "auto,avx2", str(path)]) == 0
    assert stability.main(["--capabilities", "default", "--threads", "1", "--blas", "compatible", str(path)]) == 1
    assert "default/1t/compatible  COMPATIBLE   <- differs" in capsys.readouterr().out
    assert stability.distinct_blas({"avx2"}) == ["auto", "compatible"]
    assert stability.distinct_blas({"avx2", "avx512f"}) == ["auto", "avx2", "compatible"]


@pytest.mark.parametrize("argv, words", [
    (["--capabilities", "sse9"], "--capabilities"),
    (["--blas", "openblas"], "--blas"),
    (["--threads", "0"], "--threads"),
    (["--threads", "two"], "--threads"),
    (["--jobs", "0"], "--jobs"),
])
def test_stability_refuses_bad_arguments_by_name(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        stability.main([*argv, str(CHAPTERS[0])])
    assert e.value.code == 2 and words in capsys.readouterr().err
