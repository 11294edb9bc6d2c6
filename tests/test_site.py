"""The built book, loaded page by page in headless Chromium (make test-site).

Run through ``make test`` (which builds the book first and sets
NORMLIB_SITE_DIR). Without Chromium the checks are skipped with a clear
reason, unless NORMLIB_REQUIRE_BROWSER=1 (set by CI), where they fail.
"""

import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytestmark = pytest.mark.browser

SITE = os.environ.get("NORMLIB_SITE_DIR")
REQUIRE = os.environ.get("NORMLIB_REQUIRE_BROWSER") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

if not SITE:
    pytest.skip("NORMLIB_SITE_DIR not set: run the site checks through `make test`", allow_module_level=True)
if not (CHROMIUM and CHROMEDRIVER):
    if REQUIRE:
        raise RuntimeError("NORMLIB_REQUIRE_BROWSER=1 but chromium/chromedriver are not installed")
    pytest.skip("chromium and chromedriver are not installed: browser checks skipped", allow_module_level=True)

from bs4 import BeautifulSoup  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(SITE).resolve()
SHOTS = ROOT.parent / "screenshots"
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.html") if not p.relative_to(ROOT).parts[0].startswith("_"))


@pytest.fixture(scope="module")
def driver():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
        "--window-size=1280,1600",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _load(driver, url):
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


def test_there_are_pages():
    assert "index.html" in PAGES and "search.html" in PAGES
    assert sum(p.startswith("book/0") for p in PAGES) >= 7


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
def test_internal_links_resolve(page):
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


def test_search_finds_layernorm(driver):
    _load(driver, _page_url("search.html") + "?q=LayerNorm")
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.querySelectorAll('#search-results li').length") > 0
    )
    hits = driver.execute_script("return Array.from(document.querySelectorAll('#search-results li a')).map(a => a.textContent)")
    assert any("LayerNorm" in h or "Layer normalization" in h for h in hits), hits[:10]


def test_notebook_pages_offer_download_and_launch_buttons():
    html = (ROOT / "book" / "01_layer_norm.html").read_text(encoding="utf-8")
    assert "01_layer_norm.ipynb" in html  # download as .ipynb
    assert (ROOT / "_sources" / "book" / "01_layer_norm.ipynb").exists()
    assert "colab.research.google.com/github/" in html and "mybinder.org" in html
