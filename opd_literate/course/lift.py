r"""Copy-ready functions: one public function and everything it needs, as one block of code.

An instructor who lifts [opd_literate.opd.full_vocab_reverse_kl][] into course material needs
its private helpers, the argument checks of ``_numerics`` they call, the module constants they
read and the imports at the top. This module finds them from the source with ``ast`` (no
hand-kept list, so a new helper is picked up the day it is written) and prints them in an order
that runs: the imports, then every helper and constant the function uses, directly or through
another helper, each before its first user, then the function itself with its docstring.

The names the function's own doctests use (a toy built by ``make_toy``, say) count as used, so
the doctests pass in the snippet alone: ``tests/test_copy.py`` runs them in an interpreter that
has numpy and torch but not this package. Nothing is imported to build a snippet (the source is
only parsed), and a numpy function's snippet never imports torch.

Command line::

    python -m opd_literate.course.lift opd.full_vocab_reverse_kl        # or the console script
    opd-copy opd_literate.mismatch.estimators.token_tis

The API pages show the same snippet under each function (``docs/hooks/snippets.py``).
"""

from __future__ import annotations

import argparse
import ast
import doctest
import functools
import pathlib
import sys
from dataclasses import dataclass

__all__ = ["CopyError", "COPY_READY_MODULES", "public_functions", "snippet", "main"]

PACKAGE = "opd_literate"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]

COPY_READY_MODULES = ("opd", "mismatch.toy", "mismatch.estimators", "mismatch.opd_mismatch")
"""The modules whose every public function has its snippet on its API page (and is tested)."""

# Heads what only the docstring's examples use: a reader can cut the snippet here.
_RULE = "# " + "=" * 96
_EXAMPLES_BANNER = (
    f"{_RULE}\n# Not needed by the function: what the examples in its docstring use.\n{_RULE}"
)

# A comment line of dashes opens a section of a module; it belongs to no single definition.
_BANNER_PREFIX = "# " + "-" * 10


class CopyError(ValueError):
    """A name that has no snippet (unknown, private, or a construct this tool cannot lift)."""


@dataclass(frozen=True)
class _Definition:
    module: str
    name: str
    node: ast.AST
    text: str  # the source lines, with the comment just above and an attribute's docstring


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
        text = "\n".join(lines[start - 1:end])
        for name in names:
            definitions[name] = _Definition(module, name, node, text)
    return _Module(module, future, definitions, imports, all_names)


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


def _collect(target: _Definition):
    """What ``target`` needs, and what only its examples need, each before its first user.

    Returns two lists of definitions (the first ends with ``target``) and the set of imports.
    """
    imports, visiting, done = set(), set(), {}

    def visit(definition: _Definition, order: list, extra=()):
        key = (definition.module, definition.name)
        if key in done or key in visiting:
            return
        visiting.add(key)
        for name in _names_used([definition.node, *extra]):
            found = _resolve(definition.module, name)
            if isinstance(found, _Definition):
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


def _import_block(imports) -> str:
    """The imports, grouped and sorted as ruff's isort rule wants them (stdlib, then others)."""
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    groups = {True: ([], {}), False: ([], {})}
    for kind, module, name in imports:
        straight, froms = groups[module.split(".")[0] in stdlib]
        if kind == "import":
            straight.append(f"import {module}" + (f" as {name}" if name else ""))
        else:
            froms.setdefault(module, set()).add(name)
    blocks = []
    for is_stdlib in (True, False):
        straight, froms = groups[is_stdlib]
        lines = sorted(set(straight), key=lambda line: line.split()[1].lower())
        for module in sorted(froms, key=str.lower):
            lines.append(f"from {module} import {', '.join(sorted(froms[module]))}")
        if lines:
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


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


def snippet(qualname: str) -> str:
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
    needed, for_examples, imports = _collect(target)
    future = any(_parse(d.module).future_annotations for d in needed + for_examples)
    head = ["from __future__ import annotations"] if future else []
    block = _import_block(imports)
    if block:
        head.append(block)
    body = "\n\n\n".join(d.text for d in needed)
    if for_examples:
        body += "\n\n\n" + _EXAMPLES_BANNER + "\n" + "\n\n\n".join(d.text for d in for_examples)
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
    args = parser.parse_args(argv)
    try:
        code = snippet(args.qualname)
    except CopyError as error:
        print(f"opd-copy: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
