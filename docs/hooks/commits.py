"""MkDocs hook: a full commit hash in a page reads as its short form, linked to the commit.

The pages cite other projects' source at a commit, by its full 40-digit hash in backticks (exact,
and what ``tests/site/test_references.py`` compares). In a table column such a hash wraps onto
three lines; this hook shows it as ``b178a3c``, the first 7 digits, linked to the commit's page in
its repository (the full hash stays in the link and its title). The repository is the one the
same line names as ``owner/name``, else the last one named above it on the page; a hash with no
repository named before it is left as it is.
"""

from __future__ import annotations

import re

REPOSITORIES = ("volcengine/verl", "verl-project/verl", "verl-project/verl-recipe",
                "huggingface/trl", "thinking-machines-lab/tinker-cookbook")
"""The repositories the pages cite at a commit."""

_HASH = re.compile(r"`([0-9a-f]{40})`")
_REPOSITORY = re.compile(r"(?<![\w/.-])(" + "|".join(re.escape(r) for r in sorted(
    REPOSITORIES, key=len, reverse=True)) + r")(?![\w/-])")


def link_commits(markdown: str) -> str:
    """Each backticked full hash as ``[`short`](https://github.com/<repo>/commit/<hash>)``."""
    out, repository, fenced = [], None, False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue
        named = _REPOSITORY.findall(line)
        here = named[-1] if named else repository
        if here:
            line = _HASH.sub(lambda m, r=here: (
                f'[`{m.group(1)[:7]}`](https://github.com/{r}/commit/{m.group(1)} '
                f'"{r}@{m.group(1)}")'), line)
        repository = here
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    return link_commits(markdown)
