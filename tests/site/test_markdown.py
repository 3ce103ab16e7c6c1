"""The chapters' Markdown renders as written: lists are lists, headings carry no TeX.

Each page of ``docs/`` is converted with the Markdown extensions of ``mkdocs.yml`` (its
includes, ``--8<--``, left as they are: they are generated tables). Python-Markdown continues a
list item only at four spaces, so a bullet that follows an indented paragraph without a blank
line is swallowed into it and shows as a literal ``*``; and a heading's TeX reaches the contents
sidebar and the navigation raw, since MathJax typesets the page, not the table of contents.
"""

import pathlib
import re

import markdown
import pytest
import yaml

import opd_literate

DOCS = pathlib.Path(opd_literate.__file__).resolve().parents[1] / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def _extensions():
    """mkdocs.yml's markdown_extensions, without the includes (snippets)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # !ENV and the like
    config = yaml.load((DOCS.parent / "mkdocs.yml").read_text(), Loader=Loader)
    names, settings = [], {}
    for entry in config["markdown_extensions"]:
        name, options = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
        if name != "pymdownx.snippets":
            names.append(name)
            settings[name] = options or {}
    return names, settings


def _render(text: str) -> str:
    names, settings = _extensions()
    return markdown.Markdown(extensions=names, extension_configs=settings).convert(text)


def _swallowed_items(html: str) -> list[str]:
    """Lines of a paragraph that begin as a list item would: the item became text."""
    found = []
    for paragraph in re.findall(r"<p>(.*?)</p>", html, re.S):
        found += [line.strip()[:80] for line in paragraph.split("\n")[1:]
                  if re.match(r"\s*([*+-]|\d+\.) \S", line)]
    return found


def test_a_bullet_after_an_indented_paragraph_is_caught():
    broken = "* one\n\n    more of one\n* two\n"
    assert _swallowed_items(_render(broken)) == ["* two"]
    assert _swallowed_items(_render(broken.replace("\n* two", "\n\n* two"))) == []


@pytest.mark.parametrize("page", PAGES)
def test_no_list_item_renders_as_text(page):
    assert _swallowed_items(_render((DOCS / page).read_text())) == []


@pytest.mark.parametrize("page", PAGES)
def test_no_heading_holds_tex(page):
    text = re.sub(r"```.*?```", "", (DOCS / page).read_text(), flags=re.S)  # not code blocks
    headings = [line for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    assert [h for h in headings if re.search(r"\$|\\\(|\\\[", h)] == []


def test_every_annotated_source_page_is_linked_from_a_chapter():
    """Each module of the navigation's "Annotated source" is linked from the chapter section
    that explains its code ("The code of this section, annotated: ...")."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config = yaml.load((DOCS.parent / "mkdocs.yml").read_text(), Loader=Loader)
    annotated = next(item["Annotated source"] for item in config["nav"]
                     if isinstance(item, dict) and "Annotated source" in item)
    pages = {page for entry in annotated for page in entry.values()}
    linked = set()
    for page in ("opd.md", "experiment.md", "mismatch.md", "mismatch_practice.md",
                 "large_vocab.md", "teachers.md"):
        text = (DOCS / page).read_text()
        for line in re.findall(r"^The code of this section, annotated.*$", text, re.M):
            linked |= set(re.findall(r"\]\((source/[\w.]+\.md)\)", line))
    assert linked == pages
