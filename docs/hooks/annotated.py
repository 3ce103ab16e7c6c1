"""MkDocs hook: each chapter module as annotated source, prose beside the code it explains.

For every module of ``MODULES`` this writes ``docs/source/<module>.md`` (not committed) before the
build: the module read top to bottom, cut into rows. A row's left side is prose, its right side
the code that the prose explains:

* a top-level function or class: its docstring (derivation, formulas, examples) beside its
  signature and body; the comment lines just above it join the prose;
* inside a body, a block of comment lines starts a new row: the comment beside the lines that
  follow it, down to the next such block (as in the annotated implementations of labml.ai);
* the module docstring opens the page across both columns.

The pages are left out of the search index: their text is the API pages' (indexed there), and a
search would otherwise find every docstring twice. The prose is Markdown, so its math is typeset
like the chapters' and its cross-references resolve. numpy-style section headings become bold
lines, parameter lists become lists, and doctest examples become code blocks. Each definition's
row has the anchor ``#<name>`` for the chapters to link to.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import _built  # docs/hooks/_built.py (MkDocs puts a hook's folder on sys.path)

DOCS = pathlib.Path(__file__).resolve().parents[1]
OUT = DOCS / "source"
PACKAGE = DOCS.parent / "opd_literate"

MODULES = ("opd", "mismatch.toy", "mismatch.estimators", "mismatch.opd_mismatch",
           "mismatch.correction", "mismatch.engine", "mismatch.task_rewards", "mismatch.groups",
           "large_vocab.chunked", "large_vocab.topk", "large_vocab.clamps", "large_vocab.supports",
           "teachers.cross_tokenizer", "teachers.many_teachers", "teachers.teacher_targets",
           "experiment.tinylm", "experiment.train", "experiment.quantized",
           "experiment.mismatch_training")
"""The chapter modules, in the order of the chapters."""

_SECTION = re.compile(r"^(?P<title>[A-Z][A-Za-z ]+)\n-{3,}$", re.M)
_PARAMETER = re.compile(r"^(?P<names>[\w*][\w, *]*) : (?P<type>.+)$")


def _docstring_markdown(doc: str) -> str:
    """A numpy-style docstring as Markdown for the prose column."""
    lines = inspect.cleandoc(doc).splitlines()
    out, i, in_parameters = [], 0, False
    while i < len(lines):
        line = lines[i]
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and re.fullmatch(r"-{3,}", following.strip()) and not line[0].isspace():
            in_parameters = line.strip() in {"Parameters", "Returns", "Raises", "Yields",
                                              "Attributes", "Other Parameters"}
            out += ["", f"**{line.strip()}**", ""]
            i += 2
            continue
        if line.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["", "```pycon", *block, "```", ""]
            continue
        match = _PARAMETER.match(line) if in_parameters else None
        if match or (in_parameters and line and not line[0].isspace()):
            names = match.group("names") if match else line.strip()
            kind = f" ({match.group('type').strip()})" if match else ""
            description = []
            i += 1
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                if not lines[i].strip() and (i + 1 >= len(lines)
                                             or not lines[i + 1].startswith(" ")):
                    break
                description.append(lines[i].strip())
                i += 1
            out.append(f"- `{names}`{kind}: " + " ".join(description))
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def _comment_prose(comment_lines: list[str]) -> str:
    return "\n".join(re.sub(r"^\s*# ?", "", line) for line in comment_lines).strip()


def _body_rows(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Code lines cut at each block of comment-only lines: ``[(prose, code lines)]``."""
    rows, prose, code, comments = [], "", [], []
    for line in lines:
        if line.strip().startswith("#") and not line.strip().startswith("###"):
            comments.append(line)
            continue
        if comments:
            if code:
                rows.append((prose, code))
                prose, code = "", []
            prose = (prose + "\n\n" + _comment_prose(comments)).strip()
            comments = []
        code.append(line)
    if comments:  # comments at the very end belong to the code above
        code += comments
    if code or prose:
        rows.append((prose, code))
    return rows


def _definition_rows(node, lines: list[str], start: int, attribute_doc: str | None = None):
    """Rows of one top-level definition (lines are the module's, ``start`` its first line;
    ``attribute_doc``: the docstring under an assignment)."""
    body = getattr(node, "body", None)
    docstring = ast.get_docstring(node, clean=False) if isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
    above, first = [], start
    while first > 1 and lines[first - 2].lstrip().startswith("#") and not lines[
            first - 2].startswith("# " + "-" * 10):
        first -= 1
        above.insert(0, lines[first - 1])
    prose = _comment_prose(above)
    end = node.end_lineno
    # The END SOLUTION marker after the last statement is a comment the syntax tree leaves out.
    while end < len(lines) and lines[end].strip().startswith("### END SOLUTION"):
        end += 1
    if docstring is not None:
        doc_node = body[0]
        header = lines[start - 1:doc_node.lineno - 1]
        rest = lines[doc_node.end_lineno:end]
        prose = (prose + "\n\n" + _docstring_markdown(docstring)).strip()
        rows = _body_rows(rest)
        if rows and not rows[0][0]:
            rows[0] = (prose, header + rows[0][1])
        else:
            rows.insert(0, (prose, header))
        return rows
    code = lines[start - 1:end]
    if attribute_doc:
        prose = (prose + "\n\n" + inspect.cleandoc(attribute_doc)).strip()
    return [(prose, code)]


def _row(prose: str, code: list[str], anchor: str | None) -> str:
    code_text = "\n".join(code).strip("\n")
    ident = f' id="{anchor}"' if anchor else ""
    left = prose if prose else "&nbsp;"
    right = f"```python\n{code_text}\n```" if code_text.strip() else ""
    return (f'<div class="annotated-row"{ident} markdown>\n<div class="annotated-prose" markdown>'
            f"\n\n{left}\n\n</div>\n<div class=\"annotated-code\" markdown>\n\n{right}\n\n"
            "</div>\n</div>\n")


def annotated_markdown(module: str) -> str:
    """The page of ``opd_literate.<module>``: its docstring, then one row per piece of code."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    parts = [f"# `opd_literate.{module}`, annotated\n",
             f"The source of [`opd_literate.{module}`](../api/"
             f"{module.split('.')[-1]}.md), read top to bottom: each piece of code beside "
             "the text that explains it.\n"]
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        parts.append('<div class="annotated-intro" markdown>\n\n'
                     + _docstring_markdown(body[0].value.value) + "\n\n</div>\n")
        body = body[1:]
    pending = []  # consecutive imports and other small statements, shown together
    for index, node in enumerate(body):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # an attribute docstring, shown with its assignment
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Assign, ast.AnnAssign)):
            if named_of(node) == "__all__":
                continue  # the public names: the API page lists them
            if pending:
                parts.append(_row("", pending, None))
                pending = []
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            named = getattr(node, "name", None) or next(
                (t.id for t in targets if isinstance(t, ast.Name)), None)
            following = body[index + 1] if index + 1 < len(body) else None
            attribute_doc = (following.value.value if isinstance(node, (ast.Assign, ast.AnnAssign))
                             and isinstance(following, ast.Expr)
                             and isinstance(following.value, ast.Constant)
                             and isinstance(following.value.value, str) else None)
            for k, (prose, code) in enumerate(_definition_rows(node, lines, start,
                                                                attribute_doc)):
                parts.append(_row(prose, code, named if k == 0 else None))
            continue
        pending += lines[node.lineno - 1:node.end_lineno]
    if pending:
        parts.append(_row("", pending, None))
    return "\n".join(parts)


def named_of(node) -> str | None:
    targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
    return next((t.id for t in targets if isinstance(t, ast.Name)), None)


def _write(path: pathlib.Path, text: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def on_pre_build(config):
    OUT.mkdir(exist_ok=True)
    pages = _built.nav_pages(config)
    for module in MODULES:
        if pages is not None and f"source/{module}.md" not in pages:
            continue  # a build without this page (docs/hooks/_built.py)
        front = "---\nhide:\n  - navigation\n  - toc\nsearch:\n  exclude: true\n---\n\n"
        _write(OUT / f"{module}.md", front + annotated_markdown(module))
