"""Sphinx extension: every page links to the same page in the other edition.

The English book is built into ``_build/html`` and the Chinese edition
(``book/_tools/zh_edition.py``) into ``_build/html/zh``, with the same page
paths, so ``book/01_layer_norm.html`` and ``zh/book/01_layer_norm.html`` are
one chapter in two languages. The edition a build makes is the config value
``normlib_edition`` (``"en"``, the default, or ``"zh"``).
"""

from __future__ import annotations

_OTHER = {"en": ("zh/", "zh-CN", "中文"), "zh": ("../", "en", "English")}


def _link(app, pagename, templatename, context, doctree):
    if "body" not in context or doctree is None:
        return
    prefix, lang, label = _OTHER[app.config.normlib_edition]
    up = "../" * pagename.count("/")
    href = f"{up}{prefix}{pagename}.html"
    context["body"] = (
        f'<p class="edition-switch"><a href="{href}" hreflang="{lang}" lang="{lang}">{label}</a></p>\n'
        + context["body"]
    )


def setup(app):
    app.add_config_value("normlib_edition", "en", "html", types=[str])
    app.connect("html-page-context", _link)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
