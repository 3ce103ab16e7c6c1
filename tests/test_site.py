"""The docs site in a real browser: every page loads offline, math renders, search works.

Uses Debian's ``/usr/bin/chromium`` driven by Playwright (no downloaded browser). The site is
``$OPD_SITE_DIR`` when set (CI builds it once), else built here with ``mkdocs build --strict``.
Where chromium is missing the browser test skips, unless ``OPD_REQUIRE_BROWSER=1`` (set by CI),
in which case it fails. A screenshot of every page goes to ``<site>/_screenshots/``.
"""

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from urllib.parse import urlparse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import mathml  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
REQUIRE_BROWSER = os.environ.get("OPD_REQUIRE_BROWSER") == "1"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def test_mathml_hook_converts_inline_and_display_math():
    page = ('<p>A <span class="arithmatex">\\(\\pi_\\theta &lt; 1\\)</span> and</p>'
            '<div class="arithmatex">\\[\\frac{a}{b}\\]</div>')
    out = mathml.convert_page(page)
    assert "arithmatex" not in out and "\\(" not in out and "\\[" not in out
    assert out.count("<math") == 2 and 'display="block"' in out and "<mfrac>" in out
    # The HTML-escaped "<" of the page reached latex2mathml as "<": it is an operator, and
    # pi_theta is a subscripted identifier (U+03C0, U+03B8).
    assert "<mo>&#x0003C;</mo>" in out
    assert "<msub><mi>&#x003C0;</mi><mi>&#x003B8;</mi></msub>" in out


def test_mathml_hook_refuses_what_it_cannot_convert():
    for bad in ("x^{", "\\foo x", "\\left( x"):
        with pytest.raises(ValueError, match="could not convert"):
            mathml.tex_to_mathml(bad, display=False)


def _skip_or_fail(reason):
    if REQUIRE_BROWSER:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    given = os.environ.get("OPD_SITE_DIR")
    if given:
        path = pathlib.Path(given)
        assert (path / "index.html").exists(), f"OPD_SITE_DIR={given} holds no built site"
        return path
    if shutil.which("mkdocs") is None:
        _skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(["mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                   check=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    if not pathlib.Path(CHROMIUM).exists():
        _skip_or_fail(f"chromium not found at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _pages(site):
    return sorted(str(p.relative_to(site).parent).replace(".", "") for p in site.rglob("index.html")
                  if "_screenshots" not in p.parts)


_VISIBLE_TEXT_WITH_TEX = """() => {
  const root = document.querySelector('article') || document.body;
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const bad = [];
  let node;
  while ((node = walker.nextNode())) {
    if (node.parentElement.closest('pre, code, script, style, details:not([open])')) continue;
    const t = node.textContent;
    if (t.includes('\\\\(') || t.includes('\\\\[') || t.includes('$$')) bad.push(t.slice(0, 80));
  }
  return bad;
}"""

_MATH_SIZES = """() => Array.from(document.querySelectorAll('article math'))
  .filter(m => !m.closest('details:not([open])'))
  .map(m => { const r = m.getBoundingClientRect(); return [r.width, r.height]; })"""

_BROKEN_IMAGES = """() => Array.from(document.images)
  .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"""

# Pages that must show rendered math.
MATH_PAGES = {"", "opd", "mismatch", "api/opd", "api/toy", "api/estimators"}


def test_every_page_loads_offline_with_rendered_math(site, server, browser):
    pages = _pages(site)
    assert {"", "opd", "mismatch", "experiment", "instructors", "api/opd"} <= set(pages)
    shots = site / "_screenshots"
    shots.mkdir(exist_ok=True)
    problems = []
    for path in pages:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors, outside = [], []
        page.on("console", lambda m, e=errors: m.type == "error" and e.append(m.text))
        page.on("pageerror", lambda exc, e=errors: e.append(str(exc)))

        def route(r, o=outside):
            host = urlparse(r.request.url).hostname
            if r.request.url.startswith(("data:", "blob:")) or host == "127.0.0.1":
                return r.continue_()
            o.append(r.request.url)
            return r.abort()

        page.route("**/*", route)
        response = page.goto(f"{server}/{path}/" if path else f"{server}/",
                             wait_until="networkidle")
        where = path or "home"
        if response is None or response.status != 200:
            problems.append(f"{where}: HTTP {response and response.status}")
        broken = page.evaluate(_BROKEN_IMAGES)
        tex = page.evaluate(_VISIBLE_TEXT_WITH_TEX)
        sizes = page.evaluate(_MATH_SIZES)
        problems += [f"{where}: console error {e}" for e in errors]
        problems += [f"{where}: request to {u}" for u in outside]
        problems += [f"{where}: image not loaded {u}" for u in broken]
        problems += [f"{where}: raw TeX in visible text {t!r}" for t in tex]
        problems += [f"{where}: math element of zero size" for w, h in sizes if w <= 0 or h <= 0]
        if path in MATH_PAGES and not sizes:
            problems.append(f"{where}: no rendered math")
        page.screenshot(path=str(shots / f"{where.replace('/', '_')}.png"), full_page=True)
        page.close()
    assert not problems, "\n".join(problems)


def test_search_finds_reverse_kl(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{server}/", wait_until="networkidle")
    page.click("input.md-search__input")
    page.keyboard.type("reverse KL")  # key events: the search listens to them, not to fill()
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    results = page.locator(".md-search-result__item").count()
    meta = page.inner_text(".md-search-result__meta")
    page.close()
    assert results > 0, meta
