"""A table fits its column, at a laptop's width and on a phone.

Two changes to a chapter's tables, neither of which alters what a reader copies:

* **Identifiers break between their parts.** ``ppo_clip_bypass``,
  ``verl/trainer/ppo/core_algos.py`` or ``token-mean`` in a narrow column would widen the table
  past the page; a ``<wbr>`` after each ``_``, ``/``, ``.``, ``=``, ``,`` and ``-`` that
  precedes a letter or digit lets the browser break it there, and nowhere inside a word
  (``extra.css`` keeps ``word-break: keep-all``).
* **Each cell carries its column's heading**, hidden until the table is shown row by row: a
  table still wider than its column (on a phone, one of five or more columns of numbers) is
  marked ``data-opd-stacked`` by ``javascripts/tables.js`` and laid out by ``extra.css`` as one
  block per row, each cell a line "heading: value". The heading is a copy of the ``<th>``'s
  HTML (its math is typeset with the rest of the page) inside ``<span class="opd-cell-label"
  aria-hidden="true">``, so that a screen reader, which reads the table as a table, does not
  hear it twice; the cell's own content goes into ``<span class="opd-cell-value">``, one grid
  item whatever inline elements it holds.
"""

from __future__ import annotations

import re

_TABLE = re.compile(r"<table>.*?</table>", re.S)
_CODE = re.compile(r"(<code>)(.*?)(</code>)", re.S)
_BREAK = re.compile(r"([_/.=,-])(?=[A-Za-z0-9])")


def _breakable(code: str) -> str:
    """``<wbr>`` after each separator of the text between tags (entities untouched)."""
    parts = re.split(r"(<[^>]+>|&[#\w]+;)", code)
    return "".join(part if part.startswith(("<", "&")) else _BREAK.sub(r"\1<wbr>", part)
                   for part in parts)


def break_identifiers(html: str) -> str:
    return _TABLE.sub(lambda table: _CODE.sub(
        lambda m: m.group(1) + _breakable(m.group(2)) + m.group(3), table.group(0)), html)


_HEAD = re.compile(r"<thead>(.*?)</thead>", re.S)
_HEADING = re.compile(r"<th\b[^>]*>(.*?)</th>", re.S)
_BODY = re.compile(r"<tbody>(.*?)</tbody>", re.S)
_ROW = re.compile(r"<tr\b[^>]*>(.*?)</tr>", re.S)
_CELL = re.compile(r"(<td\b[^>]*>)(.*?)(</td>)", re.S)
_ID = re.compile(r'\s(?:id|name)="[^"]*"')


def _label_table(table: str) -> str:
    head = _HEAD.search(table)
    if head is None:
        return table
    # A copied heading must not repeat an anchor of the page.
    headings = [_ID.sub("", h) for h in _HEADING.findall(head.group(1))]

    def label_row(row: re.Match) -> str:
        cells = list(_CELL.finditer(row.group(0)))
        if len(cells) != len(headings):
            raise ValueError(f"a table row has {len(cells)} cells under {len(headings)} "
                             f"headings: {row.group(0)[:120]!r}")
        labels = iter(headings)
        return _CELL.sub(lambda c: (
            f'{c.group(1)}<span class="opd-cell-label" aria-hidden="true">{next(labels)}'
            f'</span><span class="opd-cell-value">{c.group(2)}</span>{c.group(3)}'),
            row.group(0))

    return _BODY.sub(lambda body: _ROW.sub(label_row, body.group(0)), table)


def label_cells(html: str) -> str:
    """``html`` with every body cell of every table preceded by its column's heading."""
    return _TABLE.sub(lambda table: _label_table(table.group(0)), html)


def on_page_content(html, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    html = break_identifiers(html)
    if page.file.src_uri.startswith(("api/", "source/")):
        return html  # mkdocstrings' parameter tables and the annotated source scroll instead
    return label_cells(html)
