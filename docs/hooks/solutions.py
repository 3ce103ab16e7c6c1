"""The solution markers stay in the source and the handouts, and off the site.

The lab modules mark each solution with ``### BEGIN SOLUTION Task N: hint`` and
``### END SOLUTION`` comment lines (``opd_literate/course/markers.py``): the handout writer
needs them, a reader of the annotated source or of an API page's source does not. This hook
drops those comment lines from the code of the annotated source pages and from the API pages'
"Source code" listings; there the numbers of the dropped lines go too, so that each line shown
keeps its own number in the file. The API pages' "Copy this function" blocks keep them: that
code is for course material, and is what ``opd-copy`` prints.
"""

from __future__ import annotations

import re

# One highlighted line that holds a marker comment and nothing else (Pygments' HTML: the
# comment's span, after an optional whitespace span or plain indentation).
MARKER_LINE = re.compile(
    r'^[ \t]*(?:<span class="w">[ \t]*</span>)?<span class="c1">### (?:BEGIN|END) SOLUTION'
    r'[^<]*</span>[ \t]*$')
_TABLE = re.compile(r'<table class="highlighttable">.*?</table>', re.S)
_PRE = re.compile(r"(<pre[^>]*>)(.*?)(</pre>)", re.S)


def _drop_lines(code: str) -> tuple[str, list[int]]:
    """``code`` without its marker lines, and the indices of the lines dropped."""
    lines = code.split("\n")
    dropped = [i for i, line in enumerate(lines) if MARKER_LINE.match(line)]
    return "\n".join(line for i, line in enumerate(lines) if i not in set(dropped)), dropped


def _numbered(table: str) -> str:
    """A table of line numbers and code: the marker lines dropped from both columns."""
    pres = list(_PRE.finditer(table))
    if len(pres) != 2:
        return table
    numbers, code = pres
    kept, dropped = _drop_lines(code.group(2))
    if not dropped:
        return table
    number_lines = numbers.group(2).split("\n")
    number_lines = [line for i, line in enumerate(number_lines) if i not in set(dropped)]
    return (table[:numbers.start(2)] + "\n".join(number_lines) + table[numbers.end(2):code.start(2)]
            + kept + table[code.end(2):])


def hide_solution_markers(html: str, every_block: bool = False) -> str:
    """``html`` with every marker comment line dropped from its numbered code listings, and
    with ``every_block`` from all of its code blocks."""
    html = _TABLE.sub(lambda m: _numbered(m.group(0)), html)
    if every_block:
        html = _PRE.sub(lambda m: m.group(1) + _drop_lines(m.group(2))[0] + m.group(3), html)
    return html


def on_page_content(html, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    return hide_solution_markers(html, every_block=page.file.src_uri.startswith("source/"))
