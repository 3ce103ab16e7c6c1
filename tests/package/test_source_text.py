r"""The source as text: LaTeX written through a plain (not raw) string leaves its trace here.

In a plain string ``"\tau"`` is a tab and ``"au"``, ``"\nabla"`` a line break and ``"abla"``,
``"\frac"`` a form feed: the docstring still parses and ruff's D301 sees no backslash to
complain of, but the page shows broken math. Two checks find what that leaves: a control
character other than the line break in any tracked text file, and a line of a function's or
class's docstring that starts left of the docstring's own indentation (the line break
``\n`` opened it).
"""

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


def _tracked(*patterns):
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # an sdist, not a clone: walk the tree
        out = [str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.rglob(pattern)
               if ".venv" not in p.parts and "mutants" not in p.parts[0]]
    return sorted(set(out))


def control_characters(text):
    """``[(line, repr of the character)]`` for every control character but the line break."""
    return [(text.count("\n", 0, m.start()) + 1, repr(m.group())) for m in CONTROL.finditer(text)]


def outdented_docstring_lines(source):
    """``[(line, text)]``: lines of a function's or class's docstring indented less than the
    statement that holds it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        indent = first.col_offset
        lines = source.split("\n")[first.lineno - 1:first.end_lineno]
        for offset, line in enumerate(lines[1:], start=first.lineno + 1):
            if line.strip() and len(line) - len(line.lstrip(" ")) < indent:
                found.append((offset, line))
    return found


def test_no_control_characters():
    found = {path: control_characters((ROOT / path).read_text(encoding="utf-8"))
             for path in _tracked("*.py", "*.md", "*.yml", "*.toml", "*.js", "*.css")}
    assert {path: where for path, where in found.items() if where} == {}


def test_no_docstring_line_outdented():
    found = {path: outdented_docstring_lines((ROOT / path).read_text(encoding="utf-8"))
             for path in _tracked("*.py")}
    assert {path: where for path, where in found.items() if where} == {}


def test_latex_through_a_plain_string_is_found():
    plain = 'def f():\n    """Its gradient $\\nabla J_\\tau$."""\n'  # as a plain string writes it
    broken = plain.replace("\\nabla", "\nabla").replace("\\tau", "\tau")
    assert control_characters(broken) == [(3, "'\\t'")]
    assert outdented_docstring_lines(broken) == [(3, 'abla J_\tau$."""')]
    assert control_characters(plain) == outdented_docstring_lines(plain) == []
