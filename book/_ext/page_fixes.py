"""Sphinx extension: small fixes so that pages load without console errors and draw their Chinese.

1. Jupyter Book 1 registers some inline scripts twice (sphinx-thebe's
   configuration among them), so every page declared ``const THEBE_JS_URL``
   twice and the browser reported a SyntaxError. Each script is emitted once.
2. On a reader's first visit pydata-sphinx-theme sets ``data-mode=""`` from
   empty localStorage and then logs "Got invalid theme mode" as an error; an
   empty mode is set to the theme's own default, "auto", before it looks.
3. On a machine with no CJK font at all, Chinese text reached through the
   system's font fallback stays drawn as boxes in Chromium's sidebar and
   header even after the book's own font (_static/book.css) has loaded. A
   script draws, before the page is laid out, a Chinese character and a
   private-use one (which no font has) in the system fonts the stylesheet
   names for Chinese; where the two come out pixel for pixel the same (both
   boxes), it marks the page
   (``normlib-no-cjk-font``) and the stylesheet puts the book's font first.
   A reader who has a CJK font never loads the book's.
"""

_DEFAULT_MODE = 'if (!document.documentElement.dataset.mode) { document.documentElement.dataset.mode = "auto"; }'


_NO_CJK_FONT = (
    '(() => { const fonts = getComputedStyle(document.documentElement)'
    '.getPropertyValue("--normlib-font-family-cjk-system"); if (!fonts.trim()) return;'
    ' const c = document.createElement("canvas"); c.width = c.height = 40;'
    ' const x = c.getContext("2d", {willReadFrequently: true}); if (!x) return;'
    ' x.font = "32px " + fonts + ", sans-serif"; x.textBaseline = "top";'
    ' const draw = (t) => { x.clearRect(0, 0, 40, 40); x.fillText(t, 0, 0);'
    ' return x.getImageData(0, 0, 40, 40).data.join(","); };'
    # a Chinese character drawn exactly as a private-use one (a box): no font here has it
    ' if (draw("归") === draw("\\ue000")) document.documentElement.classList.add("normlib-no-cjk-font"); })();'
)


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
    app.add_js_file(None, body=_NO_CJK_FONT, priority=100)
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
