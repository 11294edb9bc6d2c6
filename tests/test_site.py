"""The built book: its links and buttons, then every page in headless Chromium (make test-site).

Run through ``make test`` (which builds the book first and sets
NORMLIB_SITE_DIR). The checks that read the HTML need nothing else. The
browser checks need Debian's ``chromium`` and ``chromium-driver``: without
them they are skipped with a clear reason (the rest still runs, and pytest
exits 0), unless NORMLIB_REQUIRE_BROWSER=1 (set by CI), where they fail.

Links outside the build: a button or link may lead to a repository only if
it is the configured one (NORMLIB_REPOSITORY_URL, read by the build too; see
book/_ext/repository.py); without that setting the book has no repository,
issue or launch buttons at all. Any other external link must be a reference
listed in REFERENCES below.
"""

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from bs4 import BeautifulSoup

SITE = os.environ.get("NORMLIB_SITE_DIR")
REQUIRE = os.environ.get("NORMLIB_REQUIRE_BROWSER") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

ROOT = Path(SITE).resolve() if SITE else None
PAGES = (
    # the pages of both editions (zh/ holds the Chinese one), not the theme's files under _static/
    sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.html")
           if not any(part.startswith("_") for part in p.relative_to(ROOT).parts))
    if ROOT and ROOT.is_dir()
    else []
)
SHOTS = ROOT.parent / "screenshots" if ROOT else None

# The repository the book was built for: the same setting, normalised the same way, as the build's.
_spec = importlib.util.spec_from_file_location(
    "_normlib_book_repository", Path(__file__).resolve().parents[1] / "book" / "_ext" / "repository.py"
)
_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_repository)
REPOSITORY = _repository.repository_url()
BRANCH = "main"  # repository.branch in _config.yml

# The Chinese edition's build script: how it translates the figures' labels.
_zh_spec = importlib.util.spec_from_file_location(
    "_normlib_zh_edition", Path(__file__).resolve().parents[1] / "book" / "_tools" / "zh_edition.py"
)
zh = importlib.util.module_from_spec(_zh_spec)
_zh_spec.loader.exec_module(zh)


# External pages the text links to on purpose, each checked by hand to exist.
# A new one belongs here (a link to any other repository is not allowed).
REFERENCES = (
    "https://github.com/computationalmodelling/nbval",
    "https://doi.org/",
    "https://arxiv.org/abs/",
)
# Where a launch button takes a notebook, for the configured repository only.
LAUNCHERS = ("https://mybinder.org/", "https://colab.research.google.com/")


@pytest.fixture(scope="session")
def site():
    if ROOT is None:
        pytest.skip("NORMLIB_SITE_DIR not set: run the site checks through `make test` (or `make test-site`)")
    if not ROOT.is_dir():
        pytest.fail(f"NORMLIB_SITE_DIR={SITE} is not a directory: build the book first (make book)")
    return ROOT


@pytest.fixture(scope="module")
def driver(site):
    if not (CHROMIUM and CHROMEDRIVER):
        if REQUIRE:
            pytest.fail("NORMLIB_REQUIRE_BROWSER=1 but chromium and chromedriver are not on the PATH")
        pytest.skip(
            "chromium and chromedriver are not installed: browser checks skipped "
            "(apt-get install chromium chromium-driver to run them; CI always does)"
        )
    d = _chrome()
    yield d
    d.quit()


def _chrome(env=None, *args):
    """A headless Chromium that logs the console and the network; ``env`` for its processes, ``args`` added."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
        "--window-size=1280,1600", *args,
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER, env=env), options=opts)
    d.set_page_load_timeout(60)
    return d


def _load(driver, url):
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("performance")  # drop what earlier pages logged
    driver.get_log("browser")
    driver.get(url)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    # let MathJax finish typesetting, if the page loads it
    driver.set_script_timeout(30)
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "if (window.MathJax && MathJax.startup && MathJax.startup.promise) {"
        "  MathJax.startup.promise.then(() => done(true), () => done(false)); } else { done(true); }"
    )


def _requests(driver):
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def _page_url(page):
    return (ROOT / page).as_uri()


def test_there_are_pages(site):
    assert "index.html" in PAGES and "search.html" in PAGES
    assert sum(p.startswith("book/0") for p in PAGES) >= 7
    # the Chinese edition (book/_tools/zh_edition.py): the same pages under zh/
    english = {p for p in PAGES if p.startswith("book/")}
    assert english and english <= {p.removeprefix("zh/") for p in PAGES if p.startswith("zh/book/")}


def _edition_link(path: Path):
    soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
    return soup.select("p.edition-switch a[href]")


@pytest.mark.parametrize("page", [p for p in PAGES if "book/" in p])
def test_every_page_links_to_itself_in_the_other_edition(site, page):
    links = _edition_link(ROOT / page)
    assert len(links) == 1, f"{page}: {len(links)} links to the other edition"
    target = ((ROOT / page).parent / links[0]["href"]).resolve().relative_to(ROOT).as_posix()
    other = page.removeprefix("zh/") if page.startswith("zh/") else "zh/" + page
    assert target == other, f"{page}: the edition link goes to {target}, not {other}"
    lang = BeautifulSoup((ROOT / page).read_text(encoding="utf-8"), "html.parser").html.get("lang", "")
    assert lang.startswith("zh") == page.startswith("zh/"), f"{page}: <html lang={lang!r}>"


@pytest.mark.browser
@pytest.mark.parametrize("page", PAGES)
def test_page_loads_offline_and_renders(driver, page):
    _load(driver, _page_url(page))
    # 1. nothing leaves the build: every request is a file inside it (or inline data)
    urls = _requests(driver)
    assert any(u.startswith(_page_url(page).split("?")[0].rsplit("/", 1)[0]) for u in urls), f"{page}: no request recorded"
    outside = [u for u in urls if not (u.startswith(ROOT.as_uri() + "/") or u.startswith("data:") or u.startswith("blob:"))]
    assert not outside, f"{page} requested resources outside the build: {outside[:5]}"
    # 2. no console errors
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{page} console errors: {errors[:3]}"
    # 3. every math expression typeset by MathJax, no raw TeX left in the text
    n_math, n_typeset, text = driver.execute_script(
        "const math = document.querySelectorAll('.math, span.math, div.math');"
        "const body = document.body.cloneNode(true);"
        "body.querySelectorAll('pre, code, script, style, mjx-container, .highlight').forEach(e => e.remove());"
        "return [math.length, document.querySelectorAll('mjx-container').length, body.innerText];"
    )
    assert n_typeset >= n_math, f"{page}: {n_math} math elements but {n_typeset} typeset"
    for raw in ("\\(", "\\[", "$$", "\\frac", "\\sqrt"):
        assert raw not in text, f"{page}: raw TeX {raw!r} left in the page text"
    assert not re.search(r"(?<![\w$])\$[^$\n]{1,80}\$(?![\w$])", text), f"{page}: raw $...$ left in the page text"
    # 4. every image loaded
    broken = driver.execute_script(
        "return Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);"
    )
    assert not broken, f"{page}: images that did not load: {broken}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / (page.replace("/", "_").removesuffix(".html") + ".png")))


_ids_cache = {}


def _ids(path: Path):
    if path not in _ids_cache:
        soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
        _ids_cache[path] = {t["id"] for t in soup.find_all(id=True)} | {t["name"] for t in soup.find_all("a", attrs={"name": True})}
    return _ids_cache[path]


@pytest.mark.parametrize("page", PAGES)
def test_internal_links_resolve(site, page):
    path = ROOT / page
    soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
    bad = []
    for a in soup.find_all("a", href=True):
        href = a["href"]
        parts = urlsplit(href)
        if parts.scheme or href.startswith("//") or href.startswith("mailto:"):
            continue  # external links are links, not requests
        target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            bad.append(href)
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _ids(target):
            bad.append(href)
    assert not bad, f"{page}: broken internal links {bad[:10]}"


def _search(driver, page, query):
    from urllib.parse import quote

    from selenium.webdriver.support.ui import WebDriverWait

    _load(driver, _page_url(page) + "?q=" + quote(query))
    # Sphinx adds the results one by one (fetching each page for its summary) and writes the summary line
    # ("found N pages") only when the last is in: wait for that line, not for the first result
    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script("const s = document.querySelector('#search-results .search-summary');"
                                   "return s !== null && s.innerText.trim().length > 0")
    )
    return driver.execute_script("return Array.from(document.querySelectorAll('#search-results li a')).map(a => a.textContent)")


@pytest.mark.browser
def test_search_finds_layernorm(driver):
    hits = _search(driver, "search.html", "LayerNorm")
    assert any("LayerNorm" in h or "Layer normalization" in h for h in hits), hits[:10]


@pytest.mark.browser
@pytest.mark.parametrize("word", ["层归一化", "勘误", "移动方差"])
def test_chinese_search_finds_chinese_words(driver, word):
    """The Chinese edition's index is segmented into words (jieba), so a word finds its pages."""
    hits = _search(driver, "zh/search.html", word)
    assert len(hits) >= 1, word


def test_chinese_citations_read_as_chinese(site):
    """Citations in the Chinese edition's text say 等 and 和, not an italic "et al." and "and"
    (book/_ext/zh_theme.py); the English edition keeps its own style."""
    bad, seen = [], 0
    for page in PAGES:
        soup = BeautifulSoup((ROOT / page).read_text(encoding="utf-8"), "html.parser")
        for cite in soup.select("span.bibtex-citation"):
            text = cite.get_text()
            if page.startswith("zh/"):
                seen += 1
                if "et al" in text or " and " in text:
                    bad.append(f"{page}: {text[:60]}")
    assert seen >= 5, "too few citations found in the Chinese edition to check"
    assert not bad, bad[:10]


# Phrases of two or three indexed words, none of them a word of the index itself.
ZH_PHRASES = ("归一化层", "训练模式", "测试准确率")


def _zh_prose_pages_with(phrase):
    """The titles (h1) of the Chinese pages whose prose (not code or outputs) contains ``phrase``."""
    titles = set()
    for page in PAGES:
        if not page.startswith("zh/") or page.endswith(("search.html", "genindex.html", "py-modindex.html")):
            continue
        soup = BeautifulSoup((ROOT / page).read_text(encoding="utf-8"), "html.parser")
        article = soup.find("article")
        if article is None or article.h1 is None:
            continue
        for code in article.select("div.cell_input, div.cell_output, pre"):
            code.decompose()
        if phrase in article.get_text():
            titles.add(article.h1.get_text().replace("#", "").strip())
    return titles


@pytest.mark.browser
@pytest.mark.parametrize("phrase", ZH_PHRASES)
def test_chinese_search_finds_phrases_that_span_words(driver, phrase):
    """A query is cut into the index's words in the browser (book/_ext/zh_search.py), as jieba cut the pages,
    so a phrase finds every page whose prose contains it."""
    expected = _zh_prose_pages_with(phrase)
    assert expected, f"no Chinese page contains {phrase!r}: choose another phrase"
    hits = set(_search(driver, "zh/search.html", phrase))
    assert expected <= hits, f"{phrase!r}: pages that contain it but were not found: {sorted(expected - hits)}"


@pytest.mark.browser
@pytest.mark.parametrize("page", ["zh/book/04_batchnorm_across_devices.html", "zh/book/08_errata.html", "zh/intro.html"])
def test_chinese_text_is_never_slanted(driver, page):
    """Chinese typography has no italics: no element whose own text holds Chinese characters is set italic."""
    _load(driver, _page_url(page))
    slanted = driver.execute_script("""
        const out = [];
        for (const el of document.querySelectorAll("article *")) {
          const own = Array.from(el.childNodes).filter((n) => n.nodeType === 3).map((n) => n.textContent).join("");
          if (/\\p{Script=Han}/u.test(own) && getComputedStyle(el).fontStyle !== "normal") out.push(own.slice(0, 40));
        }
        return out;""")
    assert not slanted, f"{page}: Chinese set in italics: {slanted[:5]}"


@pytest.mark.browser
def test_the_chinese_theme_speaks_mainland_chinese(driver):
    """The theme's own strings (book/_ext/zh_theme.py): no English and no Taiwan usage in the page's chrome."""
    _load(driver, _page_url("zh/book/01_layer_norm.html"))
    html = driver.page_source
    for english in ("Link to this heading", "Search this book", "Print to PDF", "Color mode", "Copyright"):
        assert english not in html, english
    assert "列印" not in html
    assert "打印为 PDF" in html and "链接到此标题" in html


# The book's Chinese font (book/_tools/cjk_font.py).
_cjk_spec = importlib.util.spec_from_file_location(
    "_normlib_cjk_font", Path(__file__).resolve().parents[1] / "book" / "_tools" / "cjk_font.py"
)
cjk = importlib.util.module_from_spec(_cjk_spec)
_cjk_spec.loader.exec_module(cjk)


def _shipped_ranges(edition_root):
    css = (edition_root / "cjk" / cjk.CSS).read_text(encoding="utf-8")
    files = re.findall(r'url\("([^"]+)"\)', css)
    missing = [f for f in files if not (edition_root / "cjk" / f).exists()]
    assert not missing, f"{edition_root}: the font stylesheet names files that are not there: {missing}"
    return [r for spec in re.findall(r"unicode-range:\s*([^;]+);", css) for r in cjk.parse_ranges(spec)]


def test_every_chinese_character_of_every_page_is_in_the_books_font(site):
    """A reader without a CJK font sees Chinese, not boxes, on every page of both editions: each CJK character
    a page shows (its text, titles and attributes) lies in a slice of the font the book serves."""
    problems = []
    for edition in (ROOT, ROOT / "zh"):
        ranges = _shipped_ranges(edition)
        for page in PAGES:
            path = ROOT / page
            if (edition == ROOT) == page.startswith("zh/"):
                continue
            chars = set(cjk._CJK.findall(path.read_text(encoding="utf-8")))
            left = chars - cjk.covered(ranges, chars)
            if left:
                problems.append(f"{page}: {''.join(sorted(left))}")
    assert not problems, "characters the book's font does not hold (make book re-selects the slices):\n" + "\n".join(problems)


def test_every_chinese_figure_carries_the_font_for_its_labels(site):
    """Figures are images and cannot use the page's fonts: each SVG of the Chinese edition whose labels hold CJK
    characters embeds a font whose character map has every one of them, listed first for its labels."""
    import base64
    import io

    from fontTools.ttLib import TTFont

    figures = sorted((ROOT / "zh" / "_images").glob("*.svg"))
    checked = 0
    for svg_path in figures:
        svg = svg_path.read_text(encoding="utf-8")
        labels = set(cjk._CJK.findall("".join(cjk._TEXT.findall(svg))))
        if not labels:
            continue
        checked += 1
        held = set()
        for data in re.findall(r"data:font/woff;base64,([A-Za-z0-9+/=]+)", svg):
            held |= {chr(c) for c in TTFont(io.BytesIO(base64.b64decode(data))).getBestCmap()}
        assert labels <= held, f"{svg_path.name}: labels without the book's font: {''.join(sorted(labels - held))}"
        families = re.findall(r"font-family:\s*([^;\"]*)", svg)
        assert all(f.startswith(f"'{cjk.FAMILY}'") for f in families if "DejaVu" in f), svg_path.name
    assert checked >= 20, f"only {checked} Chinese figures found"


def _fontconfig_without_cjk(tmp_path):
    """A fontconfig file that sees only a Latin font folder of this machine, or None."""
    latin = next((d for d in (Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts/truetype/liberation"))
                  if d.is_dir()), None)
    if latin is None:
        return None
    conf = tmp_path / "fonts.conf"
    conf.write_text(f"<?xml version=\"1.0\"?>\n<fontconfig><dir>{latin}</dir><cachedir>{tmp_path / 'cache'}</cachedir>"
                    "</fontconfig>\n")
    return conf


@pytest.mark.browser
def test_chinese_is_drawn_on_a_machine_without_a_cjk_font(driver, tmp_path):
    """Chromium with fontconfig limited to a Latin font folder (no CJK font at all) draws a Chinese page
    with the book's own font: the faces the page needs load, and they hold the page's characters."""
    conf = _fontconfig_without_cjk(tmp_path)
    if conf is None:
        pytest.skip("no DejaVu or Liberation font folder to build a font set without CJK from")
    env = dict(os.environ, FONTCONFIG_FILE=str(conf))
    if shutil.which("fc-list"):
        import subprocess

        listed = subprocess.run(["fc-list", ":lang=zh"], env=env, capture_output=True, text=True, timeout=60).stdout
        assert not listed.strip(), f"the font set meant to lack CJK has some: {listed[:200]}"
    bare = _chrome(env, f"--user-data-dir={tmp_path / 'profile'}")
    try:
        _load(bare, _page_url("zh/book/01_layer_norm.html"))
        bare.set_script_timeout(60)
        state = bare.execute_async_script("""
            const done = arguments[arguments.length - 1];
            document.fonts.ready.then(() => {
              const faces = Array.from(document.fonts).filter((f) => f.family.includes("(book)"));
              const text = document.querySelector("article").innerText;
              const han = Array.from(new Set(text.match(/\\p{Script=Han}/gu))).join("");
              done({loaded: faces.filter((f) => f.status === "loaded").length, han: han.length,
                    drawn: document.fonts.check('16px "Noto Sans SC (book)"', han),
                    marked: document.documentElement.classList.contains("normlib-no-cjk-font")});
            });""")
        if SHOTS:
            SHOTS.mkdir(parents=True, exist_ok=True)
            bare.save_screenshot(str(SHOTS / "zh-01-without-system-cjk-font.png"))
    finally:
        bare.quit()
    assert state["han"] > 100, state
    assert state["marked"], f"the page did not see that this machine has no CJK font (book/_ext/page_fixes.py): {state}"
    assert state["loaded"] >= 1 and state["drawn"], f"the book's font did not supply the page's Chinese: {state}"


@pytest.mark.browser
def test_a_machine_with_a_cjk_font_does_not_load_the_books(driver):
    """Where the system has a CJK font, the page uses it: it is not marked, and no face of the book's font loads."""
    import subprocess

    if not (shutil.which("fc-list") and subprocess.run(["fc-list", ":lang=zh"], capture_output=True, text=True,
                                                        timeout=60).stdout.strip()):
        pytest.skip("this machine has no CJK font (CI installs fonts-wqy-microhei)")
    _load(driver, _page_url("zh/book/01_layer_norm.html"))
    driver.set_script_timeout(60)
    state = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        document.fonts.ready.then(() => done({
          marked: document.documentElement.classList.contains("normlib-no-cjk-font"),
          loaded: Array.from(document.fonts).filter((f) => f.family.includes("(book)") && f.status !== "unloaded").length,
        }));""")
    assert state == {"marked": False, "loaded": 0}, state


def _external_links(path: Path):
    soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
    return [a["href"] for a in soup.find_all("a", href=True) if urlsplit(a["href"]).scheme in ("http", "https") or a["href"].startswith("//")]


def _repository_parts():
    owner, repo = urlsplit(REPOSITORY).path.strip("/").split("/")
    return owner, repo


def _is_the_repositorys(url: str) -> bool:
    """The configured repository itself, a page of it, or a launcher opening one of its notebooks."""
    if not REPOSITORY:
        return False
    if url == REPOSITORY or url.startswith(REPOSITORY + "/"):
        return True
    owner, repo = _repository_parts()
    launch_paths = (f"/v2/gh/{owner}/{repo}/{BRANCH}?", f"/github/{owner}/{repo}/blob/{BRANCH}/")
    return url.startswith(LAUNCHERS) and any(p in url for p in launch_paths)


@pytest.mark.parametrize("page", PAGES)
def test_links_outside_the_build_are_the_repositorys_or_references(site, page):
    bad = [u for u in _external_links(ROOT / page) if not (_is_the_repositorys(u) or u.startswith(REFERENCES))]
    assert not bad, (
        f"{page}: links outside the build that are neither the configured repository's "
        f"(NORMLIB_REPOSITORY_URL={REPOSITORY or 'unset'}) nor listed in REFERENCES: {bad[:5]}"
    )


def test_chinese_chapters_download_as_notebooks_with_chinese_prose(site):
    chapters = sorted(p for p in PAGES if re.match(r"zh/book/0\d[a-z]?_.*\.html$", p))
    figures = zh._figure_table()
    assert len(chapters) >= 10
    for page in chapters:
        name = Path(page).stem
        html = (ROOT / page).read_text(encoding="utf-8")
        assert f"_sources/book/{name}.ipynb" in html, f"{page}: no download button"
        nb = nbformat.read(ROOT / "zh" / "_sources" / "book" / f"{name}.ipynb", as_version=4)
        english = nbformat.read(ROOT / "_sources" / "book" / f"{name}.ipynb", as_version=4)
        prose = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert len(re.findall(r"[\u4e00-\u9fff]", prose)) > 500, f"{page}: the downloaded notebook's prose is not Chinese"
        # the same code cells (token for token: a listing may carry translated comments), in the same order,
        # with the same stored outputs, but for the figures, whose labels are the Chinese of book/zh/figures.json
        code = [(zh.code_tokens(c.source), c.get("outputs")) for c in nb.cells if c.cell_type == "code"]
        for cell in english.cells:
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                if zh.SVG in out.get("data", {}):
                    out["data"][zh.SVG] = cjk.embed_in_svg(zh.translate_svg(out["data"][zh.SVG], figures))
        assert code == [(zh.code_tokens(c.source), c.get("outputs")) for c in english.cells if c.cell_type == "code"], page
        svgs = [o["data"][zh.SVG] for _, outs in code for o in outs or [] if zh.SVG in o.get("data", {})]
        assert any("训练" in svg for svg in svgs) or not any("training" in svg for svg in svgs), page
        # launch buttons would open the English notebook: the Chinese edition has none
        assert not [u for u in _external_links(ROOT / page) if u.startswith(LAUNCHERS)], page


def test_notebook_pages_offer_download_and_launch_buttons(site):
    chapters = sorted(p for p in PAGES if re.match(r"book/0\d[a-z]?_.*\.html$", p))
    assert chapters
    for page in chapters:
        name = Path(page).stem
        html = (ROOT / page).read_text(encoding="utf-8")
        # the download button (the .ipynb with its outputs) is there either way
        assert f"_sources/book/{name}.ipynb" in html, f"{page}: no download button"
        assert (ROOT / "_sources" / "book" / f"{name}.ipynb").exists()
        links = _external_links(ROOT / page)
        launch = [u for u in links if u.startswith(LAUNCHERS)]
        if not REPOSITORY:
            assert not launch, f"{page}: launch buttons without a configured repository: {launch}"
            assert not [u for u in links if "github.com/normlib/normlib" in u]
            continue
        owner, repo = _repository_parts()
        assert REPOSITORY in links, f"{page}: no repository button for {REPOSITORY}"
        assert any(u.startswith(REPOSITORY + "/issues/new") for u in links), f"{page}: no issue button"
        assert any(u.startswith(f"https://mybinder.org/v2/gh/{owner}/{repo}/{BRANCH}?urlpath=") and u.endswith(f"book/{name}.ipynb") for u in launch), launch
        if REPOSITORY.startswith("https://github.com/"):
            colab = f"https://colab.research.google.com/github/{owner}/{repo}/blob/{BRANCH}/book/{name}.ipynb"
            assert colab in launch, launch


# The live cells (book/_ext/live_cells.py): code cells tagged `live`, run in the page by the book's own Pyodide.
# A worker and WebAssembly from file:// are refused by browsers, so these pages are served over HTTP here, from
# 127.0.0.1 on a free port, as a reader's web server would serve them; the server records every path it serves.
# The worker's own requests do not reach the page's network log, so this browser sends every request for
# another host to a second local server, a proxy that records what was asked and answers none of it.
# Chromium asks a few hosts of its own (sign-in, its clock, its updater, its optimization hints) whatever it
# loads: seen through that proxy over 25 s with the book's index page from disk (Chromium 156), they are not
# the book's and are left out.
BROWSER_SERVICES = ("accounts.google.com", "clients2.google.com", "update.googleapis.com",
                    "optimizationguide-pa.googleapis.com")

LIVE_PAGES = [p for p in PAGES if "tag_live" in (ROOT / p).read_text(encoding="utf-8")] if PAGES else []


def _stored_live_outputs(page):
    soup = BeautifulSoup((ROOT / page).read_text(encoding="utf-8"), "html.parser")
    return [cell.select_one(".cell_output pre").get_text() for cell in soup.select("div.cell.tag_live")]


@pytest.fixture(scope="module")
def served(site):
    import functools
    import http.server
    import threading
    from types import SimpleNamespace

    record = SimpleNamespace(paths=[], all_paths=set(), outside=[], refuse=set())

    class Book(http.server.SimpleHTTPRequestHandler):
        def send_head(self):  # a path a test refuses is missing, as on a host that lacks the file
            if self.path in record.refuse:
                self.send_error(404, "refused by the test")
                return None
            return super().send_head()

        def log_message(self, *args):
            record.paths.append(self.path)
            record.all_paths.add(self.path)

    class Trap(http.server.BaseHTTPRequestHandler):
        def handle_one_request(self):  # any method, CONNECT included: recorded, refused
            self.raw_requestline = self.rfile.readline(65537)
            if self.raw_requestline and self.parse_request():
                host = urlsplit(self.path if "://" in self.path else "//" + self.path).hostname
                if host not in BROWSER_SERVICES:
                    record.outside.append(self.requestline)
                self.send_error(502, "the book's tests allow no request outside the build")
            self.close_connection = True

        def log_message(self, *args):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Book, directory=str(ROOT))),
               http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trap)]
    threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in servers]
    for t in threads:
        t.start()
    record.url = f"http://127.0.0.1:{servers[0].server_address[1]}/"
    record.proxy = f"http://127.0.0.1:{servers[1].server_address[1]}"
    try:
        yield record
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for t in threads:
            t.join(timeout=10)


@pytest.fixture(scope="module")
def live_driver(driver, served):
    """A Chromium whose requests for any host but this one go to the recording proxy."""
    d = _chrome(None, f"--proxy-server={served.proxy}")
    yield d
    d.quit()


_LIVE_STATE = """
    const cell = document.querySelectorAll("div.cell.tag_live")[arguments[0]];
    const out = cell.querySelector(".cell_output pre");
    const msg = cell.querySelector(".live-message");
    const tb = cell.querySelector(".live-traceback");
    return {busy: cell.querySelector(".live-run").disabled, output: out ? out.textContent : null,
            live: !!cell.querySelector(".cell_output.live-output"), failed: !!cell.querySelector(".live-failed"),
            traceback: tb ? tb.textContent : null, stale: !!cell.querySelector(".cell_output.live-stale"),
            message: msg ? msg.textContent : null, status: cell.querySelector(".live-status").textContent};"""


def _press(driver, index, button="live-run", timeout=120):
    """Press a live cell's button and wait until the run it started has ended; the cell's state."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script(f"document.querySelectorAll('div.cell.tag_live')[arguments[0]].querySelector('.{button}')"
                          ".click()", index)
    WebDriverWait(driver, timeout).until(lambda d: not d.execute_script(_LIVE_STATE, index)["busy"])
    return driver.execute_script(_LIVE_STATE, index)


def _set_code(driver, index, code):
    driver.execute_script("document.querySelectorAll('div.cell.tag_live')[arguments[0]]"
                          ".querySelector('.cell_input pre').textContent = arguments[1];", index, code)


def test_every_chapter_named_has_live_cells_in_both_editions(site):
    for chapter in ("01_layer_norm", "03_layer_norm_vs_batch_norm", "05_normalization_families", "06_attention_by_hand"):
        for edition in ("", "zh/"):
            assert f"{edition}book/{chapter}.html" in LIVE_PAGES, f"{edition}{chapter}: no live cell"
    package = Path(__file__).resolve().parents[1] / "normlib"
    for edition in (ROOT, ROOT / "zh"):
        assert (edition / "pyodide" / "pyodide.asm.wasm").is_file(), f"{edition}: no Pyodide (make book copies it)"
        shipped = edition / "_static" / "live" / "normlib"
        names = json.loads((shipped / "files.json").read_text(encoding="utf-8"))
        assert "pure.py" in names, names
        for name in names:
            assert (shipped / name).read_text(encoding="utf-8") == (package / name).read_text(encoding="utf-8"), name


@pytest.mark.parametrize("page", PAGES)
def test_only_pages_with_live_cells_load_their_script(site, page):
    html = (ROOT / page).read_text(encoding="utf-8")
    assert ("live-cells.js" in html) == (page in LIVE_PAGES), page
    assert "pyodide/" not in html and "live-worker" not in html, f"{page} names the interpreter's files before a Run"


@pytest.mark.browser
@pytest.mark.parametrize("page", LIVE_PAGES)
def test_live_cells_run_in_the_page_and_print_what_the_notebook_stored(live_driver, served, page):
    """Chromium presses Run on every live cell: the output that appears is the one nbval checks in the notebook.
    Nothing of the interpreter is fetched before the first Run; then it comes from the build, and no request
    leaves it; no console errors."""
    driver = live_driver
    served.paths.clear()
    served.outside.clear()
    _load(driver, served.url + page)
    assert not [p for p in served.paths if "pyodide" in p or "live-worker" in p], "the interpreter loaded before a Run"
    expected = _stored_live_outputs(page)
    assert expected and len(expected) == driver.execute_script(
        "return document.querySelectorAll('div.cell.tag_live').length")
    for i, stored in enumerate(expected):
        state = _press(driver, i)
        assert state["message"] is None and not state["failed"], f"{page} live cell {i}: {state}"
        assert state["live"] and state["output"] == stored, f"{page} live cell {i}:\n{state['output']}\n!=\n{stored}"
    # from the build (this page's fetch, or an earlier page's of the same edition, which the browser cached)
    edition = "zh/" if page.startswith("zh/") else ""
    assert {f"/{edition}pyodide/pyodide.asm.wasm", f"/{edition}_static/live/normlib/pure.py"} <= served.all_paths
    assert not served.outside, f"{page}: requests outside the build: {served.outside[:5]}"
    # (a browser asks a web server for /favicon.ico on its own; the book has none)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "/favicon.ico " not in e["message"]]
    assert not errors, f"{page} console errors: {errors[:3]}"
    if page == "book/06_attention_by_hand.html" and SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        driver.execute_script("document.querySelector('div.cell.tag_live').scrollIntoView()")
        driver.save_screenshot(str(SHOTS / "live-cell-after-run.png"))


@pytest.mark.browser
def test_a_live_cell_shows_a_broken_input_as_python_does_and_can_be_stopped_and_reset(live_driver, served):
    import time

    driver, page = live_driver, "book/01_layer_norm.html"
    _load(driver, served.url + page)
    stored = _stored_live_outputs(page)[0]
    _set_code(driver, 0, "from normlib import pure\n\nprint('before')\npure.layer_norm([[1.0, 2.0], [3.0]])\n")
    state = _press(driver, 0)
    out = state["output"]
    assert state["failed"] and out.startswith("before\nTraceback (most recent call last):\n"), state
    assert state["traceback"] == out.removeprefix("before\n"), state  # set apart (in red) from what was printed
    assert 'File "<cell>", line 4, in <module>' in out and "pure.layer_norm([[1.0, 2.0], [3.0]])" in out, out
    assert out.rstrip().endswith("normlib.errors.NormValueError: x is not rectangular: x[0] has shape (2,), "
                                 "x[1] has (1,)"), out
    _set_code(driver, 0, "print(1 +)")
    state = _press(driver, 0)
    assert state["failed"] and 'File "<cell>", line 1' in state["output"], state
    assert state["output"].rstrip().splitlines()[-1].startswith("SyntaxError: "), state
    # a run that does not end: Stop ends the worker, and the next Run starts Python afresh
    _set_code(driver, 0, "while True:\n    pass")
    driver.execute_script("document.querySelector('div.cell.tag_live .live-run').click()")
    time.sleep(1)
    state = driver.execute_script(_LIVE_STATE, 0)
    assert state["busy"] and state["stale"] and state["status"] == "Running…", state
    state = _press(driver, 0, "live-stop")
    assert state["status"] == "Stopped. Run again to start Python afresh.", state
    _press(driver, 0, "live-reset")
    state = _press(driver, 0)
    assert state["output"] == stored and not state["failed"], state
    assert not served.outside, served.outside


@pytest.mark.browser
def test_a_live_cell_says_why_it_cannot_run_from_a_file(driver):
    _load(driver, _page_url("zh/book/01_layer_norm.html"))
    state = _press(driver, 0)
    assert state["message"] and "http.server" in state["message"] and "file://" in state["message"], state
    assert not state["live"], state


@pytest.mark.browser
def test_a_live_cell_says_so_where_webassembly_is_unavailable(live_driver, served):
    """A browser without WebAssembly (some locked-down ones turn it off): the cell says so and keeps its output."""
    driver, page = live_driver, "book/03_layer_norm_vs_batch_norm.html"
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": "delete globalThis.WebAssembly;"})
    try:
        _load(driver, served.url + page)
        assert driver.execute_script("return typeof WebAssembly") == "undefined"
        state = _press(driver, 0)
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})
    assert state["message"] and "WebAssembly" in state["message"], state
    assert state["output"] == _stored_live_outputs(page)[0] and not state["live"], state


@pytest.mark.browser
def test_a_live_cell_says_when_python_cannot_start_and_starts_once_it_can(driver, served, tmp_path):
    """A host that does not serve the interpreter: the Run says Python could not be started and keeps the stored
    output; once the file is there, the next Run starts it (a fresh browser, whose cache holds nothing)."""
    fresh = _chrome(None, f"--proxy-server={served.proxy}", f"--user-data-dir={tmp_path / 'profile'}")
    page = "zh/book/05_normalization_families.html"
    try:
        served.refuse.add("/zh/pyodide/pyodide.asm.wasm")
        _load(fresh, served.url + page)
        state = _press(fresh, 0)
        assert state["message"] and state["message"].startswith("Python 无法启动："), state
        assert state["status"] == "Python 未能启动", state
        assert state["output"] == _stored_live_outputs(page)[0] and not state["live"], state
        served.refuse.clear()
        state = _press(fresh, 0)
        assert state["live"] and state["output"] == _stored_live_outputs(page)[0] and not state["failed"], state
        assert state["message"] is None, state
    finally:
        served.refuse.clear()
        fresh.quit()
