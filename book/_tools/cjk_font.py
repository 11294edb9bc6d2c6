"""The Chinese font the book ships: the slices of Noto Sans SC that hold the characters it uses.

    python book/_tools/cjk_font.py    # (make book) writes _assets/cjk/, served at the root of each edition

Both editions carry Chinese (the English one in key-term lists, the glossary
and the articles' quotes), and a machine without a CJK font shows each of
those characters as a box. The book therefore serves a font of its own, from
its own files (no CDN): Noto Sans SC (SIL Open Font License 1.1, installed
from npm as ``@fontsource/noto-sans-sc``), which comes cut into about a hundred
woff2 slices by Unicode range. This script collects every character the pages
can show — the sources of both editions (chapters with their outputs, pages,
translations, figure labels, the edition's title, captions and theme strings)
and the Chinese strings of Sphinx's and the themes' zh_CN catalogs — and
copies the slices that hold any of them, with a stylesheet of their
``@font-face`` rules (``unicode-range``: a browser fetches a slice only when a
page shows one of its characters, and only when no system font named before
it in ``_static/book.css`` has the character) and the font's licence.

``tests/test_site.py`` checks the result on the built pages: every CJK
character of every page lies in a shipped slice, and a browser with no CJK
font on its machine draws the Chinese with this one.

Figures are SVG images, and an image cannot load a page's fonts; a figure
whose labels are Chinese (the Chinese edition's) carries its own font:
``embed_in_svg`` subsets, from the slices' WOFF files, exactly the characters
of its labels (fontTools, which matplotlib already needs) and puts them in the
SVG as data URIs (a few kB), first in each label's font list (it holds no
other character).
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import sys
from functools import cache
from gettext import GNUTranslations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "node_modules" / "@fontsource" / "noto-sans-sc"
OUT = ROOT / "_assets" / "cjk"
FAMILY = "Noto Sans SC (book)"  # its own name, so that an installed Noto Sans SC is never shadowed
CSS = "noto-sans-sc.css"

# Characters a Chinese font must supply: CJK ideographs and their punctuation, full-width forms.
_CJK = re.compile(r"[\u2e80-\u2fff\u3000-\u303f\u3100-\u312f\u31a0-\u31bf\u3400-\u4dbf\u4e00-\u9fff"
                  r"\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef]")
_FACE = re.compile(r"@font-face\s*\{(.*?)\}", re.S)


def _sources() -> list[Path]:
    book = ROOT / "book"
    files = [*book.glob("*.ipynb"), *book.glob("*.md"), *(book / "zh").glob("*.json"), *(book / "_ext").glob("*.py"),
             book / "_tools" / "zh_edition.py", ROOT / "_config.yml", ROOT / "_toc.yml"]
    return [f for f in files if f.exists()]


def _catalog_strings() -> str:
    """The Chinese of the zh_CN message catalogs of Sphinx and the themes the book is built with."""
    import pydata_sphinx_theme
    import sphinx
    import sphinx_book_theme

    text = []
    for package in (sphinx, pydata_sphinx_theme, sphinx_book_theme):
        for mo in Path(package.__file__).parent.rglob("zh_CN/LC_MESSAGES/*.mo"):
            with open(mo, "rb") as f:
                text += [str(v) for v in GNUTranslations(f)._catalog.values()]  # type: ignore[attr-defined]
    return "".join(text)


def characters() -> set[str]:
    text = "".join(f.read_text(encoding="utf-8") for f in _sources()) + _catalog_strings()
    return set(_CJK.findall(text))


def parse_ranges(spec: str) -> list[tuple[int, int]]:
    """``U+4e00-4e0f,U+3001`` -> ``[(0x4e00, 0x4e0f), (0x3001, 0x3001)]``."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.strip().removeprefix("U+").removeprefix("u+").partition("-")
        out.append((int(lo, 16), int(hi or lo, 16)))
    return out


def faces(css: str) -> list[tuple[str, str]]:
    """``(woff2 file name, unicode-range)`` of every ``@font-face`` rule of a fontsource stylesheet."""
    out = []
    for body in _FACE.findall(css):
        src = re.search(r"url\(\./files/([^)]+\.woff2)\)", body)
        ranges = re.search(r"unicode-range:\s*([^;]+);", body)
        if src and ranges:
            out.append((src.group(1), ranges.group(1).strip()))
    return out


def covered(ranges: list[tuple[int, int]], chars: set[str]) -> set[str]:
    return {c for c in chars if any(lo <= ord(c) <= hi for lo, hi in ranges)}


@cache
def _slices() -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    css = (PACKAGE / "400.css").read_text(encoding="utf-8")
    return tuple((name, tuple(parse_ranges(spec))) for name, spec in faces(css))


@cache
def _subset(name: str, chars: str) -> str:
    """The WOFF of one slice cut down to ``chars``, base64-encoded."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    # the timestamp kept as the font has it: the same figure gets the same bytes on every build
    font = TTFont(PACKAGE / "files" / name.replace(".woff2", ".woff"), recalcTimestamp=False)
    options = subset.Options()
    options.name_IDs = ["*"]  # fontTools' default layout features; all the name records (the licence's among them)
    options.notdef_outline = True
    subsetter = subset.Subsetter(options)
    subsetter.populate(text=chars)
    subsetter.subset(font)
    out = io.BytesIO()
    font.flavor = "woff"
    font.save(out)
    return base64.b64encode(out.getvalue()).decode("ascii")


_TEXT = re.compile(r"<text\b[^>]*>([^<]*)</text>")
_FAMILY = re.compile(r"font-family:\s*")


def embed_in_svg(svg: str) -> str:
    """``svg`` with the book's font for the CJK characters of its text labels (unchanged if it has none)."""
    chars = set(_CJK.findall("".join(_TEXT.findall(svg))))
    if not chars:
        return svg
    rules = []
    for name, ranges in _slices():
        hit = "".join(sorted(covered(list(ranges), chars)))
        if hit:
            rules.append(f'@font-face {{ font-family: "{FAMILY}"; '
                         f'src: url(data:font/woff;base64,{_subset(name, hit)}) format("woff"); }}')
    style = "<style>" + " ".join(rules) + "</style>"
    # first in each label's list: the subset holds only the labels' CJK characters, so every other character
    # falls through to the figure's own fonts, while a CJK one never reaches the system's fallback, which in
    # Chromium keeps drawing boxes after a later-listed font has loaded
    svg = _FAMILY.sub(f"font-family: '{FAMILY}', ", svg)
    opening = re.search(r"<svg\b[^>]*>", svg)
    return svg[: opening.end()] + style + svg[opening.end():] if opening else svg


def main() -> int:
    if not PACKAGE.exists():
        print(f"{PACKAGE} is missing: run `npm ci` (make book does)", file=sys.stderr)
        return 1
    chars = characters()
    chosen, rules, left = [], [], set(chars)
    every = faces((PACKAGE / "400.css").read_text(encoding="utf-8"))
    for name, spec in every:
        hit = covered(parse_ranges(spec), chars)
        if hit:
            chosen.append(name)
            left -= hit
            rules.append(f"@font-face {{\n  font-family: \"{FAMILY}\";\n  font-style: normal;\n  font-weight: 400;\n"
                         f"  font-display: swap;\n  src: url(\"{name}\") format(\"woff2\");\n"
                         f"  unicode-range: {spec};\n}}\n")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for name in chosen:
        shutil.copy(PACKAGE / "files" / name, OUT / name)
    shutil.copy(PACKAGE / "LICENSE", OUT / "LICENSE")
    version = json.loads((PACKAGE / "package.json").read_text())["version"]
    head = (f"/* Noto Sans SC, weight 400 (@fontsource/noto-sans-sc {version}, SIL Open Font License 1.1: LICENSE),\n"
            f"   the {len(chosen)} slices that hold the book's {len(chars)} CJK characters: book/_tools/cjk_font.py */\n")
    (OUT / CSS).write_text(head + "\n".join(rules), encoding="utf-8")
    size = sum((OUT / n).stat().st_size for n in chosen) / 2**20
    print(f"cjk font: {len(chars)} characters in {len(chosen)} of {len(every)} "
          f"slices, {size:.1f} MiB, into {OUT.relative_to(ROOT)}"
          + (f"; {len(left)} character(s) no slice holds: {''.join(sorted(left))}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
