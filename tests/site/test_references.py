"""Every commit a docstring or a chapter cites is listed, in full, on the references page.

The references page is where a reader checks a claim about another framework; a commit named
next to the code but missing there (or abbreviated to a prefix of no listed commit) is a citation
the reader cannot follow up.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "references.md").read_text()
FULL = set(re.findall(r"`([0-9a-f]{40})`", PAGE))
# A commit, full or abbreviated: a word of 7 to 40 hex digits with a letter and a digit in it.
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commits(text):
    return [w for w in HEX_WORD.findall(text) if re.search("[a-f]", w) and re.search("[0-9]", w)]


def _is_this_projects_commit(sha):
    """A commit of this repository (docs/mutation.md names the commit it measured)."""
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}^{{commit}}"],
                           capture_output=True)
    return found.returncode == 0


def _sources():
    yield from sorted((ROOT / "opd_literate").glob("*.py"))
    yield from sorted((ROOT / "docs").glob("*.md"))


def test_the_page_lists_full_commits():
    assert len(FULL) >= 8


def test_every_cited_commit_is_on_the_references_page():
    missing = []
    for path in _sources():
        for sha in _commits(path.read_text()):
            if not any(full.startswith(sha) for full in FULL) and not _is_this_projects_commit(sha):
                missing.append(f"{path.relative_to(ROOT)}: {sha}")
    assert missing == []
