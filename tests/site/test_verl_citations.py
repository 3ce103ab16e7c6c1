"""Every verl statement is about the pinned release, or says that it is history.

The package's verl statements are checked against verl ``VERL_VERSION`` (0.9.1); the repository
was read up to ``VERL_COMMIT``. A docstring or a page that cites another verl commit is stating
what verl did at some other time, and must say so next to the citation ("since", "before",
"until", ...): a bare "verl at b178a3c does X" is a stale claim once verl has moved.
"""

import json
import pathlib
import re

from opd_literate import _numerics

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCES = (ROOT / "docs" / "provenance.md").read_text()
# the verl section, up to its paragraph on verl-project/verl-recipe (another repository)
VERL_SECTION = REFERENCES[REFERENCES.index("## verl"):
                          REFERENCES.index("verl-project/verl-recipe at")]
VERL_COMMITS = set(re.findall(r"`([0-9a-f]{40})`", VERL_SECTION))
# words that make a citation a statement about verl's history, not about the pinned release
HISTORY = re.compile(r"\b(since|before|until|entered|earlier|former|formerly|old|changed|"
                     r"replacement|removed|was|used to|had)\b", re.IGNORECASE)
CONTEXT = 240  # characters either side of a citation: the sentence or table row it sits in


def _sources():
    yield from sorted((ROOT / "opd_literate").rglob("*.py"))
    yield from sorted((ROOT / "docs").glob("*.md"))


def _verl_citations(text):
    """(position, commit) of every word that abbreviates a verl commit of the references page."""
    for match in re.finditer(r"\b[0-9a-f]{7,40}\b", text):
        word = match.group()
        if any(full.startswith(word) for full in VERL_COMMITS):
            yield match.start(), word


def test_the_pin_is_one_version_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"verl=={_numerics.VERL_VERSION}"' in pyproject
    fixture = json.loads((ROOT / "tests" / "fixtures" / "verl_rollout_correction.json")
                         .read_text())
    assert fixture["version"] == _numerics.VERL_VERSION
    assert f"verl {_numerics.VERL_VERSION}" in VERL_SECTION
    assert f"`{_numerics.VERL_COMMIT}`" in VERL_SECTION


def test_the_references_page_lists_the_verl_history():
    assert len(VERL_COMMITS) >= 8
    assert _numerics.VERL_COMMIT in VERL_COMMITS


def test_a_verl_commit_other_than_the_pinned_one_is_cited_as_history():
    pinned = _numerics.VERL_COMMIT
    bare = []
    for path in _sources():
        text = path.read_text()
        for position, commit in _verl_citations(text):
            if pinned.startswith(commit):
                continue
            around = text[max(0, position - CONTEXT):position + CONTEXT]
            if not HISTORY.search(around):
                line = text.count("\n", 0, position) + 1
                bare.append(f"{path.relative_to(ROOT)}:{line}: {commit}")
    assert bare == []


def test_the_check_finds_a_bare_citation():
    """The rule bites: a present-tense claim at an old commit is found, a dated one is not."""
    old = next(c for c in VERL_COMMITS if c != _numerics.VERL_COMMIT)
    bare = f"verl's agg_loss divides by T (volcengine/verl at {old[:7]})."
    dated = f"verl's agg_loss divided by T before commit {old[:7]}."
    assert [c for _, c in _verl_citations(bare)] == [old[:7]]
    assert not HISTORY.search(bare) and HISTORY.search(dated)
