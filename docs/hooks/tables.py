"""A table fits its column: the identifiers in its cells may break between their parts.

``ppo_clip_bypass``, ``verl/trainer/ppo/core_algos.py`` or ``token-mean`` in a narrow column
would widen the table past the page; a ``<wbr>`` after each ``_``, ``/``, ``.``, ``=``, ``,``
and ``-`` that precedes a letter or digit lets the browser break it there, and nowhere inside
a word (``extra.css`` keeps ``word-break: keep-all``). Only the text of ``<code>`` inside a
table changes; copying it copies the same characters.
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


def on_page_content(html, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    return break_identifiers(html)
