"""What one build holds: the pages of its navigation and the generated files those pages use.

``mkdocs.yml`` lists every page, so its build computes everything. The fast tier's one-chapter
build (``tests/site/test_site.py``) lists a few pages, and the hooks then compute only the
files under ``docs/generated/`` that those pages include (``--8<-- "generated/NAME"``) or show
(``![...](generated/NAME)``): the same code, on less of the site.
"""

from __future__ import annotations

import fnmatch
import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[1]
_GENERATED = re.compile(r"generated/([\w.-]+)")


def nav_pages(config) -> list[str] | None:
    """The Markdown sources the navigation lists, in order; None without a navigation (MkDocs
    then builds every page of ``docs_dir``)."""
    nav = config["nav"]
    if nav is None:
        return None
    pages = []

    def walk(item):
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(nav)
    return [page for page in pages if page.endswith(".md")]


def used_generated_files(config) -> set[str] | None:
    """The names under ``docs/generated/`` that the listed pages use; None: every name."""
    pages = nav_pages(config)
    if pages is None:
        return None
    used = set()
    for page in pages:
        path = DOCS / page
        if path.exists():  # a generated page (an annotated source) is not read
            used.update(_GENERATED.findall(path.read_text(encoding="utf-8")))
    return used


def wanted(used: set[str] | None, patterns) -> bool:
    """Whether a generator whose outputs match ``patterns`` (``fnmatch``) has to run."""
    return used is None or any(fnmatch.fnmatch(name, pattern)
                               for name in used for pattern in patterns)
