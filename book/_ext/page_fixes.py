"""Sphinx extension: two small fixes so that pages load without console errors.

1. Jupyter Book 1 registers some inline scripts twice (sphinx-thebe's
   configuration among them), so every page declared ``const THEBE_JS_URL``
   twice and the browser reported a SyntaxError. Each script is emitted once.
2. On a reader's first visit pydata-sphinx-theme sets ``data-mode=""`` from
   empty localStorage and then logs "Got invalid theme mode" as an error; an
   empty mode is set to the theme's own default, "auto", before it looks.
"""

_DEFAULT_MODE = 'if (!document.documentElement.dataset.mode) { document.documentElement.dataset.mode = "auto"; }'


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        # the same inline script is registered once with filename None and once with ""
        key = (str(getattr(js, "filename", js) or ""), getattr(js, "attributes", {}).get("body"))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def setup(app):
    app.add_js_file(None, body=_DEFAULT_MODE, priority=100)
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
