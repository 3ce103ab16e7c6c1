r"""Copy-ready functions: one public function and everything it needs, as one block of code.

An instructor who lifts [opd_literate.opd.full_vocab_reverse_kl][] into course material needs
its private helpers, the argument checks of ``_numerics`` they call, the module constants they
read and the imports at the top. This module finds them from the source with ``ast`` (no
hand-kept list, so a new helper is picked up the day it is written) and prints them in an order
that runs: the imports, then every helper and constant the function uses, directly or through
another helper, each before its first user, then the function itself with its docstring.

The names the function's own doctests use (a toy built by ``make_toy``, say) count as used, so
the doctests pass in the snippet alone: ``tests/course/test_lift.py`` runs them in an interpreter
that has numpy and torch but not this package. Nothing is imported to build a snippet (the source is
only parsed), and a numpy function's snippet never imports torch.

A snippet is ready for course material: a solution region keeps both markers (the
``### END SOLUTION`` after the last statement is a comment the syntax tree leaves out), the
site's cross-references read as plain text, and an import inside a helper (``_numerics``
loads torch lazily) joins the import block. ``compact=True`` (``--compact``) is for handouts,
which sit beside a lab folder or the installed package: the function keeps its docstring; a name
of the public API or of the shared numerics (which every lab folder holds whole) is imported,
not copied (on a line marked ``noqa: F401`` where only the examples use it); the private helpers
that remain keep their summary line, and every ``if ...: raise`` of theirs is an ``assert``; a
call of a check (a helper named ``check_*`` or ``_check*``, recognised by what it is) that only
raises becomes the asserts it amounts to. A lab function's compact snippet is at most twice the
function's length, and runs in the lab folder once ``course.labs.flatten_imports`` has made its
package imports flat, as for the student module.

Command line::

    python -m opd_literate.course.lift opd.full_vocab_reverse_kl        # or the console script
    opd-copy opd_literate.mismatch.estimators.token_tis
    opd-copy --compact opd.opd_pg_loss

The API pages show the same snippet under each function (``docs/hooks/snippets.py``).
"""

from __future__ import annotations

import argparse
import ast
import doctest
import functools
import pathlib
import re
import sys
from dataclasses import dataclass

__all__ = ["CopyError", "COPY_READY_MODULES", "public_functions", "snippet", "main"]

PACKAGE = "opd_literate"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]

COPY_READY_MODULES = ("opd", "mismatch.toy", "mismatch.estimators", "mismatch.opd_mismatch",
                      "mismatch.correction", "mismatch.engine", "mismatch.task_rewards",
                      "large_vocab.chunked", "large_vocab.topk", "large_vocab.clamps",
                      "large_vocab.supports", "teachers.cross_tokenizer", "teachers.many_teachers",
                      "teachers.teacher_targets")
"""The modules whose every public function has its snippet on its API page (and is tested)."""

# Heads what only the docstring's examples use: a reader can cut the snippet here.
_RULE = "# " + "=" * 96
_EXAMPLES_BANNER = (
    f"{_RULE}\n# Not needed by the function: what the examples in its docstring use.\n{_RULE}"
)

# A comment line of dashes opens a section of a module; it belongs to no single definition.
_BANNER_PREFIX = "# " + "-" * 10

# The solution markers of the lab modules (course.markers reads them; matched alike here).
_BEGIN = re.compile(r"^\s*### BEGIN SOLUTION")
_END = re.compile(r"^\s*### END SOLUTION\s*$")

# Cross-references that only the site resolves: ``[opd_literate.opd.opd_pg_loss][]`` and
# ``[the loss][opd_literate.opd.opd_pg_loss]``; a snippet shows them as plain text.
_BARE_REFERENCE = re.compile(r"\[(?:opd_literate\.)(?:\w+\.)*(?P<name>\w+)\]\[\]")
_TITLED_REFERENCE = re.compile(r"\[(?P<text>[^\[\]]+)\]\[opd_literate(?:\.\w+)+\]")


class CopyError(ValueError):
    """A name that has no snippet (unknown, private, or a construct this tool cannot lift)."""


@dataclass(frozen=True)
class _Definition:
    module: str
    name: str
    node: ast.AST
    text: str  # the source lines, with the comment just above and an attribute's docstring
    first_line: int = 1  # the line of the module where ``text`` starts


@dataclass(frozen=True)
class _Module:
    name: str
    future_annotations: bool
    definitions: dict  # name -> _Definition (top level: def, class, assignment)
    imports: dict  # name -> ("import", module, asname) | ("from", module, name) | ("package", ...)
    all_names: tuple


def _module_path(module: str) -> pathlib.Path:
    """``mismatch.toy`` -> ``opd_literate/mismatch/toy.py``."""
    return PACKAGE_DIR.joinpath(*module.split(".")).with_suffix(".py")


@functools.cache  # cleared by the docs hook before each build (mkdocs serve)
def _parse(module: str) -> _Module:
    path = _module_path(module)
    if not path.is_file():
        raise CopyError(f"no module {PACKAGE}.{module}")
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    definitions, imports, all_names, future = {}, {}, (), False
    body = tree.body
    for index, node in enumerate(body):
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports: used in annotations only
            for inner in node.body:
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    _record_import(inner, imports, module)
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future = future or any(alias.name == "annotations" for alias in node.names)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _record_import(node, imports, module)
            continue
        names = _bound_names(node)
        if names == ["__all__"]:
            all_names = tuple(ast.literal_eval(node.value))
            continue
        if not names:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        end = node.end_lineno
        following = body[index + 1] if index + 1 < len(body) else None
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            end = following.end_lineno  # the attribute's docstring
        while start > 1 and lines[start - 2].startswith("#"):
            if lines[start - 2].startswith(_BANNER_PREFIX):
                break
            start -= 1
        end = _close_solutions(lines, start, end, f"{PACKAGE}.{module}")
        text = "\n".join(lines[start - 1:end])
        for name in names:
            definitions[name] = _Definition(module, name, node, text, start)
    # A relative import inside a function (kept out of the module's top so that a lab folder
    # without that module still imports this one) names the package's definition as a
    # top-level one would: the snippet inlines it.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node not in body:
            inner = {}
            _record_import(node, inner, module)
            for name, kind in inner.items():
                imports.setdefault(name, kind)
    return _Module(module, future, definitions, imports, all_names)


def _close_solutions(lines: list[str], start: int, end: int, where: str) -> int:
    """The last line of a definition, moved past the ``### END SOLUTION`` comment that closes a
    solution region the syntax tree ends before (a comment is no statement of the body)."""
    def opened(last):
        block = lines[start - 1:last]
        return (sum(bool(_BEGIN.match(line)) for line in block)
                - sum(bool(_END.match(line)) for line in block))

    while opened(end) > 0:
        if end >= len(lines) or (lines[end].strip() and not lines[end].lstrip().startswith("#")):
            raise CopyError(f"{where}, line {start}: a BEGIN SOLUTION without its END SOLUTION")
        end += 1
    return end


def _bound_names(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _absolute(module: str, node) -> str | None:
    """The module, dotted below the package, that a relative import of ``module`` names:
    ``from .toy`` in ``mismatch.estimators`` is ``mismatch.toy``, ``from .._numerics`` is
    ``_numerics``; None above the package."""
    parents = module.split(".")[:-1]
    if node.level - 1 > len(parents) or not node.module:
        return None
    return ".".join(parents[:len(parents) - (node.level - 1)] + [node.module])


def _record_import(node, imports: dict, module: str) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            # `import torch.nn.functional as F` binds F; `import torch.nn` binds torch
            bound = alias.asname or alias.name.split(".")[0]
            imports[bound] = ("import", alias.name, alias.asname)
        return
    for alias in node.names:
        bound = alias.asname or alias.name
        if node.level:
            target = _absolute(module, node)
            if target is None or alias.asname:
                imports[bound] = ("unsupported", ast.unparse(node), None)
            else:
                imports[bound] = ("package", target, alias.name)
        else:
            imports[bound] = ("from", node.module, alias.name)


def _names_used(nodes) -> list[str]:
    """The free names of some code: loaded, and not bound inside it, in order of appearance."""
    loaded, bound = [], set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                (loaded.append if isinstance(node.ctx, ast.Load) else bound.add)(node.id)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom) and node.level:
                    continue  # a package definition: free, resolved through _parse's imports
                bound.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node is not root:
                    bound.add(node.name)
    seen, free = set(), []
    for name in loaded:
        if name not in bound and name not in seen:
            seen.add(name)
            free.append(name)
    return free


def _doctest_code(definition: _Definition) -> list[ast.AST]:
    """The parsed examples of a function's or class's docstring (what its doctests run)."""
    docstring = ast.get_docstring(definition.node, clean=True) if isinstance(
        definition.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
    if not docstring:
        return []
    trees = []
    for example in doctest.DocTestParser().get_examples(docstring):
        try:
            trees.append(ast.parse(example.source))
        except SyntaxError:
            continue
    return trees


def _resolve(module: str, name: str):
    """Where ``name``, as used in ``module``, comes from: a _Definition, an import, or None."""
    parsed = _parse(module)
    if name in parsed.definitions:
        return parsed.definitions[name]
    kind = parsed.imports.get(name)
    if kind is None:
        return None  # a builtin (or a name Python would not find either)
    if kind[0] == "package":
        if kind[1].startswith("course"):
            raise CopyError(f"{PACKAGE}.{module} imports from the course tools")
        found = _resolve(kind[1], kind[2])
        if not isinstance(found, _Definition):
            return found
        return found
    if kind[0] == "unsupported":
        raise CopyError(f"{PACKAGE}.{module}: cannot lift the import {kind[1]!r}")
    return kind


@functools.lru_cache(maxsize=4096)  # a helper is visited once per snippet that uses it
def _inner_imports(definition: _Definition) -> frozenset:
    """The imports inside a function (a lazy ``import torch``): the snippet hoists them."""
    found = set()
    for node in ast.walk(definition.node):
        if node is definition.node or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        renamed = isinstance(node, ast.ImportFrom) and any(a.asname for a in node.names)
        if isinstance(node, ast.ImportFrom) and node.level and not renamed:
            continue  # a definition of the package, inlined like a top-level import's
        if renamed:
            raise CopyError(f"{PACKAGE}.{definition.module}.{definition.name}: cannot hoist "
                            f"the import {ast.unparse(node)!r}")
        for alias in node.names:
            if isinstance(node, ast.Import):
                found.add(("import", alias.name, alias.asname))
            else:
                found.add(("from", node.module, alias.name))
    return frozenset(found)


@functools.lru_cache(maxsize=4096)  # the same: walking every helper's tree again was most of
def _free_names(definition: _Definition) -> tuple[str, ...]:  # the time of lifting them all
    return tuple(_names_used([definition.node]))


def _is_check(name: str) -> bool:
    """A validation helper, by what it is: ``check_*`` (``_numerics``) or a module's ``_check*``."""
    return name.startswith(("check_", "_check"))


# not (a OP b) written as a (inverse OP) b
_INVERSE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt,
            ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}


def _negated(test: ast.expr) -> ast.expr:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if (isinstance(test, ast.Compare) and len(test.ops) == 1
            and type(test.ops[0]) in _INVERSE):
        return ast.Compare(test.left, [_INVERSE[type(test.ops[0])]()], test.comparators)
    return ast.UnaryOp(ast.Not(), test)


def _operand_lines(node: ast.expr, indent: str, lead: str = "") -> list[str]:
    """``node`` at ``indent`` after ``lead`` (``"and "``, ``"or "`` or nothing): one line when it
    fits in 100 columns, else a ``not (...)`` or a chain of ``and``/``or`` one operand a line,
    nested as deep as it needs."""
    line = f"{indent}{lead}{ast.unparse(node)}"
    if len(line) <= 100:
        return [line]
    prefix, inner = "", node
    if isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.Not):
        prefix, inner = "not ", inner.operand
    if not isinstance(inner, ast.BoolOp):
        return [line + "  # noqa: E501"]
    word = "and " if isinstance(inner.op, ast.And) else "or "
    lines = [f"{indent}{lead}{prefix}("]
    for number, value in enumerate(inner.values):
        lines += _operand_lines(value, indent + "    ", word if number else "")
    return lines + [f"{indent})"]


def _assert_lines(indent: str, condition: ast.expr) -> list[str]:
    """``assert condition``, one line when it fits in 100 columns, else one operand a line."""
    return _operand_lines(condition, indent, "assert ")


def _assert_edits(statements, lines: list[str], offset: int) -> list:
    """Each ``if COND: ... raise`` of a validation helper as ``assert not COND`` (one line), and
    a ``try`` whose handlers only raise as its body: the checks stay, their messages go."""
    edits = []
    for statement in statements:
        indent = " " * statement.col_offset
        if (isinstance(statement, ast.If) and not statement.orelse
                and isinstance(statement.body[-1], ast.Raise)):
            edits.append((statement.lineno, statement.end_lineno,
                          _assert_lines(indent, _negated(statement.test))))
        elif (isinstance(statement, ast.Try) and statement.handlers and not statement.orelse
              and not statement.finalbody
              and all(len(h.body) == 1 and isinstance(h.body[0], ast.Raise)
                      for h in statement.handlers)):
            first, last = statement.body[0].lineno, statement.body[-1].end_lineno
            body = lines[first - offset:last - offset + 1]
            edits.append((statement.lineno, statement.end_lineno,
                          [line[4:] if line.startswith(indent + " " * 4) else line
                           for line in body]))
        elif isinstance(statement, (ast.If, ast.For, ast.While, ast.With)):
            edits += _assert_edits(statement.body + getattr(statement, "orelse", []), lines,
                                   offset)
    return edits


def _message_only_edits(function, statements, converted) -> list:
    """The top-level ``name = ...`` statements whose name is read only by the messages that the
    asserts dropped (a suffix such as ``where``): they go with the messages, not left unused."""
    if not converted:
        return []
    spans = [(first, last) for first, last, _ in converted]

    def dropped(node):  # a line range that one of the converted statements replaced
        return any(first <= node.lineno and node.end_lineno <= last for first, last in spans)

    read = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load) and not dropped(n)}
    # the conditions stay, as the asserts' (and a try's body as it was): their names are read
    kept = [n.test for n in ast.walk(function) if isinstance(n, ast.If)
            and (n.lineno, n.end_lineno) in spans]
    kept += [b for n in ast.walk(function) if isinstance(n, ast.Try)
             and (n.lineno, n.end_lineno) in spans for b in n.body]
    read |= {n.id for root in kept for n in ast.walk(root) if isinstance(n, ast.Name)}
    edits = []
    for statement in statements:
        if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)
                and statement.targets[0].id not in read
                and all(isinstance(n, (ast.Constant, ast.IfExp, ast.Compare, ast.Name,
                                       ast.JoinedStr, ast.FormattedValue, ast.Load, ast.cmpop))
                        for n in ast.walk(statement.value))):
            edits.append((statement.lineno, statement.end_lineno, []))
    return edits


class _Substitute(ast.NodeTransformer):
    """A check's parameters replaced by the arguments of one call, constants folded."""

    def __init__(self, values: dict):
        self.values = values

    def visit_Name(self, node):
        return self.values.get(node.id, node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        if (len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot))
                and isinstance(node.left, ast.Constant)
                and isinstance(node.comparators[0], ast.Constant)):
            same = node.left.value is node.comparators[0].value
            return ast.Constant(same if isinstance(node.ops[0], ast.Is) else not same)
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        absorbing = isinstance(node.op, ast.Or)  # True absorbs an `or`, False an `and`
        values = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                if value.value == absorbing:
                    return ast.Constant(absorbing)
                continue
            values.append(value)
        if not values:
            return ast.Constant(not absorbing)
        return values[0] if len(values) == 1 else ast.BoolOp(node.op, values)


def _inline_check(check: ast.FunctionDef, call: ast.Call, indent: str = "") -> list[str] | None:
    """The asserts a call of a check amounts to, at ``indent``, or None when the check does more
    than raise (it computes and returns a value, or loops): such a call stays a call."""
    body = check.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    params = check.args.posonlyargs + check.args.args
    if check.args.vararg or check.args.kwarg or len(call.args) > len(params) or any(
            isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None
                                                                  for k in call.keywords):
        return None
    values = dict(zip([a.arg for a in params][len(params) - len(check.args.defaults):],
                      check.args.defaults))
    values.update(zip([k.arg for k in check.args.kwonlyargs], check.args.kw_defaults))
    values.update(zip([a.arg for a in params], call.args))
    values.update({k.arg: k.value for k in call.keywords})
    lines = []
    for statement in body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if not (isinstance(statement, ast.If) and not statement.orelse
                and isinstance(statement.body[-1], ast.Raise)):
            return None
        test = _Substitute(values).visit(ast.parse(ast.unparse(statement.test), mode="eval").body)
        if isinstance(test, ast.Constant) and not test.value:
            continue  # a check that these arguments cannot fail
        lines += _assert_lines(indent, _negated(test))
    return lines


def _call_site_edits(node, lines: list[str], offset: int, checks: dict) -> list:
    """Each statement that only calls a check (its result unused) as that check's asserts."""
    edits = []
    for statement in ast.walk(node):
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                and isinstance(statement.value.func, ast.Name)
                and statement.value.func.id in checks):
            continue
        indent = " " * statement.col_offset
        asserts = _inline_check(checks[statement.value.func.id], statement.value, indent)
        if asserts is not None:
            edits.append((statement.lineno, statement.end_lineno, asserts))
    return edits


def _summary_docstring(docstring: ast.Expr, lines: list[str], offset: int) -> list[str]:
    """A docstring cut to its first paragraph (the summary), closed on its last line."""
    first, last = docstring.lineno - offset, docstring.end_lineno - offset
    kept = []
    for line in lines[first:last + 1]:
        if not line.strip():
            break
        kept.append(line)
    if len(kept) == last - first + 1:
        return kept  # one paragraph already
    indent = " " * docstring.col_offset
    if len(kept[-1]) + 3 <= 100:
        return kept[:-1] + [kept[-1] + '"""']
    return kept + [indent + '"""']


def _unused_loop_names_marked(text: str) -> str:
    """A loop variable that only the removed error messages used, renamed ``_name`` (as ruff's
    B007 asks), so that a compact snippet stays lint-clean."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.split("\n")
    for node in ast.walk(tree):
        if not isinstance(node, ast.For):
            continue
        used = {n.id for statement in node.body for n in ast.walk(statement)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        targets = [n for n in ast.walk(node.target) if isinstance(n, ast.Name)]
        for target in sorted(targets, key=lambda n: -n.col_offset):
            if target.id not in used and not target.id.startswith("_"):
                line = lines[target.lineno - 1]
                lines[target.lineno - 1] = (line[:target.col_offset] + "_" +
                                            line[target.col_offset:])
    return "\n".join(lines)


def _render(definition: _Definition, *, compact: bool = False, whole_docstring: bool = True,
            checks=None) -> str:
    """The text of a definition as a snippet shows it: the imports inside it hoisted (removed
    here, with the blank line after them), the site's cross-references as plain text. Compact:
    the docstring cut to its summary unless ``whole_docstring`` (the function itself), a
    helper's raises turned into asserts, and a call of a check into the asserts it amounts to."""
    node, lines, offset = definition.node, definition.text.split("\n"), definition.first_line
    edits = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        for inner in ast.walk(node):
            if inner is not node and isinstance(inner, (ast.Import, ast.ImportFrom)):
                last = inner.end_lineno
                if last - offset + 1 < len(lines) and not lines[last - offset + 1].strip():
                    last += 1
                edits.append((inner.lineno, last, []))
        body = node.body
        docstring = (body[0] if body and isinstance(body[0], ast.Expr)
                     and isinstance(body[0].value, ast.Constant)
                     and isinstance(body[0].value.value, str) else None)
        if compact and docstring is not None and not whole_docstring:
            edits.append((docstring.lineno, docstring.end_lineno,
                          _summary_docstring(docstring, lines, offset)))
        # every helper's `if ...: raise` (the function's own raises stay: its doctests show them)
        if compact and not whole_docstring and not isinstance(node, ast.ClassDef):
            checked = body[1:] if docstring else body
            converted = _assert_edits(checked, lines, offset)
            edits += converted + _message_only_edits(node, checked, converted)
        if compact and checks:
            edits += _call_site_edits(node, lines, offset, checks)
    for first, last, replacement in sorted(edits, reverse=True):
        lines[first - offset:last - offset + 1] = replacement
    text = "\n".join(lines)
    if compact and edits:
        text = _unused_loop_names_marked(text)
    text = _BARE_REFERENCE.sub(lambda m: f"``{m.group('name')}``", text)
    return _TITLED_REFERENCE.sub(lambda m: m.group("text"), text)


# What a handout has at hand besides the package's public API: the shared numerics, which
# every lab folder holds whole as a given module (``course.labs.LABS``; a test keeps it so).
HANDOUT_GIVEN = ("_numerics",)


def _importable_in_handout(definition: _Definition) -> bool:
    """A name a compact snippet imports instead of copying: in its module's ``__all__``, the
    module public or one that every lab hands out whole (``HANDOUT_GIVEN``)."""
    public = not any(part.startswith("_") for part in definition.module.split("."))
    return ((public or definition.module in HANDOUT_GIVEN)
            and definition.name in _parse(definition.module).all_names)


def _raises_only(definition: _Definition) -> bool:
    """A check that only raises (each statement an ``if ...: raise``): a compact snippet turns
    its calls into asserts, so it is copied (and then dropped), not imported."""
    node = definition.node
    if not (_is_check(definition.name) and isinstance(node, ast.FunctionDef)):
        return False
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return all(isinstance(s, (ast.Import, ast.ImportFrom)) or (
        isinstance(s, ast.If) and not s.orelse and isinstance(s.body[-1], ast.Raise))
        for s in body)


def _collect(target: _Definition, compact: bool = False):
    """What ``target`` needs, and what only its examples need, each before its first user.

    Returns two lists of definitions (the first ends with ``target``) and the set of imports.
    ``compact``: a name of the public API or the shared numerics (other than ``target``, and
    other than a check that only raises) is imported, not copied.
    """
    imports, visiting, done = set(), set(), {}

    def visit(definition: _Definition, order: list, extra=()):
        key = (definition.module, definition.name)
        if key in done or key in visiting:
            return
        visiting.add(key)
        imports.update(_inner_imports(definition))
        for name in (_names_used([definition.node, *extra]) if extra
                     else _free_names(definition)):
            found = _resolve(definition.module, name)
            if (compact and isinstance(found, _Definition) and found is not target
                    and _importable_in_handout(found) and not _raises_only(found)):
                imports.add(("from", f"{PACKAGE}.{found.module}", found.name))
            elif isinstance(found, _Definition):
                visit(found, order)
            elif found is not None:
                imports.add(found)
        visiting.discard(key)
        done[key] = definition
        if all(d.text != definition.text for d in order):  # `a = b = 1` binds two names
            order.append(definition)

    needed, for_examples = [], []
    visit(target, needed)
    # The names the doctests use: visited as a pseudo-definition that is not emitted itself.
    examples = _Definition(target.module, "<examples>", ast.Module(body=[], type_ignores=[]), "")
    visit(examples, for_examples, _doctest_code(target))
    for_examples = [d for d in for_examples if d is not examples
                    and all(d.text != n.text for n in needed)]
    by_name = {}
    for definition in needed + for_examples:
        other = by_name.setdefault(definition.name, definition)
        if other.module != definition.module:
            raise CopyError(
                f"{definition.name!r} is defined in both {PACKAGE}.{other.module} and "
                f"{PACKAGE}.{definition.module}: the snippet would need one of them renamed"
            )
    return needed, for_examples, imports


def _unused_removed(target, needed, for_examples, imports, texts):
    """The definitions and imports that the rendered text of the others still names."""
    def used(name, kept, own=None):
        rest = "\n".join(texts[id(d)] for d in kept if d is not own)
        return re.search(rf"(?<![\w.]){re.escape(name)}\b", rest) is not None

    kept = needed + for_examples
    while True:
        unused = [d for d in kept if d is not target and not used(d.name, kept, d)]
        if not unused:
            break
        kept = [d for d in kept if d not in unused]

    def bound(kind):
        return kind[2] if kind[0] != "import" else (kind[2] or kind[1].split(".")[0])

    imports = {kind for kind in imports if used(bound(kind), kept)}
    return ([d for d in needed if d in kept], [d for d in for_examples if d in kept], imports)


def _import_block(imports, examples_only=frozenset()) -> str:
    """The imports, grouped and sorted as ruff's isort rule wants them: the standard library,
    then third parties, then this package (a compact snippet's imports of the public API). A
    name in ``examples_only`` is used by a docstring's examples alone, which ruff does not
    read: its line says so (``noqa: F401``)."""
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    groups = {"stdlib": ([], {}), "other": ([], {}), "package": ([], {})}
    for kind, module, name in imports:
        top = module.split(".")[0]
        straight, froms = groups["stdlib" if top in stdlib else
                                 "package" if top == PACKAGE else "other"]
        noqa = "  # noqa: F401 (the examples use it)"
        if kind == "import":
            bound = name or module.split(".")[0]
            straight.append(f"import {module}" + (f" as {name}" if name else "")
                            + (noqa if bound in examples_only else ""))
        else:
            froms.setdefault(module, set()).add(name)
    blocks = []
    for group in ("stdlib", "other", "package"):
        straight, froms = groups[group]
        lines = sorted(set(straight), key=lambda line: line.split()[1].lower())
        for module in sorted(froms, key=str.lower):
            names = sorted(froms[module], key=_isort_key)
            line = f"from {module} import {', '.join(names)}"
            flag = noqa if set(names) & examples_only else ""
            if len(line + flag) <= 100:
                lines.append(line + flag)
            else:  # one name a line, as ruff wraps a long import
                lines += ([f"from {module} import ("]
                          + [f"    {n},{noqa if n in examples_only else ''}" for n in names]
                          + [")"])
        if lines:
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _isort_key(name: str):
    """isort's order of the names of one import: constants, then classes, then the rest."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, name)


def _code_names(code: str) -> set:
    """The names the code itself loads (docstrings, and so their examples, are not code)."""
    return {node.id for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _split_qualname(qualname: str) -> tuple[str, str]:
    parts = qualname.strip().split(".")
    if parts and parts[0] == PACKAGE:
        parts = parts[1:]
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise CopyError(
            f"expected MODULE.NAME or {PACKAGE}.MODULE.NAME (e.g. opd.full_vocab_reverse_kl, "
            f"mismatch.toy.make_toy), got {qualname!r}"
        )
    return ".".join(parts[:-1]), parts[-1]


def snippet(qualname: str, compact: bool = False) -> str:
    """The self-contained source of a public function (or class, or constant) of the package.

    ``qualname`` is ``MODULE.NAME`` or ``opd_literate.MODULE.NAME``. The result holds the
    imports, every module constant and helper the definition uses (transitively, across the
    package's modules) and the definition itself, ending with a newline.

    Examples
    --------
    ``kl_estimator`` reads one module constant and calls three helpers of ``_numerics``:

    >>> code = snippet("opd.kl_estimator")
    >>> [line.split("(")[0] for line in code.splitlines()
    ...  if line.startswith(("import", "from", "def", "KL_"))]
    ['from __future__ import annotations', 'import torch', 'KL_ESTIMATORS = ',
     'def check_float_tensor', 'def check_same_shape', 'def compute_dtype', 'def kl_estimator']
    >>> snippet("opd._select")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    opd_literate.course.lift.CopyError: opd_literate.opd._select is private: copy a public function
    ...
    """
    module, name = _split_qualname(qualname)
    if not _module_path(module).is_file():
        raise CopyError(f"no module {PACKAGE}.{module}")
    if module.split(".")[-1].startswith("_") or module.startswith("course"):
        raise CopyError(f"{PACKAGE}.{module} is not a module with copy-ready functions")
    if name.startswith("_"):
        raise CopyError(
            f"{PACKAGE}.{module}.{name} is private: copy a public function that uses it")
    target = _resolve(module, name)
    if not isinstance(target, _Definition):
        raise CopyError(f"{PACKAGE}.{module} defines no {name!r}")
    needed, for_examples, imports = _collect(target, compact=compact)
    future = any(_parse(d.module).future_annotations for d in needed + for_examples)
    head = ["from __future__ import annotations"] if future else []
    checks = {d.name: d.node for d in needed + for_examples
              if compact and _is_check(d.name) and isinstance(d.node, ast.FunctionDef)}
    texts = {id(d): _render(d, compact=compact, whole_docstring=d is target, checks=checks)
             for d in needed + for_examples}
    if compact:  # a check whose every call became asserts is no longer used: drop it
        needed, for_examples, imports = _unused_removed(target, needed, for_examples, imports,
                                                        texts)

    def text(definition):
        return texts[id(definition)]

    body = "\n\n\n".join(map(text, needed))
    if for_examples:
        body += "\n\n\n" + _EXAMPLES_BANNER + "\n" + "\n\n\n".join(map(text, for_examples))
    used = _code_names(body)
    bound = {name if kind != "import" else (name or module.split(".")[0])
             for kind, module, name in imports}
    block = _import_block(imports, bound - used)
    if block:
        head.append(block)
    if not head:
        return body + "\n"
    # ruff's isort rule: two blank lines after the imports before a def or class, else one
    first = needed[0].text.lstrip()
    gap = "\n\n\n" if first.startswith(("def ", "class ", "@")) else "\n\n"
    return "\n\n".join(head) + gap + body + "\n"


def public_functions(module: str) -> list[str]:
    """The public functions of ``opd_literate.<module>``, in source order (from ``__all__``)."""
    parsed = _parse(module)
    names = [
        definition.name
        for definition in parsed.definitions.values()
        if isinstance(definition.node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and definition.name in parsed.all_names
    ]
    return names


def main(argv=None) -> int:
    """``opd-copy QUALNAME``: print the snippet; rc 2 and one line on stderr for a bad name."""
    parser = argparse.ArgumentParser(
        prog="opd-copy",
        description="Print a public function of opd_literate with the imports, helpers and "
        "constants it needs, ready to paste (e.g. opd-copy opd.full_vocab_reverse_kl).",
    )
    parser.add_argument("qualname", help="MODULE.NAME or opd_literate.MODULE.NAME")
    parser.add_argument("--compact", action="store_true",
                        help="for a handout: the public API and the shared numerics imported, "
                             "the argument checks as one-line asserts, the helpers' "
                             "docstrings cut to their summary")
    args = parser.parse_args(argv)
    try:
        code = snippet(args.qualname, compact=args.compact)
    except CopyError as error:
        print(f"opd-copy: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
