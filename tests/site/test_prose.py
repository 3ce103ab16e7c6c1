"""The site speaks of its subject: no sentence about the circumstances of the work.

A reader of a chapter, an API page or the README should learn what was measured and on what
machine (one neutral line), never how busy that machine was, whose jobs shared it, how the
source of a peer was obtained, or in what order the work was done. The phrases below are those
a page must not hold; each pattern is checked against a sentence that holds it, so that a
pattern that matches nothing cannot pass unnoticed.
"""

import pathlib
import re

import pytest

import opd_literate

REPO = pathlib.Path(opd_literate.__file__).resolve().parents[1]

# (pattern, a sentence it must catch); case-insensitive, over text with line breaks as spaces.
CIRCUMSTANCES = [
    (r"\bload average\b", "measured with a load average of 8"),
    (r"\bunder load\b", "it took 950 s under load"),
    (r"\bother (people's |people’s )?jobs\b", "busy with other jobs"),
    (r"\b(kept|keeping) (it|one core|both cores|the machine|its cores) busy\b",
     "while a mutation run kept one core busy"),
    (r"\bshared (its|the|our) cores\b", "while other runs shared its cores"),
    (r"\bshared with (two |three |)(other )?(people|jobs|runs)", "shared with two other jobs"),
    (r"\bwhile a (test|mutation|benchmark) run\b", "while a test run went on"),
    (r"\bstored snapshot\b", "not in the stored snapshot of the repository"),
    (r"\bthis (\d+-core )?(machine|computer|box)\b", "it took 31 s on this 2-core machine"),
    (r"\bthis project's (\d+-core|machine)", "on this project's 2-core AMD EPYC"),
    (r"\bbefore the [^.]{0,80}\b(were|was) added\b", "measured before the DPPO cases were added"),
    (r"\b(this|the last|a previous|an earlier) session\b", "in an earlier session"),
    (r"\bthe lead (engineer|developer)\b", "the lead engineer ran it"),
]


def _pages() -> dict[str, str]:
    """What a reader sees: the chapters and pages, the README, and the package's docstrings
    (rendered on the API pages), each as one string."""
    pages = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
    pages["README.md"] = (REPO / "README.md").read_text()
    for path in sorted((REPO / "opd_literate").rglob("*.py")):
        pages[str(path.relative_to(REPO))] = path.read_text()
    for path in sorted((REPO / "benchmarks" / "results").glob("*")):
        if path.is_file():  # included in the chapters as measured
            pages[str(path.relative_to(REPO))] = path.read_text()
    return pages


@pytest.mark.parametrize(("pattern", "example"), CIRCUMSTANCES)
def test_each_pattern_catches_its_example(pattern, example):
    assert re.search(pattern, example, re.I)


def test_no_page_speaks_of_the_circumstances_of_the_work():
    found = []
    for name, text in _pages().items():
        flat = " ".join(text.split())
        for pattern, _ in CIRCUMSTANCES:
            found += [f"{name}: ...{flat[max(m.start() - 60, 0):m.end() + 30]}..."
                      for m in re.finditer(pattern, flat, re.I)]
    assert found == [], "\n".join(found)
