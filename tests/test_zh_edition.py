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
    code = [zh.code_tokens(c.source) for c in english.cells if c.cell_type == "code"]
    assert [zh.code_tokens(c.source) for c in chinese.cells if c.cell_type == "code"] == code  # comments aside
    assert chinese.cells[0].source == english.cells[0].source
    assert "normlib-setup" in chinese.cells[0].metadata.get("tags", [])


def test_a_translated_listing_keeps_the_code_and_takes_the_articles_comments():
    """Where an article's listing is shown with the article's own Chinese comments (``"code"`` entries), the
    code is the English cell's token for token, and every Chinese comment is the article's, word for word."""
    articles = "".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("00*.txt")))
    flat = re.sub(r"\s+", "", articles)
    found = 0
    for src in _notebooks():
        for cid, entry in zh._translation(src).get("code", {}).items():
            assert zh.code_tokens(entry["zh"]) == zh.code_tokens(entry["en"]), f"{src.name} {cid}: code changed"
            # the first line heads the listing in the book's own words
            for comment in re.findall(r"#\s*(.*)", entry["zh"].split("\n", 1)[1]):
                if re.search(r"[\u4e00-\u9fff]", comment):
                    found += 1
                    assert re.sub(r"\s+", "", comment) in flat, f"{src.name} {cid}: not the article's words: {comment}"
    assert found >= 10, "chapter 06's listing of article 002 should carry the article's comments"
    assert zh.code_tokens("x = 1  # 注释\n# 另一行\n") == zh.code_tokens("x = 1  # a comment\n")
    assert zh.code_tokens("x = 1  # 注释") != zh.code_tokens("x = 2  # 注释")  # a changed constant is not a comment


def test_a_stale_or_untranslated_cell_is_shown_in_english_under_a_notice(tmp_path):
    """A reader sees why a paragraph is in English: the build puts the notice (class zh-stale) above it."""
    src = _notebooks()[0]
    nb = nbformat.read(src, as_version=4)
    md = zh._markdown_cells(nb)
    md[1].source += "\n\nA sentence added after the translation was made."
    md[2].id = "not-translated-yet"
    copy = tmp_path / src.name  # same name: the same stored translations apply
    nbformat.write(nb, copy)
    chinese, fallback = zh.zh_notebook(copy)
    cells = {c.id: c.source for c in zh._markdown_cells(chinese)}
    assert cells[md[1].id] == zh.with_notice(md[1].source, "stale")
    assert cells["not-translated-yet"] == zh.with_notice(md[2].source, "missing")
    assert '<p class="zh-stale"' in cells[md[1].id] and len(fallback) == 2
    assert cells[md[0].id] == zh._translation(src)["cells"][md[0].id]["zh"]
    assert "p.zh-stale" in (ROOT / "_static" / "book.css").read_text()


@pytest.mark.parametrize("why", ["stale", "missing"])
def test_the_stale_notice_renders_as_html_above_the_english(why):
    """The notice is raw HTML in the cell's markdown: MyST (the parser the book is built with) passes it through
    to the page as a paragraph of class zh-stale, before the English it explains."""
    import docutils.core
    from myst_parser.parsers.docutils_ import Parser

    english = "A paragraph with *emphasis* and $x^2$."
    html = docutils.core.publish_parts(zh.with_notice(english, why), parser=Parser(), writer_name="html5",
                                       settings_overrides={"myst_enable_extensions": ["dollarmath"],
                                                           "report_level": 4})["body"]
    notice = f'<p class="zh-stale" lang="zh-CN">{zh.STALE_NOTICE[why]}</p>'
    assert notice in html and html.index(notice) < html.index("<em>emphasis</em>"), html


def test_a_renamed_caption_or_title_is_reported(monkeypatch):
    assert not zh._names_status()
    first = next(iter(zh.CAPTIONS))
    monkeypatch.setattr(zh, "CAPTIONS", {k: v for k, v in zh.CAPTIONS.items() if k != first} | {"Gone": "旧"})
    monkeypatch.setattr(zh, "TITLE_EN", "An older title")
    problems = [" ".join(p) for p in zh._names_status()]
    assert any("title" in p and "An older title" in p for p in problems), problems
    assert any(repr(first) in p and "no Chinese caption" in p for p in problems), problems
    assert any("'Gone'" in p and "unused" in p for p in problems), problems


def test_stale_shows_what_changed_and_mark_fresh_wants_a_new_translation(tmp_path, monkeypatch, capsys):
    src = _notebooks()[0]
    data = json.loads((ROOT / "book" / "zh" / (src.name + ".json")).read_text(encoding="utf-8"))
    cid = next(iter(data["cells"]))
    english = data["cells"][cid]["en"]
    data["cells"][cid]["en"] = english.replace(english.split()[-1], "OLDWORD")  # made from an older English
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    stored = zh._translation
    monkeypatch.setattr(zh, "_translation", lambda s: data if s == src else stored(s))
    monkeypatch.setattr(zh, "status", lambda: [(src.relative_to(ROOT).as_posix(), cid, "stale")])
    zh.show_stale()
    out = capsys.readouterr().out
    assert "-" in out and "OLDWORD" in out and data["cells"][cid]["zh"] in out
    monkeypatch.setattr(zh, "_committed_chinese", lambda p, c: data["cells"][cid]["zh"])
    with pytest.raises(SystemExit, match="same-translation"):
        zh.mark_fresh(str(path), [cid])
    zh.mark_fresh(str(path), [cid], same_translation=True)
    assert json.loads(path.read_text(encoding="utf-8"))["cells"][cid]["en"] == english


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


def _zh_glossary_text():
    """The Chinese edition's glossary page (book/zh/glossary.md.json)."""
    return zh._translation(ROOT / "book" / "glossary.md")["zh"]


def _glossary_block(text):
    return text.split("```{glossary}")[1].split("```")[0]


def _head_lines(text):
    """The term lines (heads) of a glossary page: the block's lines that are not indented definitions."""
    return [line for line in _glossary_block(text).splitlines() if line.strip() and not line.startswith(" ")]


def _glossary(text=None):
    """``{head: [its Chinese names]}`` from the term lines of book/glossary.md, or of the glossary page ``text``."""
    text = (ROOT / "book" / "glossary.md").read_text(encoding="utf-8") if text is None else text
    terms = {}
    for head in _head_lines(text):
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


# Terms whose Chinese name in the text is not the head's Chinese: bfloat16 is written as such in Chinese
# engineering text (the head's 浮点格式 describes it).
_SETTLED_NAMES = {
    "bfloat16": ["bfloat16"],
}


@pytest.mark.parametrize("src", _notebooks(), ids=lambda p: p.stem)
def test_chinese_chapters_use_the_glossarys_terms(src):
    """Every term a chapter links to the glossary appears in its Chinese text under the Chinese glossary's name."""
    pairs = list(_pairs(src))
    english = " ".join(en for _, en, _ in pairs)
    chinese = " ".join(_visible(tr) for _, _, tr in pairs)
    missing = []
    for head, names in _glossary(_zh_glossary_text()).items():
        term = head.split(" (")[0]
        names = _SETTLED_NAMES.get(term, []) + names
        if re.search(r"\{term\}`[^`]*" + re.escape(term), english):
            if not any(n in chinese for n in names):
                missing.append(f"{head} -> {names}")
    assert not missing, f"{src.name}: glossary terms the Chinese text never uses: {missing}"


def _term_targets(text):
    """The glossary heads that the ``{term}`` roles of ``text`` link to (Sphinx matches them case-blind)."""
    roles = re.finditer(r"\{term\}`(?:[^`<]*<([^`>]+)>|([^`]+))`", text)
    return {(m.group(1) or m.group(2)).strip().lower() for m in roles}


def _heads(text):
    return {line.strip().lower() for line in _head_lines(text)}


def _translated_texts():
    """``(file name, where, Chinese text)`` for every translation: notebook cells, whole pages, figure labels."""
    for path in sorted((ROOT / "book" / "zh").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if path == zh.FIGURES:
            yield from ((path.name, f"label {k!r}", v) for k, v in data["labels"].items())
        elif "cells" in data:
            yield from ((path.name, f"cell {cid}", e["zh"]) for cid, e in data["cells"].items())
        else:
            yield path.name, "page", data["zh"]


def test_glossary_links_resolve_in_either_glossary():
    """A Chinese chapter links to heads that both glossaries define, and so does the English text the build shows
    for a stale cell: whichever glossary page the Chinese build uses (the English one while the translation of
    the glossary is stale), every link finds its term; a missing term fails the build."""
    english_heads = _heads((ROOT / "book" / "glossary.md").read_text(encoding="utf-8"))
    chinese_heads = _heads(_zh_glossary_text())
    links = {(name, where, t) for name, where, text in _translated_texts() for t in _term_targets(text)}
    for src in (zh._source(page) for page in zh._toc_files()):
        if src.suffix == ".md":
            links |= {(src.name, "page (English)", t) for t in _term_targets(src.read_text(encoding="utf-8"))}
            continue
        for cell in zh._markdown_cells(nbformat.read(src, as_version=4)):
            links |= {(src.name, f"cell {cell.id} (English)", t) for t in _term_targets(cell.source)}
    bad = [f"{name} {where}: {t}" for name, where, t in sorted(links) if t not in english_heads & chinese_heads]
    assert not bad, "links to a term that one of the two glossaries lacks:\n" + "\n".join(bad)


# The words the source articles use for a glossary term (one name in the book, the articles' names listed
# beside it in the Chinese glossary, so that a reader coming from an article finds the term).
_ARTICLE_WORDS = {
    "Pre-Norm": ["层归一化前置"],
    "Post-Norm": ["层归一化后置"],
    "Running statistics": ["移动平均", "移动方差"],
    "Multi-head attention": ["注意力头"],
    "Causal mask": ["下三角掩码"],
    "Saturation": ["饱和区"],
    "Output projection": ["输出投影层"],
    "Identity branch": ["跳跃连接"],
    "Scale γ and shift β": ["偏移参数", "仿射变换"],
    "Epsilon ε": ["小常数"],
    "Biased variance": ["有偏估计"],
}


def _entries(text):
    """``{English name of each head: the whole entry (its heads and definition)}`` of a glossary page."""
    entries = {}
    for entry in re.split(r"\n\s*\n", _glossary_block(text)):
        for head in (line for line in entry.splitlines() if line.strip() and not line.startswith(" ")):
            entries[head.split(" (")[0].strip()] = entry
    return entries


def test_chinese_glossary_lists_the_articles_words():
    entries = _entries(_zh_glossary_text())
    missing = [f"{term}: {w}" for term, words in _ARTICLE_WORDS.items() for w in words if w not in entries.get(term, "")]
    assert not missing, f"words of the articles that the Chinese glossary does not list under their term: {missing}"
    if SEEDS.is_dir():
        seeds = "".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("0*.txt")))
        assert not [w for words in _ARTICLE_WORDS.values() for w in words if w not in seeds]


# One word per term (issue 39): the variant each decision retired, and the word that replaced it.
_RETIRED = {
    "脑浮点数": "bfloat16 (or BF16)",
    "最后一位单位": "末位单位（ulp）",
    "小批次": "小批量 for a mini-batch, 「批次很小时」 for small batches",
    "批量大小": "批大小",
    "批次大小": "批大小",
    "接法": "连接方式",
    "无归一化，He": "无归一化，Kaiming 初始化 (He initialisation is Kaiming 初始化 throughout)",
    "位尾数": "个有效数字位 (the significand's bits; 尾数 is only the stored fraction)",
    "滑动平均统计量": "移动平均统计量",
    "滑动均值": "移动均值",
    "滑动方差": "移动方差",
    "离不开随机": "停留在随机猜测水平 (the networks stay at chance)",
    "第二项任务": "第二个作用 (the article's 作用)",
    "词元": "token (as the articles write it)",
    "大规模激活": "巨量激活 (massive activations)",
}
# Words the errata's translation still uses while it is being revised on its own (book/zh/08_errata.part*.json).


def test_each_term_has_one_chinese_word():
    """No translation uses a retired variant, outside the articles' own words (「quotes」) and the glossary's heads."""
    english_heads = _heads((ROOT / "book" / "glossary.md").read_text(encoding="utf-8"))
    found = []
    for name, where, text in _translated_texts():
        text = re.sub(r"「[^」]*」", "", _visible(text))
        text = "\n".join(line for line in text.splitlines() if line.strip().lower() not in english_heads)
        for word, instead in _RETIRED.items():
            if word in text:
                found.append(f"{name} {where}: {word} -> {instead}")
    assert not found, "retired variants:\n" + "\n".join(found)


def test_the_attention_chapter_says_attention_head():
    """Article 002's 注意力头: in chapter 06 every cell that speaks of a head says 注意力头 before a bare 头."""
    src = ROOT / "book" / "06_attention_by_hand.ipynb"
    chinese = [(cid, tr) for cid, _, tr in _pairs(src)]
    assert sum(tr.count("注意力头") for _, tr in chinese) >= 10
    bare = []
    for cid, tr in chinese:
        text = re.sub(r"「[^」]*」|`[^`]*`|\$[^$]*\$", "", tr).replace("注意力头", "\0")
        text = re.sub(r"[多单手开]头", "", text)
        if "头" in text and ("\0" not in text or text.index("头") < text.index("\0")):
            bare.append(cid)
    assert not bare, f"cells that say 头 before 注意力头: {bare}"


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
