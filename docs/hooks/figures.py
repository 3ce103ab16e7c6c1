"""Every figure of a page numbered and captioned: ``<figure id="figure-N">`` with a
``<figcaption>`` that reads "Figure N. ...".

A static figure is a Markdown image alone in its paragraph, ``![caption](generated/x.svg)``
(as glightbox leaves it: the image inside its zoom link); its caption is the image's text. An
explorable figure is the ``<div class="explorable" data-caption="...">`` that
``explorables.py`` writes; its caption is its title, with a note on how to use it.
Both are numbered in the order they appear, so "Figure 3" in a chapter's text names the third
figure a reader sees; ``#figure-3`` links to it.

The text refers to a figure by its name, never by a number that an inserted figure would
shift: ``[Figure](#fig-NAME)``, with NAME the image's file name without ``.svg``
(``mismatch_sweep``) or the explorable's id (``explore-best``), becomes a link "Figure 3" to
``#figure-3``. A reference to a name that no figure of the page has is an error, which fails the
build.
"""

from __future__ import annotations

import html as _html
import re

# A paragraph holding one image and nothing else, with or without glightbox's link around it.
STATIC = re.compile(r'<p>((?:<a class="glightbox"[^>]*>)?<img alt="([^"]*)"[^>]*>(?:</a>)?)</p>')
_SOURCE = re.compile(r'<img [^>]*src="(?:[^"]*/)?([^"/]+)\.svg"')
_EXPLORABLE_ID = re.compile(r'<div id="([\w-]+)"')
REFERENCE = re.compile(r'<a href="#fig-([\w-]+)">Figure</a>')
EXPLORABLE = re.compile(r'<div class="explorable" markdown="0" data-caption="([^"]*)">')


def _explorable_end(text: str, start: int) -> int:
    """The index just past the ``</div>`` that closes the ``<div>`` opened at ``start``."""
    depth = 0
    for tag in re.finditer(r"<(/?)div\b[^>]*>", text[start:]):
        depth += -1 if tag.group(1) else 1
        if depth == 0:
            return start + tag.end()
    raise ValueError(f"an explorable figure at character {start} is never closed")


def number_figures(text: str) -> str:
    """``text`` (a page's HTML) with each figure in a numbered ``<figure>``."""
    found = [(m.start(), m.end(), "static", m) for m in STATIC.finditer(text)]
    found += [(m.start(), _explorable_end(text, m.start()), "explorable", m)
              for m in EXPLORABLE.finditer(text)]
    out, last, numbers = [], 0, {}
    for number, (start, end, kind, match) in enumerate(sorted(found, key=lambda f: f[0]), 1):
        name = (_SOURCE if kind == "static" else _EXPLORABLE_ID).search(text, start, end)
        if name is not None:
            numbers[name.group(1)] = number
        if kind == "static":
            body, caption = match.group(1), match.group(2)
            note = ""
        else:
            body, caption = text[start:end], match.group(1)
            note = (" <em>(move its slider)</em>" if '"sliders"' in body
                    else " <em>(hover for the values)</em>")
        label = _html.unescape(caption).strip().rstrip(".")
        out += [text[last:start],
                f'<figure id="figure-{number}" class="numbered">{body}'
                f"<figcaption><strong>Figure {number}.</strong> {_html.escape(label)}.{note}"
                "</figcaption></figure>"]
        last = end
    return _resolve("".join(out) + text[last:], numbers)


def _resolve(text: str, numbers: dict) -> str:
    """Each ``[Figure](#fig-NAME)`` of ``text`` as a link to its figure, with its number."""
    def link(match: re.Match) -> str:
        name = match.group(1)
        if name not in numbers:
            raise ValueError(f"a reference to figure {name!r}, which is not on this page (its "
                             f"figures: {sorted(numbers)})")
        return f'<a href="#figure-{numbers[name]}">Figure {numbers[name]}</a>'
    return REFERENCE.sub(link, text)


def on_page_content(html, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    if page.file.src_uri.startswith(("api/", "source/")):
        return html  # the API and source pages show code, not figures
    return number_figures(html)
