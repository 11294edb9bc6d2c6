"""Sphinx extension for the Chinese edition: the theme's own words, and the citations', in Simplified Chinese.

Sphinx's and the themes' zh_CN catalogs leave some strings in English (the
heading anchors' "Link to this heading", the search box, the colour-mode
switch, the footer's copyright line) and give one in Taiwan usage (列印成 PDF);
Jupyter Book sets the search box's placeholder in English as a theme option.
The strings here are put in front of those catalogs, in mainland usage, once
every extension and theme has loaded its catalogs (builder-inited), so the
templates and the themes' Python code, which look them up when a page is
written, find them.

Citations: the English edition's author-year style writes "Ba *et al.* [2016]",
an italic English phrase in the middle of a Chinese sentence. The edition's
style (``author_year_zh``, set by book/_tools/zh_edition.py) writes
"Ba 等 [2016]" and "Ioffe 和 Szegedy".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from gettext import GNUTranslations

import sphinxcontrib.bibtex.plugin
from pybtex.richtext import Text
from sphinx import locale
from sphinxcontrib.bibtex.style.referencing import PersonStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle

STRINGS = {
    "Link to this heading": "链接到此标题",
    "Print to PDF": "打印为 PDF",
    "Color mode": "颜色模式",
    "System Settings": "跟随系统设置",
    "© Copyright %(copyright)s.": "© 版权所有 %(copyright)s。",
    "Copyright %(copyright)s": "版权所有 %(copyright)s",
}


SEARCH_BAR_TEXT = "搜索本书……"  # a theme option (Jupyter Book sets it in English), not a catalog string


def _search_bar(app, config):
    if (config.language or "").startswith("zh"):
        config.html_theme_options = dict(config.html_theme_options or {}, search_bar_text=SEARCH_BAR_TEXT)


def _translate(app):
    if not (app.config.language or "").startswith("zh"):
        return
    for translator in locale.translators.values():
        if isinstance(translator, GNUTranslations):
            translator._catalog.update(STRINGS)  # type: ignore[attr-defined]


def _chinese_persons() -> PersonStyle:
    return PersonStyle(sep="、", sep2=" 和 ", last_sep=" 和 ", other=Text(" 等"))


@dataclass
class AuthorYearChinese(AuthorYearReferenceStyle):
    person: PersonStyle = field(default_factory=_chinese_persons)


CITATION_STYLE = "author_year_zh"
sphinxcontrib.bibtex.plugin.register_plugin("sphinxcontrib.bibtex.style.referencing", CITATION_STYLE,
                                            AuthorYearChinese)


def setup(app):
    app.connect("config-inited", _search_bar)
    app.connect("builder-inited", _translate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
