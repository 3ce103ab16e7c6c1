"""The annotated-source pages (``docs/hooks/annotated.py``): every line of code is on the page,
each beside its prose, and each public definition has its anchor."""

import ast
import pathlib
import re

import annotated  # a docs hook (tests/site/conftest.py)
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _code_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", page, re.S)


def _docstring_lines(tree) -> set[int]:
    """Line numbers of the docstrings that become prose: the module's, each top-level
    definition's and each module attribute's (a method's stays in the code)."""
    lines = set()
    holders = [tree] + [n for n in tree.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for holder in holders:
        for index, statement in enumerate(holder.body):
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)):
                continue
            if holder is tree or index == 0:
                lines.update(range(statement.lineno, statement.end_lineno + 1))
    return lines


@pytest.mark.parametrize("module", annotated.MODULES)
def test_every_line_of_code_is_on_the_page_in_order(module):
    path = ROOT / "opd_literate" / pathlib.Path(*module.split(".")).with_suffix(".py")
    source = path.read_text()
    tree = ast.parse(source)
    skipped = _docstring_lines(tree)
    exported = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    skipped.update(range(exported.lineno, exported.end_lineno + 1))
    expected = [line for number, line in enumerate(source.splitlines(), start=1)
                if number not in skipped and line.strip()
                and not (line.strip().startswith("#") and not line.strip().startswith("###"))]
    page = annotated.annotated_markdown(module)
    shown = [line for block in _code_blocks(page) for line in block.splitlines()
             if line.strip() and not (line.strip().startswith("#")
                                      and not line.strip().startswith("###"))]
    assert shown == expected  # committed-exact: lines of source text, strings


@pytest.mark.parametrize("module", annotated.MODULES)
def test_each_public_definition_has_its_anchor_and_prose(module):
    path = ROOT / "opd_literate" / pathlib.Path(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    page = annotated.annotated_markdown(module)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            row = re.search(rf'<div class="annotated-row" id="{node.name}" markdown>\n'
                            r'<div class="annotated-prose" markdown>\n\n(.*?)\n\n</div>',
                            page, re.S)
            assert row, node.name
            summary = ast.get_docstring(node).split("\n")[0].strip()
            assert row.group(1).startswith(summary[:40]), node.name


def test_comments_inside_a_body_become_the_prose_of_the_lines_after_them():
    rows = annotated._body_rows(["    x = 1", "    # why y", "    # is two", "    y = 2",
                                 "    ### BEGIN SOLUTION", "    z = 3"])
    assert rows == [("", ["    x = 1"]),
                    ("why y\nis two", ["    y = 2", "    ### BEGIN SOLUTION", "    z = 3"])]


def test_numpy_sections_and_examples_become_markdown():
    text = annotated._docstring_markdown('''Sum.

    Parameters
    ----------
    x : int
        The first.
    y : int
        The second.

    Examples
    --------
    >>> 1 + 1
    2
    ''')
    assert "**Parameters**" in text and "----" not in text
    assert "- `x` (int): The first." in text and "- `y` (int): The second." in text
    assert "```pycon\n>>> 1 + 1\n2\n```" in text

