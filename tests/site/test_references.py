"""Every commit a docstring or a chapter cites is listed, in full, on the frameworks' sources
page, and the bibliography of the references page is cited and linked.

The frameworks' sources page (``provenance.md``) is where a reader checks a claim about another
framework; a commit named next to the code but missing there (or abbreviated to a prefix of no
listed commit) is a citation the reader cannot follow up.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "references.md").read_text()
SOURCES_PAGE = (ROOT / "docs" / "provenance.md").read_text()
FULL = set(re.findall(r"`([0-9a-f]{40})`", SOURCES_PAGE))
# A commit, full or abbreviated: a word of 7 to 40 hex digits with a letter and a digit in it.
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commits(text):
    text = re.sub(r"https?://[^\s)>]+", "", text)  # an address's hex (a Notion page id) is no commit
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


def test_every_cited_commit_is_on_the_frameworks_sources_page():
    missing = []
    for path in _sources():
        for sha in _commits(path.read_text()):
            if not any(full.startswith(sha) for full in FULL) and not _is_this_projects_commit(sha):
                missing.append(f"{path.relative_to(ROOT)}: {sha}")
    assert missing == []


# The bibliography: "Papers and posts", one list item an entry, each with its anchor.
BIBLIOGRAPHY = PAGE[PAGE.index("## Papers and posts"):]
ENTRIES = re.findall(r'^- <span id="([a-z0-9]+)"></span>(.*?)(?=^- |\Z)', BIBLIOGRAPHY, re.M | re.S)
CHAPTERS = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "references.md"]


def test_every_entry_has_an_anchor_and_an_arxiv_identifier_or_an_address():
    assert len(ENTRIES) >= 12
    for anchor, text in ENTRIES:
        arxiv = re.findall(r"\[arXiv:(\d{4}\.\d{4,5})\]\(https://arxiv\.org/abs/(\d{4}\.\d{4,5})\)",
                           text)
        address = re.findall(r"<(https?://[^>\s]+)>", text)
        assert len(arxiv) + len(address) == 1, (anchor, text)
        # the identifier shown is the one linked
        assert all(shown == linked for shown, linked in arxiv), (anchor, arxiv)


def test_citations_link_to_an_entry_and_every_entry_is_cited():
    anchors = {anchor for anchor, _ in ENTRIES}
    cited = set()
    for chapter in CHAPTERS:
        text = chapter.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(references\.md#([\w-]+)\)", text):
            assert target in anchors or target in _headings(), (chapter.name, target)
            cited.add(target)
        # an author-year citation in the prose is the text of a link: "[Yao et al. 2025](...)"
        for match in re.finditer(r"[A-Z][a-z]+(?:, [A-Z][a-z]+)* (?:et al\.|and [A-Z][a-z]+),? "
                                 r"(?:19|20)\d\d[ab]?", text):
            linked = text[:match.start()].endswith("[") and text[match.end():].startswith("](")
            assert linked, (chapter.name, match.group(0))
    assert anchors <= cited, sorted(anchors - cited)


def _headings():
    """The anchors MkDocs gives the page's headings (lower case, spaces to hyphens)."""
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", PAGE, re.M)}
