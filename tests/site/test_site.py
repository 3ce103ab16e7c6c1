"""The docs site in a real browser: every page loads offline, math renders, search works.

Uses Debian's ``/usr/bin/chromium`` driven by Playwright (no downloaded browser). The site is
``$OPD_SITE_DIR`` when set (CI builds it once). Otherwise the fast tier builds the OPD chapter
alone (``ONE_CHAPTER``) and the slow tier the whole site with ``mkdocs build --strict``.
Where chromium is missing the browser tests skip, unless ``OPD_REQUIRE_BROWSER=1`` (set by CI),
in which case they fail. The slow tier's screenshot of every page goes to
``<site>/_screenshots/``, with one in dark mode of the home page and the OPD chapter
(``<page>-dark.png``).
"""

import functools
import http.server
import os
import pathlib
import re
import shutil
import subprocess
import threading
from urllib.parse import urlparse

import explorables  # a docs hook (tests/site/conftest.py)
import numpy as np
import pytest
import typeset  # a docs hook (tests/site/conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
REQUIRE_BROWSER = os.environ.get("OPD_REQUIRE_BROWSER") == "1"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def _typesetter():
    try:
        return typeset.Typesetter()
    except RuntimeError as error:  # MathJax or Node.js missing: the docs extra is not installed
        _skip_or_fail(str(error))


def test_typeset_hook_lays_out_display_sums_and_escaped_operators():
    page = ('<p>A <span class="arithmatex">\\(\\pi_\\theta &lt; 1\\)</span> and</p>'
            '<div class="arithmatex">\\[\\sum_{i=1}^{n} x_i\\]</div>')
    with _typesetter() as typesetter:
        out = typeset.typeset_page(page, typesetter)
        css = typesetter.stylesheet()
    assert "arithmatex" not in out and "\\(" not in out and "\\[" not in out
    assert out.count("<mjx-container") == 2
    inline, display = out.split("<mjx-container")[1:]
    assert 'display="true"' in display and 'display="true"' not in inline
    # Display mode: the sum is a munderover (limits above and below the sign), drawn with the
    # large-operator glyph U+2211 from the size-2 TeX font; inline it would be an msubsup.
    assert "<mjx-munderover" in display and "mjx-c2211 TEX-S2" in display
    # The HTML-escaped "<" reached MathJax as "<": an operator (U+003C), and pi_theta is a
    # subscripted identifier. The hidden MathML says the same for screen readers.
    assert "mjx-c3C" in inline and "<mjx-msub>" in inline
    assert "<mo>&lt;</mo>" in inline and "<mi>&#x3C0;</mi>" in inline
    # The stylesheet loads MathJax's fonts from beside it, the size-2 font among them.
    assert 'url("woff-v2/MathJax_Size2-Regular.woff")' in css


def test_typeset_hook_refuses_what_mathjax_cannot_typeset():
    with _typesetter() as typesetter:
        for bad in ("x^{", "\\foo x", "\\left( x"):
            with pytest.raises(ValueError, match="MathJax could not typeset"):
                typesetter.typeset(bad, display=False)
        # The process goes on after an error.
        assert "<mjx-container" in typesetter.typeset("x", display=False)


def test_typeset_hook_anchors_a_tagged_display_and_refuses_a_number_twice():
    page = ('<div class="arithmatex">\\[a = b \\tag{1}\\]</div>'
            '<div class="arithmatex">\\[c = d\\]</div>')
    with _typesetter() as typesetter:
        out = typeset.typeset_page(page, typesetter)
        assert out.count('id="eq-1"') == 1 and out.index('id="eq-1"') < out.index("<mjx-container")
        with pytest.raises(ValueError, match=r"equation \(1\) is tagged twice"):
            typeset.typeset_page(page.replace("c = d", "c = d \\tag{1}"), typesetter)


def test_the_opd_chapters_equation_links_land_on_their_equation(site):
    page = (pathlib.Path(site) / "opd" / "index.html").read_text()
    assert page.count('id="eq-1"') == 1
    assert 'href="#eq-1"' in page
    # the number MathJax draws is the one the anchor names
    anchor = page.index('id="eq-1"')
    assert "(1)" in re.sub(r"<[^>]+>", "", page[anchor:page.index("</mjx-container>", anchor)]) \
        or "mjx-c31" in page[anchor:page.index("</mjx-container>", anchor)]


def test_built_pages_name_no_host(site):
    """No canonical link or sitemap entry names the dev server: the site publishes as is."""
    named = []
    for path in sorted(site.rglob("*")):
        if path.suffix not in {".html", ".xml"} or "_screenshots" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        # Text that a page shows in code (the README's `mkdocs serve -a 127.0.0.1:8000`) is
        # content, not a link.
        text = re.sub(r"<(pre|code)\b.*?</\1>", "", text, flags=re.S)
        if "127.0.0.1" in text or "localhost" in text:
            named.append(str(path.relative_to(site)))
    assert not named, named
    # A sitemap lists absolute addresses, so it is empty until site_url names the real host.
    locs = re.findall(r"<loc>(.*?)</loc>", (site / "sitemap.xml").read_text(encoding="utf-8"))
    assert all(loc.startswith("https://") for loc in locs), locs


def _skip_or_fail(reason):
    if REQUIRE_BROWSER:
        pytest.fail(reason)
    pytest.skip(reason)


# The one-chapter build of the fast tier: the OPD chapter alone (with the home page and the API
# page it took 3 s longer). The hooks compute only what it uses (docs/hooks/_built.py); the full
# site is built by `mkdocs build --strict` (.ci/run's docs step, whose site it hands over as
# $OPD_SITE_DIR, and the slow tier's `full_site`).
ONE_CHAPTER = ("opd.md",)
# The only warnings the one-chapter build may give: links and cross-references to the pages it
# leaves out (the strict full build checks that every one of them resolves).
# mkdocs 1.6 names the target only where it differs from the link as written (a relative link
# from a subfolder); a clone where the main command never ran has no docs/source/ pages at all.
_LEFT_OUT = re.compile(r"Could not find cross-reference target|"
                       r"contains a link '[^']+', but the target( '[^']+')? is not found among "
                       r"documentation files")


def _build_one_chapter(out):
    """Build ``ONE_CHAPTER`` into ``out`` with mkdocs.yml's theme, hooks and plugins; the
    warnings other than ``_LEFT_OUT`` fail the test."""
    import logging

    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    left_out = "".join(f"!/{page}\n" for page in ONE_CHAPTER)
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=False,
                         nav=[{page: page} for page in ONE_CHAPTER],
                         exclude_docs=f"generated/*.md\nhooks/\n*.md\n{left_out}")
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        build(config)
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    unexpected = [w for w in warnings if not _LEFT_OUT.search(w)]
    assert not unexpected, "\n".join(unexpected)
    return out


def _given_site():
    """``$OPD_SITE_DIR`` (a whole site built beforehand, as .ci/run does), or None."""
    given = os.environ.get("OPD_SITE_DIR")
    if not given:
        return None
    assert (pathlib.Path(given) / "index.html").exists(), f"OPD_SITE_DIR={given} holds no site"
    return pathlib.Path(given)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``$OPD_SITE_DIR`` when set (the full site), else the one-chapter build."""
    given = _given_site()
    if given:
        return given
    try:
        import mkdocs  # noqa: F401 (the docs extra)
    except ImportError:
        _skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    return _build_one_chapter(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def full_site(tmp_path_factory):
    """The whole site: ``$OPD_SITE_DIR``, else built here with ``mkdocs build --strict``."""
    given = _given_site()
    if given:
        return given
    if shutil.which("mkdocs") is None:
        _skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("full_site")
    # NO_MKDOCS_2_WARNING: silences Material's notice about its end of life (not about this site).
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run(["mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                   check=True, timeout=600, env=env)
    return out


def _serve(folder):
    handler = functools.partial(_QuietHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture(scope="module")
def server(site):
    httpd, address = _serve(site)
    yield address
    httpd.shutdown()


@pytest.fixture(scope="module")
def full_server(full_site):
    httpd, address = _serve(full_site)
    yield address
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# The theme sets no web font (the site works offline): its text is the system's Helvetica,
# which fontconfig maps to a font of Helvetica's metrics where one is installed (Liberation Sans,
# which Debian's chromium recommends) and else to a wider one (DejaVu Sans). The widths and
# heights the layout tests measure are those of Helvetica's metrics.
HELVETICA_METRICS = ("Liberation Sans", "Arimo", "Nimbus Sans", "Nimbus Sans L", "Helvetica",
                     "Arial", "TeX Gyre Heros")


def helvetica_font():
    """The family fontconfig gives for Helvetica, or None where ``fc-match`` is missing."""
    try:
        found = subprocess.run(["fc-match", "-f", "%{family}", "Helvetica"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.split(",")[0].strip() if found.returncode == 0 else None


@pytest.fixture(scope="module")
def browser():
    if not pathlib.Path(CHROMIUM).exists():
        _skip_or_fail(f"chromium not found at {CHROMIUM} (apt-get install chromium)")
    family = helvetica_font()
    if family is None:
        _skip_or_fail("fc-match not found: the layout tests check which font draws Helvetica "
                      "(apt-get install fontconfig fonts-liberation)")
    if family not in HELVETICA_METRICS:
        _skip_or_fail(f"Helvetica is drawn in {family!r} here, not a font of its metrics (one of "
                      f"{', '.join(HELVETICA_METRICS)}): the layout tests measure text in them "
                      "(apt-get install fonts-liberation)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _pages(site):
    # the home page's folder is "." (an annotated page's, "source/mismatch.toy", keeps its dot)
    folders = [str(p.relative_to(site).parent) for p in site.rglob("index.html")
               if "_screenshots" not in p.parts]
    return sorted("" if folder == "." else folder for folder in folders)


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

# Every math box, with the content column's width: none may be wider, and no display's content
# either (its box would scroll: a long display is broken into aligned lines instead).
_MATH_BOXES = """() => {
  const article = document.querySelector('article.md-content__inner');
  if (!article) return [{width: -1, height: -1, column: 0, tex: 'NO ARTICLE ' + location.href}];
  const style = getComputedStyle(article);
  const column = article.clientWidth - parseFloat(style.paddingLeft)
                 - parseFloat(style.paddingRight);
  // a table cell's copy of its heading is hidden until the table is stacked (tables.py)
  return Array.from(article.querySelectorAll('mjx-container'))
    .filter(m => !m.closest('details:not([open])') && !m.closest('.opd-cell-label'))
    .map(m => {
      const r = m.getBoundingClientRect();
      const tex = (m.querySelector('mjx-assistive-mml') || m).textContent.slice(0, 60);
      return {width: Math.max(r.width, m.scrollWidth), height: r.height, column: column,
              tex: tex};
    });
}"""

# Every sum and product sign of a display formula that has limits: are they under (and over)
# the sign, centred on it, as in a LaTeX document, or beside it as sub/superscripts?
_DISPLAY_SUM_LIMITS = """() => {
  const out = [];
  const signs = document.querySelectorAll('article mjx-container[display="true"] mjx-mo.mjx-lop');
  for (const sign of signs) {
    if (sign.closest('details:not([open])')) continue;
    if (!sign.querySelector('mjx-c.mjx-c2211, mjx-c.mjx-c220F')) continue;
    const tex = sign.closest('mjx-container').querySelector('mjx-assistive-mml').textContent;
    const op = sign.getBoundingClientRect();
    const under = sign.closest('mjx-munder');
    const script = sign.closest('mjx-msub, mjx-msup, mjx-msubsup');
    if (under && under.querySelector('mjx-base').contains(sign)) {
      const u = under.querySelector(':scope > mjx-row > mjx-under').getBoundingClientRect();
      const centre = (u.left + u.right) / 2;
      let below = u.top >= op.bottom - 1 && centre > op.left && centre < op.right;
      const over = under.closest('mjx-munderover');
      if (over && over.querySelector('mjx-box').contains(under)) {
        const o = over.querySelector(':scope > mjx-over').getBoundingClientRect();
        below = below && o.bottom <= op.top + 1;
      }
      out.push({below: below, tex: tex.slice(0, 60)});
    } else if (script && script.firstElementChild.contains(sign)) {
      out.push({below: false, tex: tex.slice(0, 60)});
    }
  }
  return out;
}"""

# MathJax's TeX fonts that the page has loaded (from the site itself: no request leaves it).
_MATH_FONTS = """() => document.fonts.ready.then(fonts => Array.from(fonts)
  .filter(f => f.family.startsWith('MJXTEX') && f.status === 'loaded').map(f => f.family))"""

_BROKEN_IMAGES = """() => Array.from(document.images)
  .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"""

# Pages that must show rendered math, and those that must show a display sum with limits.
MATH_PAGES = {"opd", "mismatch", "mismatch_practice", "teachers", "api/opd", "api/toy", "api/estimators"}
SUM_PAGES = {"opd", "mismatch", "api/opd"}
# The chapters, screenshot whole.
CHAPTERS = {"", "opd", "mismatch", "experiment", "instructors"}
# Dark mode is one palette for the whole site (Material follows the system's colour scheme):
# checked and screenshot on the home page and on the chapter with the most math.
DARK_PAGES = {"", "opd"}


def _page_problems(browser, server, path, shots, dark=True):
    """Load one page, and in the dark palette too where ``DARK_PAGES`` and ``dark`` ask; the
    list of what is wrong with it. With ``shots`` (a folder), a screenshot of it in each palette
    goes there."""
    problems = []
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors, outside = [], []
    page.on("console", lambda m, e=errors: m.type == "error" and e.append(m.text))
    page.on("pageerror", lambda exc, e=errors: e.append(str(exc)))

    def watch(request, o=outside):
        # Recorded, not intercepted: routing every request through Python doubled the test's
        # time, and a request off the machine fails the test all the same.
        host = urlparse(request.url).hostname
        if not request.url.startswith(("data:", "blob:")) and host != "127.0.0.1":
            o.append(request.url)

    page.on("request", watch)
    # "load" waits for the page's images and stylesheets; the web fonts then by their promise
    # (networkidle would add half a second of quiet per page).
    response = page.goto(f"{server}/{path}/" if path else f"{server}/", wait_until="load")
    page.evaluate("document.fonts.ready.then(() => true)")
    where = path or "home"
    if response is None or response.status != 200:
        problems.append(f"{where}: HTTP {response and response.status}")
    broken = page.evaluate(_BROKEN_IMAGES)
    tex = page.evaluate(_VISIBLE_TEXT_WITH_TEX)
    boxes = page.evaluate(_MATH_BOXES)
    sums = page.evaluate(_DISPLAY_SUM_LIMITS)
    fonts = page.evaluate(_MATH_FONTS)
    problems += [f"{where}: console error {e}" for e in errors]
    problems += [f"{where}: request to {u}" for u in outside]
    problems += [f"{where}: image not loaded {u}" for u in broken]
    problems += [f"{where}: raw TeX in visible text {t!r}" for t in tex]
    problems += [f"{where}: math box of zero size {b['tex']!r}" for b in boxes
                 if b["width"] <= 0 or b["height"] <= 0]
    problems += [f"{where}: math box {b['width']:.0f} px wide in a {b['column']:.0f} px "
                 f"column {b['tex']!r}" for b in boxes if b["width"] > b["column"] + 0.5]
    problems += [f"{where}: display limits beside the sign, not under it {s['tex']!r}"
                 for s in sums if not s["below"]]
    if path in MATH_PAGES and not boxes:
        problems.append(f"{where}: no rendered math")
    if path in MATH_PAGES and "MJXTEX" not in fonts:
        problems.append(f"{where}: MathJax's TeX fonts not loaded (only {fonts})")
    if path in SUM_PAGES and not sums:
        problems.append(f"{where}: no display sum with limits found")
    # Whole chapters; the top of the long API pages (a full-page shot of each is most of the
    # test's time).
    if shots:
        page.screenshot(path=str(shots / f"{where.replace('/', '_')}.png"),
                        full_page=path in CHAPTERS)
    page.close()
    if dark and path in DARK_PAGES:
        # Dark mode: Material follows the system's colour scheme (the palette's media query).
        dark = browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme="dark")
        seen = len(outside)  # the light page's requests are reported above
        dark.on("request", watch)
        dark.goto(f"{server}/{path}/" if path else f"{server}/", wait_until="load")
        dark.evaluate("document.fonts.ready.then(() => true)")
        if dark.evaluate("document.body.getAttribute('data-md-color-scheme')") != "slate":
            problems.append(f"{where}: dark mode not applied")
        if shots:
            dark.screenshot(path=str(shots / f"{where.replace('/', '_')}-dark.png"),
                            full_page=True)
        dark.close()
        problems += [f"{where} (dark): request to {u}" for u in outside[seen:]]
    return problems


def _screenshots(site):
    shots = site / "_screenshots"
    shots.mkdir(exist_ok=True)
    return shots


def test_the_opd_chapter_loads_offline_with_rendered_math(site, server, browser):
    """The fast tier's browser check: one chapter, with display sums, in the light palette (the
    slow tier loads every page, and the home page and this chapter in the dark one too)."""
    assert "opd" in _pages(site) and {"opd"} <= MATH_PAGES & SUM_PAGES & DARK_PAGES
    # No screenshots: whole-page shots were half of this test's time (the slow tier takes them,
    # of every page).
    problems = _page_problems(browser, server, "opd", shots=None, dark=False)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_under_a_sub_path_the_404_page_links_below_it(tmp_path, monkeypatch):
    """With ``OPD_SITE_URL`` naming a sub-path (mkdocs.yml), the page a server shows for a
    missing address at any depth loads its stylesheets and scripts from below that sub-path,
    not from the host's root; without it they are root-absolute (the documented default)."""
    def asset_links(site):
        html = (site / "404.html").read_text(encoding="utf-8")
        return re.findall(r'(?:href|src)="([^"#]+\.(?:css|js|png))"', html)

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.setenv("OPD_SITE_URL", "https://example.org/opd-literate/")
    links = asset_links(_build_one_chapter(tmp_path / "sub"))
    assert links and all(link.startswith("/opd-literate/") for link in links), links
    monkeypatch.delenv("OPD_SITE_URL")
    links = asset_links(_build_one_chapter(tmp_path / "root"))
    assert links and all(link.startswith("/") and not link.startswith("/opd-literate/")
                         for link in links), links


@pytest.mark.slow
def test_every_page_loads_offline_with_rendered_math(full_site, full_server, browser):
    pages = _pages(full_site)
    assert {"", "opd", "mismatch", "experiment", "instructors", "api/opd"} <= set(pages)
    shots = _screenshots(full_site)
    problems = []
    for path in pages:
        problems += _page_problems(browser, full_server, path, shots)
    assert not problems, "\n".join(problems)


# At a phone's width: what is wider than the page, and what scrolls in its own box without the
# shadow that says there is more (displays and tables wider than the column scroll, with it).
_PHONE_PROBLEMS = """() => {
  const out = [];
  if (document.documentElement.scrollWidth > window.innerWidth)
    out.push('the page is ' + document.documentElement.scrollWidth + ' px wide');
  const boxes = 'mjx-container[display="true"], .md-typeset__scrollwrap, .doc-contents table';
  for (const box of document.querySelectorAll('article ' + boxes.split(', ').join(', article '))) {
    if (box.closest('details:not([open])') || box.scrollWidth <= box.clientWidth + 1) continue;
    const style = getComputedStyle(box);
    if (!['auto', 'scroll'].includes(style.overflowX) || !style.backgroundImage.includes('gradient'))
      out.push(box.tagName + ' scrolls without a cue: ' + box.textContent.trim().slice(0, 50));
  }
  return out;
}"""


@pytest.mark.slow
def test_at_a_phones_width_nothing_widens_the_page_and_what_scrolls_shows_a_cue(
        full_site, full_server, browser):
    """390 px (a phone): no page is wider than the screen; a display formula or a table wider
    than the column scrolls inside its box, with a shadow on the side where it goes on."""
    page = browser.new_page(viewport={"width": 390, "height": 844})
    problems, scrolling = [], 0
    for path in _pages(full_site):
        page.goto(f"{full_server}/{path}/" if path else f"{full_server}/", wait_until="load")
        problems += [f"{path or 'home'}: {p}" for p in page.evaluate(_PHONE_PROBLEMS)]
        scrolling += page.evaluate("""() => Array.from(document.querySelectorAll(
            'article mjx-container[display="true"]')).filter(
            m => m.scrollWidth > m.clientWidth + 1).length""")
    page.close()
    assert not problems, "\n".join(problems)
    assert scrolling > 0  # the check saw displays that scroll (they are there at 390 px)


# A chapter's tables and code blocks at a width: each that is wider than the box it is shown in
# (it would scroll sideways). Pages of the API and of the annotated source are left out: their
# parameter tables scroll with the cue (checked above).
_WIDE_BOXES = """() => {
  const out = [];
  for (const box of document.querySelectorAll('article table, article pre > code')) {
    if (box.closest('details:not([open])')) continue;
    const wrap = box.closest('.md-typeset__scrollwrap');
    for (const b of wrap ? [box, wrap] : [box])
      if (b.scrollWidth > b.clientWidth + 1)
        out.push(box.tagName + ' ' + b.scrollWidth + ' px in ' + b.clientWidth + ' px: ' +
                 box.textContent.trim().slice(0, 50));
  }
  return [out, document.querySelectorAll('article table[data-opd-stacked]').length];
}"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_no_table_or_code_block_of_a_chapter_is_wider_than_its_column(full_site, full_server,
                                                                      browser, width):
    """A table too wide for the column is shown row by row (javascripts/tables.js, extra.css);
    a code block wraps. On a phone some tables must be stacked for this to hold, so the test
    also sees that the stacking happened there and nowhere at a laptop's width."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    problems, stacked = [], 0
    for path in _pages(full_site):
        if path.startswith(("api/", "source/")):
            continue
        page.goto(f"{full_server}/{path}/" if path else f"{full_server}/", wait_until="load")
        page.wait_for_timeout(50)
        wide, count = page.evaluate(_WIDE_BOXES)
        problems += [f"{path or 'home'}: {p}" for p in wide]
        stacked += count
    page.close()
    assert not problems, "\n".join(problems)
    assert (stacked > 0) == (width < 600), stacked


# Each explorable at a width: the plot inside its figure's box, and its subplot titles and axis
# tick labels clear of one another.
_EXPLORABLE_FIT = """() => Array.from(document.querySelectorAll('article .js-plotly-plot')).map(gd => {
  const box = gd.closest('figure').getBoundingClientRect(), plot = gd.getBoundingClientRect();
  const titles = Array.from(gd.querySelectorAll('.annotation-text')).map(t => t.getBoundingClientRect());
  let overlap = false;
  for (let i = 0; i < titles.length; i++) for (let j = i + 1; j < titles.length; j++) {
    const a = titles[i], b = titles[j];
    if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom) overlap = true;
  }
  return {id: gd.id, inside: plot.bottom <= box.bottom + 1 && plot.right <= box.right + 1,
          overlap: overlap, stacked: gd.layout.xaxis2 ? gd._fullLayout.xaxis2.domain[0] < 0.5 : null};
})"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_every_explorable_fits_its_figure_and_its_panels_stack_on_a_phone(full_site, full_server,
                                                                          browser, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    seen = []
    for path in ("mismatch", "experiment", "teachers", "mismatch_practice"):
        page.goto(f"{full_server}/{path}/", wait_until="load")
        page.wait_for_timeout(300)
        seen += page.evaluate(_EXPLORABLE_FIT)
    page.close()
    assert len(seen) == 7, seen
    assert all(f["inside"] and not f["overlap"] for f in seen), seen
    # the two-panel bar charts: side by side at a laptop's width, stacked on a phone
    bars = [f["stacked"] for f in seen if f["stacked"] is not None]
    assert len(bars) == 2 and all(stacked == (width < 600) for stacked in bars), seen


# The figures' text as shown: an SVG's user unit is its width's unit (pt), so a font size of
# 10 is 10 pt at the natural size, scaled by the width the page gives the image.
FIGURE_TEXT_PX = 13.0  # ticks, legends, labels: the body's small size
FIGURE_SCRIPT_PX = 9.0  # the exponents of log-axis ticks (matplotlib draws them at 70 %)
FIGURE_TEXT_PHONE_PX = 11.0  # on a phone


@pytest.mark.slow
@pytest.mark.parametrize(("width", "text_px"), [(1280, FIGURE_TEXT_PX),
                                                (390, FIGURE_TEXT_PHONE_PX)])
def test_every_figures_text_is_at_least_the_stated_size_on_screen(full_site, full_server,
                                                                  browser, width, text_px):
    """At a laptop's width the figures fit the column; on a phone they keep their drawn size
    and scroll in their box (extra.css), so that their text stays legible."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    problems, seen = [], 0
    for path in _pages(full_site):
        page.goto(f"{full_server}/{path}/" if path else f"{full_server}/", wait_until="load")
        shown = page.evaluate("""() => Array.from(document.querySelectorAll(
            'article img[src$=".svg"]')).map(i => [i.getAttribute('src'),
            i.getBoundingClientRect().width])""")
        for src, width in shown:
            svg = (full_site / (path or ".") / src).resolve().read_text(encoding="utf-8")
            points = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', svg).group(1))
            scale = width / (points * 96 / 72)  # on screen over natural size
            sizes = [float(v) for v in re.findall(r"font-size: ([\d.]+)px", svg)]
            assert sizes, src
            seen += 1
            on_screen = sorted({round(v * 96 / 72 * scale, 1) for v in sizes})
            main = [v for v in sizes if v * 96 / 72 * scale >= text_px]
            if on_screen[0] < FIGURE_SCRIPT_PX or len(main) < 0.7 * len(sizes):
                problems.append(f"{path or 'home'}: {src} text at {on_screen} px on screen")
    page.close()
    assert seen >= 9 and not problems, "\n".join(problems)


@pytest.mark.slow
def test_search_finds_reverse_kl(full_server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{full_server}/", wait_until="networkidle")
    page.click("input.md-search__input")
    page.keyboard.type("reverse KL")  # key events: the search listens to them, not to fill()
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    results = page.locator(".md-search-result__item").count()
    meta = page.inner_text(".md-search-result__meta")
    page.close()
    assert results > 0, meta


# The explorable figures: the slider of figure ``div_id`` moved by the mouse to step ``index``
# (a click on the rail under that step's label, as a reader would), then the numbers of the
# traces it shows and the slider's current-value text.
_SLIDER_STATE = """(id) => {
  const gd = document.getElementById(id);
  const shown = gd.data.filter(t => t.visible === true);
  // a horizontal bar chart plots its numbers on x, a line chart on y
  return {values: shown.map(t => Array.from(t.orientation === 'h' ? t.x : t.y, Number)),
          current: gd.querySelector('.slider-container .slider-group > .slider-label').textContent,
          active: gd.layout.sliders[0].active};
}"""


_STEP_LABELS = ".slider-container .slider-label-group .slider-label"


def _move_slider(page, div_id, index):
    labels = page.locator(f"#{div_id} {_STEP_LABELS}")
    label = labels.nth(index).bounding_box()
    rail = page.locator(f"#{div_id} .slider-container .slider-rail-rect").bounding_box()
    page.mouse.click(label["x"] + label["width"] / 2, rail["y"] + rail["height"] / 2)
    page.wait_for_timeout(150)
    return page.evaluate(_SLIDER_STATE, div_id)


def _mismatch_numbers(mismatch):
    """The library's numbers for the mismatch explorer at one position, computed here."""
    from opd_literate.mismatch.estimators import comparison_table
    from opd_literate.mismatch.toy import make_toy

    rows = comparison_table(make_toy(mismatch=mismatch), names=list(explorables.MISMATCH_NAMES),
                            N=explorables.BATCH)
    return [[r["rel_bias"] for r in rows], [r["rel_rmse"] for r in rows]]


def _threshold_numbers(cap):
    from opd_literate.mismatch import estimators
    from opd_literate.mismatch.toy import estimator_moments, make_toy

    toy = make_toy(mismatch=explorables.THRESHOLD_MISMATCH)
    moments = [estimator_moments(toy, e) for e in (
        estimators.token_tis(toy, cap=cap), estimators.seq_tis(toy, cap=cap),
        estimators.token_mis(toy, high=cap), estimators.seq_mis(toy, high=cap))]
    return [[m["rel_bias"] for m in moments],
            [m["rel_rmse"](explorables.BATCH) for m in moments]]


def _experiment_numbers(position):
    """Position 0: the mean over seeds of each method's accuracy curve; k: seed k - 1's."""
    import json

    results = json.loads((ROOT / "docs/data/experiment/results.json").read_text())
    curves = []
    for record in results["methods"].values():
        seeds = record["accuracy"]
        curves.append([sum(c) / len(c) for c in zip(*seeds)] if position == 0
                      else list(seeds[position - 1]))
    return curves


@functools.lru_cache(maxsize=None)
def _retokenization_biases(kind):
    """``bias`` of each method of TABLE_METHODS on each draw of ``kind`` (both gradients)."""
    from opd_literate.teachers.cross_tokenizer import TABLE_METHODS, bias, make_cross_toy

    toys = [make_cross_toy(kind, T=3, seed=seed, scale=explorables.RETOKENIZATION_SCALE)
            for seed in explorables.RETOKENIZATION_SEEDS]
    return [[bias(toy, method, **options) for toy in toys] for _, method, options in TABLE_METHODS]


def _retokenization_numbers(gradient):
    """Each method's relative error of ``gradient`` over the draws, for a pair of tokenizers."""
    key = "rel_norm" if gradient == "pathwise" else "total_rel_norm"
    return lambda kind: [[b[key] for b in method] for method in _retokenization_biases(kind)]


def _kept_mass_numbers(top_p):
    """The chapter's kept-mass table at ``top_p``, at the temperature of the chapter's table
    (generate.ENGINE_KEPT_MASS): each target's relative biases, one a row of the table."""
    import generate  # a docs hook (tests/site/conftest.py)

    from opd_literate.mismatch.engine import kept_mass_table
    from opd_literate.mismatch.toy import make_toy

    rows = kept_mass_table(make_toy(), temperature=generate.ENGINE_KEPT_MASS["temperature"],
                           top_p=top_p)
    return [[r[key] for r in rows] for key in ("rel_bias_true", "rel_bias_writable",
                                               "rel_bias_masked")]


def test_the_kept_mass_explorer_starts_at_the_chapters_table_and_spans_its_sentence():
    import generate  # a docs hook (tests/site/conftest.py)

    page = " ".join((ROOT / "docs" / "mismatch_practice.md").read_text().split())
    found = re.search(r"\[Figure\]\(#fig-explore-kept-mass\) gives the first table at ten "
                      r"top-\$p\$ from ([0-9.]+) to ([0-9.]+) ", page)
    assert found, "the sentence of the kept-mass explorer is not on the page"
    top_ps = explorables.KEPT_MASS_TOP_PS
    assert len(top_ps) == 10  # "ten"
    assert (top_ps[0], top_ps[-1]) == tuple(float(x) for x in found.groups())
    assert top_ps[explorables.KEPT_MASS_START] == generate.ENGINE_KEPT_MASS["top_p"]
    assert explorables.KEPT_MASS_TEMPERATURE == generate.ENGINE_KEPT_MASS["temperature"]


# (page, figure, its positions, the label of each, the library's numbers at a position)
EXPLORABLES = [
    ("mismatch", "explore-mismatch", "MISMATCHES", lambda m: f"{m:g}", _mismatch_numbers),
    ("mismatch", "explore-threshold", "THRESHOLDS", lambda c: f"{c:g}", _threshold_numbers),
    ("experiment", "explore-experiment", None, None, _experiment_numbers),
    *[("teachers", f"explore-retokenization-{gradient}", "RETOKENIZATION_KINDS", str,
       _retokenization_numbers(gradient)) for gradient in explorables.RETOKENIZATION_GRADIENTS],
    ("mismatch_practice", "explore-kept-mass", "KEPT_MASS_TOP_PS", lambda p: f"{p:g}",
     _kept_mass_numbers),
]


def _check_explorable(browser, server, page_path, div_id, positions_name, label_of, numbers,
                      color_scheme="light"):
    page = browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme=color_scheme)
    errors = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server}/{page_path}/", wait_until="load")
    page.locator(f"#{div_id} .slider-container").scroll_into_view_if_needed()
    count = page.locator(f"#{div_id} {_STEP_LABELS}").count()
    positions = (getattr(explorables, positions_name) if positions_name
                 else list(range(count)))
    assert count == len(positions) >= 3
    problems = []
    for index in (0, len(positions) // 2, len(positions) - 1):  # three positions, both ends
        state = _move_slider(page, div_id, index)
        expected = numbers(positions[index])
        if state["active"] != index:
            problems.append(f"{div_id}: slider at {state['active']}, not {index}")
        if label_of and not state["current"].endswith(label_of(positions[index])):
            problems.append(f"{div_id}: shows {state['current']!r} at {positions[index]}")
        if len(state["values"]) != len(expected) or any(
                len(a) != len(b) or any(abs(x - y) > 1e-12 * max(1.0, abs(y))
                                        for x, y in zip(a, b))
                for a, b in zip(state["values"], expected)):
            problems.append(f"{div_id} at position {index}: plotted {state['values']!r:.300}, "
                            f"the library gives {expected!r:.300}")
    box = page.locator(f"#{div_id}").bounding_box()
    column = page.evaluate("document.querySelector('article.md-content__inner').clientWidth")
    if box["width"] > column + 0.5:
        problems.append(f"{div_id}: {box['width']:.0f} px wide in a {column} px column")
    page.close()
    return problems + [f"{div_id}: console error {e}" for e in errors]


def _plotted_figure(html, div_id):
    """The traces and layout that ``html`` hands to ``Plotly.newPlot`` for ``div_id``."""
    import json

    call = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', html)
    assert call, f"no figure {div_id}"
    decoder = json.JSONDecoder()
    traces, end = decoder.raw_decode(html, call.end())
    layout, _ = decoder.raw_decode(html, re.compile(r",\s*").match(html, end).end())
    return traces, layout


def test_every_explorable_position_holds_the_librarys_numbers():
    """Without a browser: at every position of every explorable slider, the traces the step
    shows in the hook's HTML hold the numbers the library computes for it (recomputed here),
    to 1e-12. (The slow tier moves the sliders of the built pages in the browser.)"""
    fragments = explorables.fragments()
    for _page, div_id, positions_name, label_of, numbers in EXPLORABLES:
        traces, layout = _plotted_figure(fragments[div_id.replace("-", "_") + ".html"], div_id)
        steps = layout["sliders"][0]["steps"]
        positions = (getattr(explorables, positions_name) if positions_name
                     else list(range(len(steps))))
        assert len(steps) == len(positions) >= 3, div_id
        for position, step in zip(positions, steps):
            change = step["args"][0]
            if "visible" in change:  # the step shows its own traces
                shown = [t for t, v in zip(traces, change["visible"]) if v]
                values = [t["x"] if t.get("orientation") == "h" else t["y"] for t in shown]
            else:  # the step gives every trace its numbers
                values = change["y"]
            expected = numbers(position)
            assert len(values) == len(expected), (div_id, position)
            for got, want in zip(values, expected):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=0,
                                           err_msg=f"{div_id} at {position}")
            if label_of:
                assert step["label"] == label_of(position)


@pytest.mark.slow
@pytest.mark.parametrize("color_scheme", ["light", "dark"])
def test_every_explorable_shows_the_librarys_numbers(full_server, browser, color_scheme):
    problems = []
    for explorable in EXPLORABLES:
        problems += _check_explorable(browser, full_server, *explorable,
                                      color_scheme=color_scheme)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("viewport", [{"width": 1280, "height": 800},
                                      {"width": 390, "height": 844}])
def test_the_home_pages_chapter_list_is_on_its_first_screen(full_server, browser, viewport):
    """A laptop's and a phone's first screen hold what this is, the three paths and the whole
    chapter list; the student's path leads to the first chapter's lab by a link."""
    page = browser.new_page(viewport=viewport)
    page.goto(f"{full_server}/", wait_until="load")
    bottom = page.evaluate("""() => document.querySelector('#the-chapters')
        .nextElementSibling.getBoundingClientRect().bottom""")
    assert bottom <= viewport["height"], bottom
    page.click("text=its lab")
    page.wait_for_load_state("load")
    assert page.url.endswith("/opd/#exercises")
    assert page.evaluate("() => document.querySelector('#exercises').getBoundingClientRect()"
                         ".top") < viewport["height"]
    page.close()


@pytest.mark.slow
def test_no_navigation_or_contents_entry_shows_tex(full_site):
    """MathJax typesets a page's article, not its navigation or its table of contents."""
    found = []
    for path in sorted(full_site.rglob("index.html")):
        html = path.read_text(encoding="utf-8")
        for block in re.findall(r'<nav class="md-nav.*?</nav>', html, re.S):
            text = re.sub(r"<[^>]+>", "", block)
            if re.search(r"\$|\\\(|\\\[", text):
                found.append(str(path.relative_to(full_site)))
                break
    assert found == []


@pytest.mark.slow
def test_every_figure_of_a_chapter_is_numbered_and_captioned(full_site):
    """Each image and explorable of a chapter (and the home page) sits in a ``<figure>``
    whose ``<figcaption>`` starts "Figure N.", numbered 1, 2, ... in the page's order."""
    problems, seen = [], 0
    pages = ["index.html"] + [f"{name}/index.html" for name in
                              ("opd", "experiment", "mismatch", "mismatch_practice",
                               "large_vocab", "integration")]
    for name in pages:
        html = (full_site / name).read_text(encoding="utf-8")
        article = html.split("<article", 1)[1].split("</article>", 1)[0]
        images = len(re.findall(r"<img\b", article)) + article.count('class="explorable"')
        numbers = [int(n) for n in re.findall(r"<figcaption><strong>Figure (\d+)\.</strong>",
                                             article)]
        seen += images
        if numbers != list(range(1, images + 1)):
            problems.append(f"{name}: {images} figures, captions numbered {numbers}")
    assert seen >= 14 and not problems, problems


@pytest.mark.slow
def test_at_a_laptops_width_no_table_or_code_block_of_a_chapter_is_wider_than_its_column(
        full_server, browser):
    """1,280 px: every table and code block of the home page, the chapters and the instructors'
    page fits the text column (headings and identifiers wrap: extra.css, docs/hooks/tables.py);
    at a phone's width the wider ones scroll in their box with a cue (the test above)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = []
    for name in ("", "opd/", "experiment/", "mismatch/", "mismatch_practice/", "large_vocab/",
                 "integration/", "instructors/"):
        page.goto(f"{full_server}/{name}", wait_until="load")
        problems += [f"{name or 'home'}: {p}" for p in page.evaluate("""() => {
            const article = document.querySelector('article'), out = [];
            for (const box of article.querySelectorAll('table, pre')) {
              if (box.closest('details:not([open])') || box.closest('.annotated-row')) continue;
              const width = box.scrollWidth;
              if (width > article.clientWidth + 1 || width > box.clientWidth + 1)
                out.push(box.tagName + ' ' + width + ' px: '
                         + box.textContent.trim().slice(0, 40));
            }
            return out; }""")]
    page.close()
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_method_hidden_in_the_legend_stays_hidden_when_the_slider_moves(full_server, browser):
    """The experiment's explorable: a click on a method in the legend hides its line; moving
    the slider then changes the curves, keeps the legend (every method listed) and keeps that
    method hidden."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{full_server}/experiment/", wait_until="load")
    page.locator("#explore-experiment .slider-container").scroll_into_view_if_needed()
    entries = page.locator("#explore-experiment .legend .traces")
    methods = entries.count()
    assert methods >= 4
    entries.nth(0).locator(".legendtoggle").click()
    page.wait_for_function("() => document.getElementById('explore-experiment').data[0]"
                           ".visible === 'legendonly'")  # after plotly's double-click delay
    before = page.evaluate("() => document.getElementById('explore-experiment').data"
                           ".map(t => t.visible)")
    page.locator("#explore-experiment .slider-container").scroll_into_view_if_needed()
    state = _move_slider(page, "explore-experiment", 2)
    after = page.evaluate("() => document.getElementById('explore-experiment').data"
                          ".map(t => t.visible)")
    assert before[0] == after[0] == "legendonly", (before, after)
    assert entries.count() == methods and state["active"] == 2
    assert len(state["values"]) == methods - 1  # the hidden one is not plotted
    page.close()


def _best_estimators():
    """The least-error estimator of the catalogue at each (mismatch, batch size), recomputed
    from the exact moments of each estimator on each toy (not from the hook)."""
    from opd_literate.mismatch.estimators import REGISTRY
    from opd_literate.mismatch.toy import estimator_moments, make_toy

    table = {}
    for mismatch in explorables.MISMATCHES:
        toy = make_toy(mismatch=mismatch)
        moments = {name: estimator_moments(toy, REGISTRY[name].fn(toy, **REGISTRY[name].defaults))
                   for name in explorables.MISMATCH_NAMES}
        for batch in explorables.BEST_BATCHES:
            errors = [moments[name]["rel_rmse"](batch) for name in explorables.MISMATCH_NAMES]
            best = min(range(len(errors)), key=errors.__getitem__)  # ties: the first
            table[mismatch, batch] = (explorables.MISMATCH_NAMES[best], errors[best])
    return table


def test_the_explorables_offer_every_estimator_of_the_catalogue_and_the_home_page_counts_them():
    from opd_literate.mismatch.estimators import REGISTRY

    assert explorables.MISMATCH_NAMES == tuple(REGISTRY)
    home = (ROOT / "docs" / "index.md").read_text()
    assert f"{len(REGISTRY)} rollout corrections, exact bias and variance" in home


def test_the_best_estimator_map_is_the_librarys_and_the_chapter_reads_it():
    """The map's cells hold the estimator of least error and its error (1e-12), and the
    chapter's three sentences about it hold for every cell they speak of."""
    traces, _ = _plotted_figure(explorables.fragments()["explore_best.html"], "explore-best")
    expected = _best_estimators()
    cells = traces[0]["customdata"]
    for i, mismatch in enumerate(explorables.MISMATCHES):
        for j, batch in enumerate(explorables.BEST_BATCHES):
            name, error = expected[mismatch, batch]
            assert cells[i][j][0] == name, (mismatch, batch)
            np.testing.assert_allclose(cells[i][j][1], error, rtol=1e-12)
    page = " ".join((ROOT / "docs" / "mismatch.md").read_text().split())
    assert ("With a batch of 16 or fewer a sequence-rejection estimator (`geo_rs` or "
            "`k3_seq_rs`) has the least error at every mismatch above 0") in page
    assert all(expected[m, n][0] in ("geo_rs", "k3_seq_rs")
               for (m, n) in expected if m > 0 and n <= 16)
    assert ("from a batch of 512 up and at a mismatch of 1.1 or more, `trl_sequence_truncate` "
            "(the sequence ratio truncated at 3, TRL's `sequence_truncate`)") in page
    assert all(expected[m, n][0] == "trl_sequence_truncate" for (m, n) in expected
               if m >= 1.1 and n >= 512)
    assert ("the unbiased `seq_is` only with 4,096 answers or more, at a mismatch of 0.5 or "
            "less") in page
    wins = {(m, n) for (m, n), (name, _) in expected.items() if name == "seq_is"}
    assert wins and all(n >= 4096 and m <= 0.5 for m, n in wins)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_the_annotated_sources_code_wraps_to_its_column(full_site, full_server, browser, width):
    """No code block of an annotated source page scrolls sideways (extra.css wraps it)."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    problems, seen = [], 0
    for path in sorted(p.parent.name for p in (full_site / "source").glob("*/index.html")):
        page.goto(f"{full_server}/source/{path}/", wait_until="load")
        counts = page.evaluate("""() => { const c = Array.from(document.querySelectorAll(
            'article pre > code')); return [c.length,
            c.filter(b => b.scrollWidth > b.clientWidth + 1).length]; }""")
        seen += counts[0]
        if counts[1]:
            problems.append(f"source/{path}: {counts[1]} of {counts[0]} code blocks scroll")
    page.close()
    assert seen > 100 and not problems, "\n".join(problems)


@pytest.mark.slow
def test_no_navigation_entry_is_cut(full_server, browser):
    """At 1,280 px every entry of the navigation sidebar shows whole (no ellipsis)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{full_server}/opd/", wait_until="load")
    cut = page.evaluate("""() => Array.from(document.querySelectorAll(
        '.md-sidebar--primary .md-nav__link .md-ellipsis')).filter(
        e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.trim())""")
    page.close()
    assert cut == []
