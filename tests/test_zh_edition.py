"""The Chinese edition's translations: current, complete, faithful in form, and in the glossary's terms.

The translations live in book/zh/ (book/_tools/zh_edition.py explains the
format); these tests read them and the English sources, and need no build.
"""

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_tools"))
import zh_edition as zh  # noqa: E402

SEEDS = ROOT.parent / "shared" / "seeds"


def _notebooks():
    return [zh._source(p) for p in zh._toc_files() if zh._source(p).suffix == ".ipynb"]


def _pairs(src):
    """``(cell id, English, Chinese)`` for every translated markdown cell of ``src``."""
    cells = zh._translation(src).get("cells", {})
    for cell in zh._markdown_cells(nbformat.read(src, as_version=4)):
        if cell.id in cells:
            yield cell.id, cell.source, cells[cell.id]["zh"]


def test_every_translation_is_current():
    problems = zh.status()
    assert not problems, (
        "stale or missing translations (python book/_tools/zh_edition.py stale shows them):\n"
        + "\n".join("  " + zh.describe(*problem) for problem in problems)
    )


@pytest.mark.parametrize("src", _notebooks(), ids=lambda p: p.name)
def test_a_chinese_chapter_downloaded_alone_runs_the_english_code(src):
    """The Chinese notebook's code cells are the English ones, the set-up cell first: what
    ``book/_tools/standalone.py`` runs for the English chapter is what a reader of the Chinese one runs."""
    english = nbformat.read(src, as_version=4)
    chinese, _ = zh.zh_notebook(src)
    code = [(c.cell_type, c.source) for c in english.cells if c.cell_type == "code"]
    assert [(c.cell_type, c.source) for c in chinese.cells if c.cell_type == "code"] == code
    assert "normlib-setup" in chinese.cells[0].metadata.get("tags", [])


def test_translation_files_name_their_source_and_only_its_cells():
    for path in sorted((ROOT / "book" / "zh").glob("*.json")):
        if path == zh.FIGURES:
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        src = ROOT / data["source"]
        assert src.exists(), f"{path.name}: source {data['source']} does not exist"
        if "cells" in data:
            ids = {c.id for c in zh._markdown_cells(nbformat.read(src, as_version=4))}
            extra = set(data["cells"]) - ids
            assert not extra, f"{path.name}: cells that are not markdown cells of {src.name}: {sorted(extra)}"


_LABEL = re.compile(r"^\(([\w-]+)\)=", re.M)
_ROLE_TARGET = re.compile(r"\{(ref|doc|numref|cite|eq)\}`(?:[^`<]*<)?([^`>]+)>?`")
_DIRECTIVE = re.compile(r"^\s*(:::+|```+)\s*\{([\w-]+)\}", re.M)
_OPTION_LABEL = re.compile(r"^:label:\s*(\S+)", re.M)


def _form(text):
    return (
        sorted(_LABEL.findall(text)),
        sorted(set(_ROLE_TARGET.findall(text))),
        [d for _, d in _DIRECTIVE.findall(text)],
        sorted(_OPTION_LABEL.findall(text)),
        len(re.findall(r"^#+ ", text, re.M)),
    )


@pytest.mark.parametrize("src", _notebooks(), ids=lambda p: p.stem)
def test_translations_keep_labels_links_directives_and_headings(src):
    for cid, en, tr in _pairs(src):
        assert _form(tr) == _form(en), f"{src.name} cell {cid}: labels, link targets, directives or headings differ"


def _visible(text):
    """The text a reader sees: a ``{term}`` role shows its title, or its target when it has none."""
    return re.sub(r"\{term\}`(?:([^`<]*?)\s*<[^`>]*>|([^`]*))`", lambda m: m.group(1) or m.group(2), text)


def _glossary():
    """``{English head: [its Chinese names]}`` from book/glossary.md."""
    text = (ROOT / "book" / "glossary.md").read_text(encoding="utf-8")
    block = text.split("```{glossary}")[1].split("```")[0]
    terms = {}
    for head in (line for line in block.splitlines() if line and not line.startswith(" ")):
        m = re.search(r"\((.*)\)\s*$", head)
        names = re.findall(r"[\u4e00-\u9fff][\u4e00-\u9fff·]*", m.group(1)) if m else []
        if names:
            terms[head] = names
    return terms


def _svg(draw, rc=None):
    """The SVG of a figure that ``draw(ax)`` draws, with the chapters' settings (book/matplotlibrc) or ``rc``."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rc = rc or matplotlib.rc_params_from_file(str(ROOT / "book" / "matplotlibrc"), use_default_template=False)
    with plt.rc_context(rc):
        fig, ax = plt.subplots()
        draw(ax)
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        plt.close(fig)
    return buf.getvalue()


def _drawn(**labels):
    """A figure with an x label, a title and one legend entry."""
    def draw(ax):
        ax.plot([0, 1], [0, 1], label=labels.get("legend", "x"))
        ax.set_xlabel(labels.get("xlabel", ""))
        ax.set_title(labels.get("title", ""))
        ax.legend()

    return _svg(draw)


def test_figure_labels_are_found_and_translated_in_place():
    pytest.importorskip("matplotlib")
    svg = _drawn(xlabel="training step", title="lr 0.1 & <b>", legend="LayerNorm")
    labels, problems = zh._figure_labels(svg)
    assert labels == {"training step", "lr 0.1 & <b>", "LayerNorm"} and not problems
    out = zh.translate_svg(svg, {"training step": "训练步数", "lr 0.1 & <b>": "学习率 0.1 & <b>"})
    assert ">训练步数</text>" in out and ">学习率 0.1 &amp; &lt;b&gt;</text>" in out and ">LayerNorm</text>" in out
    assert "training step" not in out
    import xml.etree.ElementTree as ET

    ET.fromstring(out.encode())  # still well-formed


def test_multi_line_labels_keep_their_alignment_in_chinese():
    """matplotlib places each line of a multi-line label at the English line's left end; the Chinese is re-anchored."""
    pytest.importorskip("matplotlib")

    def draw(ax):
        ax.set_title("a long first line of the title\nshort second")  # centred
        ax.set_ylabel("mean training loss\n(diverged runs drawn at 5)")  # centred, rotated
        ax.set_yticks([0.5], ["LayerNorm(768)\n32x128"])  # right-aligned

    svg = _svg(draw)
    table = {"a long first line of the title": "标题第一行", "short second": "第二行", "mean training loss": "平均训练损失",
             "(diverged runs drawn at 5)": "（发散的画在 5 处）", "LayerNorm(768)": "LayerNorm(768)，小"}
    out = zh.translate_svg(svg, table)
    lines = {m.group(5): m for m in zh._LINE.finditer(out)}
    title = [lines["标题第一行"], lines["第二行"]]
    assert all("text-anchor: middle" in m.group(1) for m in title)
    assert abs(float(title[0].group(2)) - float(title[1].group(2))) < 1e-3  # one centre for both lines
    ylabel = [lines["平均训练损失"], lines["（发散的画在 5 处）"]]
    assert all("text-anchor: middle" in m.group(1) and m.group(4) == "-90" for m in ylabel)
    assert abs(float(ylabel[0].group(3)) - float(ylabel[1].group(3))) < 1e-3  # rotated: one centre, vertically
    tick = [lines["LayerNorm(768)，小"], lines["32x128"]]
    assert all("text-anchor: end" in m.group(1) for m in tick)
    assert abs(float(tick[0].group(2)) - float(tick[1].group(2))) < 1e-3


def test_figure_problems_are_named():
    pytest.importorskip("matplotlib")
    _, problems = zh._figure_labels(_drawn(xlabel=r"learning rate $\eta$"))
    assert any("mixes words and TeX" in p for p in problems)
    labels, problems = zh._figure_labels(_drawn(xlabel=r"$\eta / \|W\|^2$"))
    assert not problems and not labels  # pure TeX needs no translation
    outlined = _svg(lambda ax: ax.set_xlabel("training step"), rc={"svg.fonttype": "path"})
    _, problems = zh._figure_labels(outlined)
    assert any("glyph outlines" in p for p in problems)


def test_glossary_gives_every_term_a_chinese_name():
    assert len(_glossary()) >= 40


@pytest.mark.parametrize("src", _notebooks(), ids=lambda p: p.stem)
def test_chinese_chapters_use_the_glossarys_terms(src):
    """Every term a chapter links to the glossary appears in its Chinese text under the glossary's name."""
    pairs = list(_pairs(src))
    english = " ".join(en for _, en, _ in pairs)
    chinese = " ".join(_visible(tr) for _, _, tr in pairs)
    missing = []
    for head, names in _glossary().items():
        if re.search(r"\{term\}`[^`]*" + re.escape(head.split(" (")[0]), english):
            if not any(n in chinese for n in names):
                missing.append(f"{head} -> {names}")
    assert not missing, f"{src.name}: glossary terms the Chinese text never uses: {missing}"


def _normalise(text):
    return re.sub(r"[\s$\\{}]", "", text).replace("，", ",").replace("：", ":").replace("（", "(").replace("）", ")")


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the source articles (../shared/seeds) are not beside this checkout")
def test_chinese_errata_quote_the_articles_own_words():
    seeds = _normalise("".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("0*.txt"))))
    src = ROOT / "book" / "08_errata.ipynb"
    quotes = [(cid, q) for cid, _, tr in _pairs(src) for q in re.findall(r"「([^」]+)」", tr)]
    assert len(quotes) > 40
    # the scraped articles garble their formulas, so a quote's math is left out of
    # the comparison and every piece of its words must be in an article
    missing = [
        (cid, q) for cid, q in quotes
        if not all(part in seeds for text in re.split(r"\$[^$]*\$", q) for part in _normalise(text).split("…") if part)
    ]
    assert not missing, "quotes not found in the articles:\n" + "\n".join(f"  {c}: 「{q}」" for c, q in missing)
