"""The Chinese edition (中文版): the English chapters with translated prose.

    python book/_tools/zh_edition.py build    # assemble _build/zh-src and build it into _build/html/zh
    python book/_tools/zh_edition.py check    # fail naming every stale or missing translation
    python book/_tools/zh_edition.py stale    # show each stale cell: what changed in its English, and its Chinese
    python book/_tools/zh_edition.py mark-fresh FILE CELL_ID...   # after updating a translation

One source of code and outputs. A Chinese chapter is its English notebook
with each markdown cell's text replaced by the translation stored in
``book/zh/<file>.json``; code cells and their stored outputs are the English
ones, copied, never re-executed. A code cell may have its comments translated
(``"code"`` in the same file, e.g. an article's listing with the article's own
Chinese comments): it is used only while it has exactly the English cell's
tokens without comments, so it runs the same code. A markdown page (``intro.md``, ...) is
replaced whole. Each translation keeps the English text it was made from
(``en``): when the English changes, the translation is *stale*. ``check``
(run by ``make test``) fails naming every stale or missing cell, every part
caption of ``_toc.yml`` without a Chinese one in ``CAPTIONS`` and a book title
that changed since ``TITLE`` was made from it; ``build`` shows such a cell in
English under a line that says why (``zh-stale``), so the Chinese edition
never shows an outdated sentence as if it were current, nor English without
a word of explanation.

Figures are translated where they are drawn: the chapters' SVG figures keep
their text as text (``svg.fonttype: none`` in ``book/matplotlibrc``), and the
build replaces each label by its entry in ``book/zh/figures.json`` (English
label -> Chinese; an entry may keep the English, for names such as
LayerNorm). ``check`` also fails naming every label that has no entry, every
entry no figure uses any more, every label that mixes words and TeX (write it
in Unicode, so that it can be translated whole) and every figure drawn with
glyph outlines.

A translator updating a stale cell: ``stale`` prints what changed in the
cell's English (a diff against the English the translation was made from) and
the Chinese; edit the ``zh`` text in the JSON file, then ``mark-fresh
book/zh/<file>.json <cell id>`` stores the new English. It refuses a cell
whose Chinese is the same as in the last commit (an English change that needs
no change in the Chinese, such as a fixed typo, is marked with
``--same-translation``).

The edition is its own Sphinx project under ``_build/zh-src`` (the same
``_config.yml`` with Chinese titles, ``language: zh_CN`` and Chinese search,
which segments words with jieba), built into ``_build/html/zh`` so that every
page has the same path in both editions; ``book/_ext/edition.py`` puts a
link to the other edition's page on every page, ``book/_ext/zh_search.py``
cuts a reader's query into the index's words in the browser, and
``book/_ext/zh_theme.py`` gives the theme's own strings in Chinese.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import html
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path
from xml.sax.saxutils import escape

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
ZH = BOOK / "zh"
SRC = ROOT / "_build" / "zh-src"
OUT = ROOT / "_build" / "html" / "zh"

# The book's title and the parts' captions in _toc.yml, each with the English it translates.
TITLE_EN = "Normalization in Deep Learning, by Running Code"
TITLE = "归一化：用可运行的代码读懂深度学习中的归一化层"
CAPTIONS = {
    "LayerNorm": "层归一化 LayerNorm",
    "Going deeper": "深入",
    "Performance": "性能",
    "Corrections": "勘误",
    "Using the library": "使用 normlib",
    "Back matter": "附录",
}


def _toc_files() -> list[str]:
    """Every page of the book, as ``_toc.yml`` lists it (``book/01_layer_norm``)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def _source(page: str) -> Path:
    for suffix in (".ipynb", ".md"):
        p = ROOT / (page + suffix)
        if p.exists():
            return p
    raise FileNotFoundError(f"_toc.yml lists {page!r}, which is neither .ipynb nor .md")


def _translation(src: Path) -> dict:
    """The stored translation of ``src`` (notebook cells from every ``<name>*.json`` part)."""
    parts = sorted(ZH.glob(src.name + ".json")) + sorted(ZH.glob(src.stem + ".part*.json"))
    merged: dict = {}
    for p in parts:
        data = json.loads(p.read_text(encoding="utf-8"))
        if "cells" in data:
            merged.setdefault("cells", {}).update(data["cells"])
            merged.setdefault("code", {}).update(data.get("code", {}))
            merged.setdefault("files", {}).update({cid: p for cid in [*data["cells"], *data.get("code", {})]})
        else:
            merged.update(data, file=p)
    return merged


def _markdown_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "markdown"]


def code_tokens(source: str) -> list[tuple[int, str]]:
    """A code cell's tokens without its comments: two sources with the same tokens run the same code."""
    skip = (tokenize.COMMENT, tokenize.NL)
    return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]


def _entry(data: dict, cell_id: str) -> dict | None:
    """One cell's translation in a translation file's data: its prose (``cells``) or its comments (``code``)."""
    return data.get("cells", {}).get(cell_id) or data.get("code", {}).get(cell_id)


def is_fresh(entry: dict | None, english: str) -> bool:
    """Whether a translation was made from this English (the one rule for staleness)."""
    return entry is not None and "zh" in entry and entry.get("en") == english


# What a reader of the Chinese edition sees above prose that is shown in English (styled in _static/book.css).
STALE_NOTICE = {
    "stale": "此段英文原文在翻译之后有改动，中文译文尚未更新，暂以英文原文显示。",
    "missing": "此段尚未翻译，暂以英文原文显示。",
}


def with_notice(english: str, why: str) -> str:
    """``english`` under the line that tells the reader why it is not in Chinese."""
    return f'<p class="zh-stale" lang="zh-CN">{STALE_NOTICE[why]}</p>\n\n{english}'


FIGURES = ZH / "figures.json"
SVG = "image/svg+xml"
_PLAIN_TEXT = re.compile(r"(<text\b[^>]*>)([^<]*)(</text>)")
_MATH_GROUP = re.compile(r"<!-- (.*?) -->\s*<g transform=[^>]*>\s*<text>\s*<tspan", re.S)
_OUTLINED = re.compile(r"<!-- [^>]*? -->\s*(?:<g transform=[^>]*>\s*)?<defs>\s*<path id=\"DejaVu")
_WORD = re.compile(r"[A-Za-z]{2,}")


def _figure_labels(svg: str) -> tuple[set[str], list[str]]:
    """The labels of one SVG figure that need a translation, and what is wrong with the figure."""
    labels = {html.unescape(m.group(2)) for m in _PLAIN_TEXT.finditer(svg) if _WORD.search(html.unescape(m.group(2)))}
    problems = []
    for m in _MATH_GROUP.finditer(svg):
        words = _WORD.findall(re.sub(r"\$[^$]*\$", "", m.group(1)))
        if words:
            problems.append(f"label {m.group(1)!r} mixes words and TeX: write it in Unicode (η, ‖W‖², ∂L) "
                            "so that it can be translated whole")
    if _OUTLINED.search(svg):
        problems.append("drawn with glyph outlines, not text: re-execute it (book/matplotlibrc sets svg.fonttype)")
    return labels, problems


def _figures(page_src: Path) -> list[str]:
    """Every SVG figure of a chapter: its stored outputs, and the SVG files its prose shows from book/data."""
    if page_src.suffix != ".ipynb":
        return []
    nb = nbformat.read(page_src, as_version=4)
    svgs = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if SVG in out.get("data", {}):
                svgs.append(out["data"][SVG])  # nbformat.read joins a stored list of lines
        if cell.cell_type == "markdown":
            for name in re.findall(r"\]\((data/[^)\s]+\.svg)\)", cell.source):
                svgs.append((BOOK / name).read_text(encoding="utf-8"))
    return svgs


def _figure_table() -> dict[str, str]:
    return json.loads(FIGURES.read_text(encoding="utf-8"))["labels"] if FIGURES.exists() else {}


_GROUP = re.compile(r'(<g id="text_\d+">\s*)((?:<text\b[^>]*>[^<]*</text>\s*){2,})(</g>)')
_LINE = re.compile(r'<text style="([^"]*)" transform="translate\(([-\d.e]+) ([-\d.e]+)\)(?: rotate\(([-\d.e]+)\))?">([^<]*)</text>')


def _width(text: str, style: str) -> float:
    """The width matplotlib gave ``text`` when it laid the figure out (DejaVu Sans at the style's size)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    size = float(re.search(r"font-size: ([\d.]+)px", style).group(1))
    return TextToPath().get_text_width_height_descent(text, FontProperties(family="DejaVu Sans", size=size), ismath=False)[0]


def _realign(group: str, table: dict[str, str]) -> str:
    """A multi-line label's lines, anchored where matplotlib aligned them (left, centre or right) for the English.

    matplotlib writes each line of a multi-line text as its own ``<text>`` at
    the left end of the English line; a translation of another width would
    leave centred or right-aligned lines out of line. Each line's English width
    (measured with matplotlib's own font) gives back the alignment, and the
    line is anchored there instead (``text-anchor: middle`` or ``end``).
    """
    lines = [m for m in _LINE.finditer(group)]
    if len(lines) < 2 or not any(html.unescape(m.group(5)) in table for m in lines):
        return group
    import math

    geo = []
    for m in lines:
        angle = math.radians(float(m.group(4) or 0))
        d = (math.cos(angle), math.sin(angle))  # the direction the text runs in
        x, y = float(m.group(2)), float(m.group(3))
        geo.append((x, y, d, x * d[0] + y * d[1], _width(html.unescape(m.group(5)), m.group(1))))
    for anchor, share in (("start", 0.0), ("middle", 0.5), ("end", 1.0)):
        ends = [along + share * w for _, _, _, along, w in geo]
        if max(ends) - min(ends) < 0.05:
            break
    else:
        return group  # no common alignment: leave the lines where they are
    if anchor == "start":
        return group
    out = group
    for m, (x, y, d, _, w) in zip(lines, geo):
        nx, ny = x + share * w * d[0], y + share * w * d[1]
        rotate = f" rotate({m.group(4)})" if m.group(4) else ""
        line = (f'<text style="{m.group(1)}; text-anchor: {anchor}" transform="translate({nx:.6f} {ny:.6f}){rotate}">'
                f"{m.group(5)}</text>")
        out = out.replace(m.group(0), line, 1)
    return out


@functools.cache
def _cjk_font():
    """book/_tools/cjk_font.py, the module that gives figures the book's Chinese font."""
    spec = importlib.util.spec_from_file_location("_normlib_cjk_font", Path(__file__).resolve().with_name("cjk_font.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_font(nb) -> None:
    """Give every SVG figure of ``nb`` whose labels are Chinese the book's font for them (in place): figures are
    images, which cannot use the page's fonts (``cjk_font.embed_in_svg``; needs ``npm ci``, which make book runs)."""
    embed = _cjk_font().embed_in_svg
    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if SVG in o.get("data", {}):
                o["data"][SVG] = embed(o["data"][SVG])


def translate_svg(svg: str, table: dict[str, str]) -> str:
    """``svg`` with each label that has an entry in ``table`` replaced by its Chinese."""
    def one(m):
        text = html.unescape(m.group(2))
        return m.group(1) + escape(table[text]) + m.group(3) if text in table else m.group(0)

    svg = _GROUP.sub(lambda g: g.group(1) + _realign(g.group(2), table) + g.group(3), svg)
    return _PLAIN_TEXT.sub(one, svg)


def _figure_status() -> list[tuple[str, str, str]]:
    table, used, problems = _figure_table(), set(), []
    for page in _toc_files():
        src = _source(page)
        rel = src.relative_to(ROOT).as_posix()
        for k, svg in enumerate(_figures(src), 1):
            labels, wrong = _figure_labels(svg)
            problems += [(rel, f"figure {k}", w) for w in wrong]
            used |= labels
            problems += [(rel, f"figure {k} label {t!r}", "missing from book/zh/figures.json") for t in sorted(labels - set(table))]
    problems += [("book/zh/figures.json", f"label {t!r}", "unused (no figure has it now)") for t in sorted(set(table) - used)]
    return problems


def _names_status() -> list[tuple[str, str, str]]:
    """The book's title and the parts' captions: each must have the Chinese made from its English now."""
    problems = []
    title = yaml.safe_load((ROOT / "_config.yml").read_text())["title"]
    if title != TITLE_EN:
        problems.append(("_config.yml", f"title {title!r}",
                         f"changed since TITLE was translated from {TITLE_EN!r} (book/_tools/zh_edition.py)"))
    captions = [part["caption"] for part in yaml.safe_load((ROOT / "_toc.yml").read_text()).get("parts", [])]
    problems += [("_toc.yml", f"caption {c!r}", "has no Chinese caption in CAPTIONS (book/_tools/zh_edition.py)")
                 for c in captions if c not in CAPTIONS]
    problems += [("book/_tools/zh_edition.py", f"CAPTIONS entry {c!r}", "unused (no part of _toc.yml has it now)")
                 for c in CAPTIONS if c not in captions]
    return problems


def status() -> list[tuple[str, str, str]]:
    """``(file, cell id or "", "stale"|"missing")`` for every untranslated piece of prose, then every other
    problem: the title and captions, the figures' labels."""
    problems = []
    for page in _toc_files():
        src = _source(page)
        rel = src.relative_to(ROOT).as_posix()
        tr = _translation(src)
        if src.suffix == ".md":
            if "zh" not in tr:
                problems.append((rel, "", "missing"))
            elif not is_fresh(tr, src.read_text(encoding="utf-8")):
                problems.append((rel, "", "stale"))
            continue
        cells = tr.get("cells", {})
        nb = nbformat.read(src, as_version=4)
        for cell in _markdown_cells(nb):
            entry = cells.get(cell.id)
            if entry is None:
                problems.append((rel, cell.id, "missing"))
            elif not is_fresh(entry, cell.source):
                problems.append((rel, cell.id, "stale"))
        code = {c.id: c.source for c in nb.cells if c.cell_type == "code"}
        for cid, entry in tr.get("code", {}).items():
            if cid not in code:
                problems.append((rel, cid, "a comment translation for a cell that is not a code cell"))
            elif not is_fresh(entry, code[cid]):
                problems.append((rel, cid, "stale"))
            elif code_tokens(entry["zh"]) != code_tokens(entry["en"]):
                problems.append((rel, cid, "its Chinese changes the code, not only the comments"))
    return problems + _names_status() + _figure_status()


# Words the search index must keep whole besides the glossary's (jieba would
# split 核函数 into 核 + 函数, and a one-character word is not indexed).
SEARCH_WORDS = ["核函数", "移动平均统计量", "移动均值", "移动方差", "注意力头", "小批量", "批次",
                "勘误", "归一化"]


def _search_dictionary() -> Path:
    """A jieba user dictionary: the glossary's Chinese terms and SEARCH_WORDS, one per line."""
    text = (BOOK / "glossary.md").read_text(encoding="utf-8")
    words = set(SEARCH_WORDS)
    for head in re.findall(r"^(\S.*\(.*\))\s*$", text.split("```{glossary}")[1], re.M):
        words.update(re.findall(r"[\u4e00-\u9fff][\u4e00-\u9fff·]+", head.rsplit("(", 1)[1]))
    path = SRC / "search_words.txt"
    path.write_text("".join(f"{w} 100000 n\n" for w in sorted(words)), encoding="utf-8")
    return path


def _config() -> dict:
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    cfg["title"] = TITLE
    cfg["author"] = "normlib 的作者们"
    cfg["launch_buttons"] = {}  # the Chinese notebooks are built here, not stored in the repository
    sphinx = cfg.setdefault("sphinx", {})
    conf = sphinx.setdefault("config", {})
    conf["language"] = "zh_CN"
    conf["html_search_language"] = "zh"
    conf["html_search_options"] = {"dict": str(_search_dictionary())}
    conf["togglebutton_hint"] = "点击显示"
    conf["togglebutton_hint_hide"] = "点击隐藏"
    # zh_search: queries cut into the index's words in the browser; zh_theme: the theme's strings in Chinese
    sphinx["local_extensions"] = dict(sphinx.get("local_extensions") or {}, edition="book/_ext", zh_search="book/_ext",
                                      zh_theme="book/_ext")
    conf["normlib_edition"] = "zh"
    conf["bibtex_reference_style"] = "author_year_zh"  # "Ba 等 [2016]" (book/_ext/zh_theme.py)
    return cfg


def zh_notebook(src: Path, figures: dict[str, str] | None = None):
    """``(the Chinese notebook of src, the cells shown in English)``: the markdown translated, the code cells and
    their outputs the English ones (the figures' labels translated), so that the Chinese download runs the same
    code from the same set-up cell."""
    figures = _figure_table() if figures is None else figures
    nb = nbformat.read(src, as_version=4)
    out, fallback = copy.deepcopy(nb), []
    tr = _translation(src)
    cells, code = tr.get("cells", {}), tr.get("code", {})
    for cell in _markdown_cells(out):
        entry = cells.get(cell.id)
        if is_fresh(entry, cell.source):
            cell.source = entry["zh"]
        else:
            cell.source = with_notice(cell.source, "missing" if entry is None else "stale")
            fallback.append(f"{src.name} cell {cell.id}")
    for cell in (c for c in out.cells if c.cell_type == "code"):
        # a code cell whose comments are translated (the same tokens): shown with the Chinese comments
        entry = code.get(cell.id)
        if entry is not None:
            if is_fresh(entry, cell.source) and code_tokens(entry["zh"]) == code_tokens(cell.source):
                cell.source = entry["zh"]
            else:
                fallback.append(f"{src.name} code cell {cell.id} (comments in English)")
        for o in cell.get("outputs", []):
            if SVG in o.get("data", {}):
                o["data"][SVG] = translate_svg(o["data"][SVG], figures)
    out.metadata["language_info"] = nb.metadata.get("language_info", {})
    return out, fallback


def build(run_sphinx: bool = True) -> int:
    if SRC.exists():
        shutil.rmtree(SRC)
    (SRC / "book").mkdir(parents=True)
    fallback = []
    figures = _figure_table()
    for page in _toc_files():
        src = _source(page)
        tr = _translation(src)
        dest = SRC / src.relative_to(ROOT)
        if src.suffix == ".md":
            text = src.read_text(encoding="utf-8")
            if is_fresh(tr, text):
                text = tr["zh"]
            else:
                text = with_notice(text, "stale" if "zh" in tr else "missing")
                fallback.append(f"{src.name} (whole page)")
            dest.write_text(text, encoding="utf-8")
            continue
        out, stale = zh_notebook(src, figures)
        fallback += stale
        with_font(out)
        nbformat.write(out, dest)
    # what the build reads besides the pages
    shutil.copy(BOOK / "references.bib", SRC / "book" / "references.bib")
    shutil.copytree(BOOK / "_ext", SRC / "book" / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    data = BOOK / "data"
    if data.exists():
        shutil.copytree(data, SRC / "book" / "data")
        for svg in (SRC / "book" / "data").glob("*.svg"):
            svg.write_text(_cjk_font().embed_in_svg(translate_svg(svg.read_text(encoding="utf-8"), figures)),
                           encoding="utf-8")
    (SRC / "normlib").symlink_to(ROOT / "normlib", target_is_directory=True)  # for {literalinclude}
    for extra in ("_static", "_assets"):
        if (ROOT / extra).exists():
            shutil.copytree(ROOT / extra, SRC / extra)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    for part in toc.get("parts", []):
        part["caption"] = CAPTIONS.get(part["caption"], part["caption"])
    (SRC / "_toc.yml").write_text(yaml.safe_dump(toc, allow_unicode=True, sort_keys=False))
    (SRC / "_config.yml").write_text(yaml.safe_dump(_config(), allow_unicode=True, sort_keys=False))
    if fallback:
        print(f"zh edition: {len(fallback)} piece(s) of prose stale or untranslated, shown in English:")
        for f in fallback:
            print("  " + f)
    if not run_sphinx:
        return 0
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb), "build", str(SRC), "--warningiserror", "--nitpick", "--keep-going"]
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        return rc
    if OUT.exists():
        shutil.rmtree(OUT)
    shutil.copytree(SRC / "_build" / "html", OUT)
    print(f"The Chinese edition is built. Open: file://{OUT}/index.html")
    return 0


def describe(rel: str, where: str, what: str) -> str:
    """One line for one problem of ``status()``."""
    if what in ("stale", "missing"):
        return f"{rel}{' cell ' + where if where else ''}: translation {what}"
    return f"{rel} {where}: {what}"


def check() -> int:
    problems = status()
    for problem in problems:
        print(describe(*problem))
    if problems:
        print(f"{len(problems)} stale or missing translation(s); "
              "`python book/_tools/zh_edition.py stale` shows them (README, 'The Chinese edition')")
        return 1
    print("zh edition: every translation is up to date")
    return 0


def show_stale() -> int:
    for rel, cell_id, what in status():
        if what not in ("stale", "missing"):
            print("=== " + describe(rel, cell_id, what))
            continue
        src = ROOT / rel
        print(f"=== {rel}{' cell ' + cell_id if cell_id else ''} ({what})")
        tr = _translation(src)
        if cell_id:
            now = next(c for c in nbformat.read(src, as_version=4).cells if c.id == cell_id).source
            entry = _entry(tr, cell_id)
        else:
            now, entry = src.read_text(encoding="utf-8"), (tr if "zh" in tr else None)
        if entry is None:
            print("--- English (no translation yet):\n" + now)
            continue
        print("--- What changed in the English since the translation was made:")
        diff = difflib.unified_diff(entry.get("en", "").splitlines(), now.splitlines(), "translated from", "English now",
                                    lineterm="", n=1)
        print("\n".join(diff))
        print("--- Chinese (made from the English before the change):\n" + entry["zh"])
    return 0


def _committed_chinese(path: Path, cell_id: str | None) -> str | None:
    """The Chinese of one translation as the last commit has it (None where git or the commit lacks it)."""
    try:
        rel = path.resolve().relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (ValueError, OSError, subprocess.CalledProcessError):
        return None
    data = json.loads(text)
    entry = _entry(data, cell_id) if cell_id else data
    return entry.get("zh") if entry else None


def mark_fresh(file: str, cell_ids: list[str], same_translation: bool = False) -> int:
    """Store the English each named translation (or a page's) is now made from. A translation whose English
    changed but whose Chinese is the same as in the last commit is refused unless ``same_translation``."""
    path = Path(file)
    data = json.loads(path.read_text(encoding="utf-8"))
    src = ROOT / data["source"]
    if "cells" not in data:
        targets = {None: (data, src.read_text(encoding="utf-8"))}
    else:
        nb = nbformat.read(src, as_version=4)
        targets = {}
        for cid in cell_ids:
            kind = "markdown" if cid in data["cells"] else "code" if cid in data.get("code", {}) else None
            if kind is None:
                raise SystemExit(f"cell {cid!r}: not in {file} (add its translation first)")
            english = {c.id: c.source for c in nb.cells if c.cell_type == kind}
            if cid not in english:
                raise SystemExit(f"cell {cid!r}: not a {kind} cell of {data['source']}")
            entry = data["cells"][cid] if kind == "markdown" else data["code"][cid]
            targets[cid] = (entry, english[cid])
    for cid, (entry, now) in targets.items():
        where = f"{file}{' cell ' + cid if cid else ''}"
        changed = entry.get("en") not in (None, now)
        if changed and not same_translation and entry["zh"] == _committed_chinese(path, cid):
            raise SystemExit(f"{where}: its English changed but its Chinese is as committed; update the "
                             "translation (`stale` shows what changed), or pass --same-translation if the "
                             "change needs none")
        entry["en"] = now
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--no-sphinx", action="store_true", help="assemble _build/zh-src only")
    sub.add_parser("check")
    sub.add_parser("stale")
    m = sub.add_parser("mark-fresh")
    m.add_argument("file")
    m.add_argument("cell_ids", nargs="*")
    m.add_argument("--same-translation", action="store_true",
                   help="the English changed in a way that needs no change in the Chinese (a typo, a link)")
    args = parser.parse_args()
    if args.command == "build":
        return build(not args.no_sphinx)
    if args.command == "check":
        return check()
    if args.command == "stale":
        return show_stale()
    return mark_fresh(args.file, args.cell_ids, args.same_translation)


if __name__ == "__main__":
    sys.exit(main())
