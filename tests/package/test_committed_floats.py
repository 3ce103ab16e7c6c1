"""Committed floats, one rule: no test compares a recomputed value with a committed file but
through ``tests.helpers.committed.assert_matches_committed``.

A float computed on this machine and one that a JSON record, a fixture, a docs data file or a
benchmark output holds from another may differ in their last bits (numpy and torch pick their
kernels for the CPU at run time), so such a comparison goes through the helper, with its
tolerance and the reason for it. This module reads each test module's syntax tree (nothing is
imported or run, and nothing of pytest's is used but its assertions) and fails, naming
file:line, on any other comparison of the two.

The rule, as checked
--------------------
Each expression is given the sources it comes from, followed through assignments, loops,
comprehensions, ``with``, the module's own functions (once for each distinct set of its
arguments' sources), its fixtures (a test's parameter is the fixture of that name in the
module) and its ``parametrize`` values:

* **committed**: what is read from a file in the repository: ``open``, ``Path.read_text`` and
  ``read_bytes``, ``np.load``, ``loadtxt``, ``genfromtxt``; and what is made from it (a subscript,
  ``json.loads`` of the text, a regex match in it, a sum, ``round``, an f-string).
* **computed**: the result of a call into ``opd_literate`` or torch, of numpy's or math's
  transcendental functions, reductions through the BLAS and random draws, of a subprocess, of a
  method of an object made here (a model, a parser, a browser page), and what is read from a
  file outside the repository (under ``tmp_path``, ``tempfile``, ``/proc``): this run wrote it.

A finding is an equality (``==``, ``!=``, ``in``, ``not in``), an equality assertion
(``np.testing.assert_array_equal``, ``assert_equal``, ``np.array_equal``, ``torch.equal``) or a
tolerance other than the helper's (``pytest.approx``, ``np.allclose``, ``assert_allclose``,
``assert_array_max_ulp``, ``math.isclose``, ``torch.testing.assert_close``...) with a committed
operand on one side and a computed one on the other, unless an operand is exact by
construction: an integer or string literal, ``int()``, ``len()``, ``bool()``, a comparison,
``.shape``, ``.dtype``, ``.keys()``, or an f-string of only such values. (An f-string or a
``round`` of a computed float is a rounding of it: on another CPU a value at the edge rounds the
other way, so it is no exact operand. The helper takes the page's number with half a unit of
its last digit as ``atol``.)

What is not a finding, and why:

* **Committed against committed**: a record against the text of a page, a README or a
  docstring, or against another committed record: nothing was recomputed.
* **Statistics of committed records**: ``headline``, ``ratios``, ``mismatch_summary``,
  ``bootstrap_interval``, ``rank_correlation`` (``DETERMINISTIC`` below) use only ``+ - * /``,
  ``sqrt``, sorting, quantiles, numpy's pairwise sums (whose order is fixed by the length, not
  by the CPU) and numpy's seeded integer draws (bit-identical everywhere); IEEE 754 rounds each
  of those alike on every CPU, so their results stay *committed*.
* **The configuration**: a name imported from ``opd_literate`` and not called (``DEFAULT``,
  ``PRESETS``, a module's ``__doc__``), its attributes, ``.as_dict()`` and the functions of
  ``CONFIGURATION`` below: literals of the source, or integers made from them, which JSON
  writes and reads back exactly (``repr`` of a float round-trips). A committed record's
  ``config`` equals the current configuration bit for bit, or the record is stale.
* A comparison with ``# committed-exact: <reason>`` on one of its lines, or alone on the line
  above it. The reason is required (two words or more), and an opt-out that silences nothing is
  itself a finding.

Limits: it is a heuristic, not a type checker.

* It does not know types: a comparison of strings (a help text against a page) is flagged as if
  it held floats, and wants an opt-out that says so; a float that reaches a comparison through
  ``int()`` or ``len()`` is taken as exact.
* It follows data within a module only: a value returned by another module's helper, a fixture
  defined elsewhere, or an attribute of ``self`` is *neither* source. A call into a library it
  does not list as transparent (``TRANSPARENT_MODULES``) is taken as computed.
* A name keeps the sources of every value assigned to it in its function, not only the last.
* Hand-written tolerances (``abs(a - b) < tol``) are ordering comparisons, not findings.
* It reads ``tests/**/*.py``, skipping a module that reads no file or names no path in the
  repository (``__file__``, ``"docs/..."``). The doctests of ``opd_literate`` read no committed
  file, and the docs hooks assert nothing about committed numbers (read by hand when this was
  written; neither is checked here).
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

LOADED, COMPUTED, OUTSIDE = "committed", "computed", "outside the repository"

OPT_OUT = re.compile(r"#\s*committed-exact\b(.*)")

# Functions of the package that compute on committed records with IEEE-exact operations only.
DETERMINISTIC = {"headline", "ratios", "first_index", "bootstrap_interval", "format_headline",
                 "mismatch_summary", "format_summary", "rank_correlation", "average_ranks"}
# Functions and methods of the package that return configuration: literals, or integers made
# from them (the evaluation steps, the training conditions and their names).
CONFIGURATION = {"as_dict", "eval_steps", "conditions"}

TRANSPARENT_MODULES = {"json", "re", "yaml", "csv", "ast", "textwrap", "itertools", "functools",
                       "collections", "operator", "string", "pathlib", "os", "shutil", "hashlib",
                       "base64", "io", "dataclasses", "typing", "statistics", "fractions",
                       "decimal", "pytest", "numpy", "math", "sys", "inspect", "types",
                       "tokenize", "zipfile", "tarfile", "glob", "fnmatch", "difflib", "shlex",
                       "copy", "enum", "warnings", "contextlib", "platform", "datetime"}
# numpy's and math's functions whose result depends on the CPU's kernels (or on libm's).
TRANSCENDENTAL = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "logaddexp",
                  "logaddexp2", "power", "pow", "float_power", "sin", "cos", "tan", "arcsin",
                  "arccos", "arctan", "arctan2", "sinh", "cosh", "tanh", "arcsinh", "arccosh",
                  "arctanh", "asin", "acos", "atan", "atan2", "asinh", "acosh", "atanh", "erf",
                  "erfc", "gamma", "lgamma", "cbrt", "random", "dot", "matmul", "einsum",
                  "inner", "outer", "tensordot", "vdot", "linalg", "fft", "convolve",
                  "correlate", "polyfit", "polyval", "lstsq", "inv", "solve", "det", "norm"}
LOAD_FUNCTIONS = {"numpy.load", "numpy.loadtxt", "numpy.genfromtxt", "numpy.fromfile",
                  "pandas.read_csv", "pandas.read_json", "open", "io.open"}
OUTSIDE_NAMES = {"tmp_path", "tmp_path_factory", "tmpdir", "tmpdir_factory"}
EXACT_BUILTINS = {"int", "len", "bool", "isinstance", "issubclass", "callable", "hasattr", "id",
                  "hash", "any", "all", "type", "range", "ord"}
EXACT_METHODS = {"keys", "startswith", "endswith", "isdigit", "isidentifier", "isalpha",
                 "exists", "is_file", "is_dir", "is_symlink", "count", "index", "find",
                 "rfind", "bit_length", "is_integer"}
EXACT_ATTRIBUTES = {"shape", "ndim", "size", "dtype", "name", "stem", "suffix", "__name__",
                    "is_leaf", "requires_grad", "returncode"}
# Methods that only take a container, a string or a path apart: their result comes from the
# object's own sources. Any other method of an object made here is computed.
DATA_METHODS = {"items", "values", "get", "copy", "tolist", "item", "split", "rsplit", "strip",
                "lstrip", "rstrip", "splitlines", "join", "format", "replace", "lower", "upper",
                "partition", "rpartition", "group", "groups", "groupdict", "span", "start",
                "end", "findall", "finditer", "search", "match", "fullmatch", "sub",
                "removeprefix", "removesuffix", "encode", "decode", "read", "readlines",
                "readline", "glob", "rglob", "iterdir", "resolve", "relative_to", "with_suffix",
                "with_name", "joinpath", "parent", "absolute", "stat", "pop", "setdefault",
                "update", "append", "extend", "add", "sort", "reverse", "union",
                "intersection", "difference", "issubset", "issuperset", "mean", "sum", "max",
                "min", "argmax", "argmin", "abs", "astype", "reshape", "ravel", "flatten",
                "squeeze", "transpose", "any", "all", "round", "cumsum", "clip", "std", "var",
                "sorted", "mktemp", "getbasetemp", "read_text", "read_bytes", "expandtabs",
                "casefold", "zfill", "ljust", "rjust", "center", "title", "capitalize",
                "translate", "maketrans", "format_map", "__getitem__", "numpy", "float",
                "double", "long", "int", "detach", "cpu", "nonzero", "where", "flat"}
EQUALITY_CALLS = {"numpy.array_equal", "numpy.array_equiv", "numpy.testing.assert_array_equal",
                  "numpy.testing.assert_equal", "torch.equal", "operator.eq", "assertEqual",
                  "assertListEqual", "assertDictEqual", "assertSequenceEqual"}
TOLERANCE_CALLS = {"pytest.approx", "math.isclose", "numpy.isclose", "numpy.allclose",
                   "numpy.testing.assert_allclose", "numpy.testing.assert_almost_equal",
                   "numpy.testing.assert_array_almost_equal", "numpy.testing.assert_approx_equal",
                   "numpy.testing.assert_array_max_ulp",
                   "numpy.testing.assert_array_almost_equal_nulp", "torch.allclose",
                   "torch.isclose", "torch.testing.assert_close", "torch.testing.assert_allclose",
                   "assertAlmostEqual"}
HELPER = "assert_matches_committed"


@dataclass(frozen=True)
class Taint:
    """Where a value comes from (``labels``) and whether it is exact by construction."""

    labels: frozenset = frozenset()
    exact: bool = False


NEUTRAL, EXACT = Taint(), Taint(exact=True)


def join(*taints):
    """The taint of a value made from ``taints``: their sources; exact if each of them is."""
    labels = frozenset().union(*(t.labels for t in taints))
    return Taint(labels, bool(taints) and all(t.exact for t in taints))


def _dotted(node):
    """``a.b.c`` as ["a", "b", "c"], or None when the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _is_fixture(function):
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        dotted = _dotted(target) or []
        if dotted[-1:] == ["fixture"]:
            name = function.name
            if isinstance(decorator, ast.Call):
                for keyword in decorator.keywords:
                    if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                        name = keyword.value.value
            return name
    return None


class Scope:
    """The names of one function (or of the module), and the functions defined there."""

    def __init__(self, parent=None, function=False):
        self.parent, self.names, self.functions = parent, {}, {}
        self.is_function, self.returns = function, None

    def lookup(self, name):
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def function(self, name):
        scope = self
        while scope is not None:
            if name in scope.functions:
                return scope.functions[name], scope
            scope = scope.parent
        return None, None

    def bind(self, name, taint):
        old = self.names.get(name)
        self.names[name] = taint if old is None else Taint(old.labels | taint.labels,
                                                           old.exact and taint.exact)


class Module:
    """The analysis of one module's source: ``findings`` lists ``(line, message)``."""

    def __init__(self, source):
        self.tree = ast.parse(source)
        self.imports = {}  # local name -> dotted origin, from every import met
        self.functions = []  # (definition, the scope it is defined in), as met
        self.opt_outs = {}  # the line of an opt-out comment -> the reason given (maybe "")
        self.opted_lines = {}  # a line it covers (its own; the next, alone on its line) -> it
        if "committed-exact" in source:  # comments, not the text of a string
            for token in tokenize.generate_tokens(io.StringIO(source).readline):
                found = token.type == tokenize.COMMENT and OPT_OUT.match(token.string)
                if found:
                    line = token.start[0]
                    self.opt_outs[line] = found[1].lstrip(":").strip()
                    alone = not token.line[:token.start[1]].strip()
                    self.opted_lines[line + 1 if alone else line] = line
        self.used_opt_outs = set()
        self.findings = set()
        self.fixtures = {}
        self.cache, self.active = {}, set()

    # -- driving ------------------------------------------------------------------------

    def run(self):
        scope = Scope()
        self.module_scope = scope
        self._register(self.tree.body, scope)
        self._block(self.tree.body, scope)
        for function, _ in list(self.functions):  # the tests, with their fixtures
            if function.name.startswith("test") or _is_fixture(function):
                self._call(function, scope, self._fixture_arguments(function), {})
        done = {key[0] for key in self.cache}
        for function, defined_in in self.functions:  # then every other function, once
            if function not in done:
                done.add(function)
                self._call(function, defined_in, {}, {})
        for line, reason in self.opt_outs.items():
            if not reason or len(reason.split()) < 2:
                self.findings.add((line, "`# committed-exact:` needs its reason (two words or "
                                         "more: why the comparison is exact on every machine)"))
            elif line not in self.used_opt_outs:
                self.findings.add((line, "`# committed-exact:` on a line with no comparison of "
                                         "committed and computed data: remove it"))
        return sorted(self.findings)

    def _register(self, body, scope):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name not in scope.functions:
                    self.functions.append((node, scope))
                scope.functions[node.name] = node
                fixture = _is_fixture(node)
                if fixture and scope is self.module_scope:
                    self.fixtures[fixture] = node
            elif isinstance(node, ast.ClassDef):
                self._register(node.body, scope)

    def _fixture_arguments(self, function):
        """A test's (or a fixture's) parameters: the module's fixtures, tmp_path, and the values
        of its ``parametrize`` marks."""
        taints = {}
        for decorator in function.decorator_list:
            dotted = _dotted(decorator.func) if isinstance(decorator, ast.Call) else None
            if dotted and dotted[-1] == "parametrize" and len(decorator.args) >= 2:
                names = decorator.args[0]
                if isinstance(names, ast.Constant) and isinstance(names.value, str):
                    values = self.eval(decorator.args[1], self.module_scope)
                    for name in names.value.replace(" ", "").split(","):
                        taints[name] = values
        for arg in function.args.args + function.args.kwonlyargs:
            name = arg.arg
            if name in OUTSIDE_NAMES:
                taints[name] = Taint(frozenset({OUTSIDE}))
            elif name in self.fixtures and self.fixtures[name] is not function:
                fixture = self.fixtures[name]
                taints[name] = self._call(fixture, self.module_scope,
                                          self._fixture_arguments(fixture), {})
        return taints

    def _call(self, function, parent, positional, keywords):
        """Analyse ``function`` with its parameters' taints; return the taint it returns.

        ``positional`` maps a parameter name or index to a taint, ``keywords`` names."""
        params = function.args
        names = [a.arg for a in params.posonlyargs + params.args]
        bound = {}
        defaults = dict(zip(names[len(names) - len(params.defaults):], params.defaults))
        for key, taint in positional.items():
            if isinstance(key, int):
                if key < len(names):
                    bound[names[key]] = taint
                elif params.vararg:
                    bound[params.vararg.arg] = join(bound.get(params.vararg.arg, EXACT), taint)
            else:
                bound[key] = taint
        for key, taint in keywords.items():
            if key in names or key in [a.arg for a in params.kwonlyargs]:
                bound[key] = taint
            elif params.kwarg:
                bound[params.kwarg.arg] = join(bound.get(params.kwarg.arg, EXACT), taint)
        for name in names:
            if name in OUTSIDE_NAMES:
                bound[name] = join(bound.get(name, NEUTRAL), Taint(frozenset({OUTSIDE})))
            elif name not in bound:
                bound[name] = self.eval(defaults[name], parent) if name in defaults else NEUTRAL
        key = (function, id(parent), tuple(sorted(bound.items(), key=lambda kv: kv[0])))
        if key in self.cache:
            return self.cache[key]
        if key in self.active:
            return NEUTRAL
        self.active.add(key)
        scope = Scope(parent, function=True)
        for name, taint in bound.items():
            scope.names[name] = taint
        for arg in params.kwonlyargs:
            scope.names.setdefault(arg.arg, NEUTRAL)
        for extra in (params.vararg, params.kwarg):
            if extra is not None:
                scope.names.setdefault(extra.arg, NEUTRAL)
        self._register(function.body, scope)
        self._block(function.body, scope)
        self.active.discard(key)
        result = scope.returns or NEUTRAL
        self.cache[key] = result
        return result

    # -- statements ---------------------------------------------------------------------

    def _block(self, body, scope):
        for node in body:
            self._statement(node, scope)

    def _bind(self, target, taint, scope):
        if isinstance(target, ast.Name):
            scope.bind(target.id, taint)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._bind(element, Taint(taint.labels, taint.exact), scope)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, taint, scope)
        elif isinstance(target, (ast.Subscript, ast.Attribute)):
            self.eval(target, scope)  # a container changed in place takes the value's sources
            root = target
            while isinstance(root, (ast.Subscript, ast.Attribute)):
                root = root.value
            if isinstance(root, ast.Name) and root.id != "self":
                scope.bind(root.id, Taint(taint.labels, False))

    def _returned(self, scope, taint):
        while not scope.is_function and scope.parent is not None:
            scope = scope.parent
        scope.returns = taint if scope.returns is None else join(scope.returns, taint)

    def _statement(self, node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                self.eval(decorator, scope)
            if isinstance(node, ast.ClassDef):
                self._register(node.body, scope)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                self.imports[alias.asname or top] = alias.name if alias.asname else top
            return
        if isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            return
        if isinstance(node, (ast.Pass, ast.Break, ast.Continue, ast.Global, ast.Nonlocal)):
            return
        if isinstance(node, ast.Assign):
            taint = self.eval(node.value, scope)
            for target in node.targets:
                self._bind(target, taint, scope)
        elif isinstance(node, ast.AugAssign):
            taint = self.eval(node.value, scope)
            self._bind(node.target, join(self.eval(node.target, scope), taint), scope)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self._bind(node.target, self.eval(node.value, scope), scope)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind(node.target, self.eval(node.iter, scope), scope)
            for _ in range(2):  # twice: what a later line assigns reaches the next iteration
                self._block(node.body, scope)
            self._block(node.orelse, scope)
        elif isinstance(node, ast.While):
            for _ in range(2):
                self.eval(node.test, scope)
                self._block(node.body, scope)
            self._block(node.orelse, scope)
        elif isinstance(node, ast.If):
            self.eval(node.test, scope)
            self._block(node.body, scope)
            self._block(node.orelse, scope)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                taint = self.eval(item.context_expr, scope)
                if item.optional_vars is not None:
                    self._bind(item.optional_vars, taint, scope)
            self._block(node.body, scope)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            self._block(node.body, scope)
            for handler in node.handlers:
                if handler.type is not None:
                    self.eval(handler.type, scope)
                if handler.name:
                    scope.bind(handler.name, NEUTRAL)
                self._block(handler.body, scope)
            self._block(node.orelse, scope)
            self._block(node.finalbody, scope)
        elif isinstance(node, ast.Return):
            if node.value is not None:
                self._returned(scope, self.eval(node.value, scope))
        elif isinstance(node, ast.Expr):
            self.eval(node.value, scope)
        elif isinstance(node, ast.Assert):
            self.eval(node.test, scope)
            if node.msg is not None:
                self.eval(node.msg, scope)
        else:  # raise, delete, match: their expressions
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.eval(child, scope)
                elif isinstance(child, ast.stmt):
                    self._statement(child, scope)

    # -- expressions --------------------------------------------------------------------

    def eval(self, node, scope):
        method = getattr(self, "_" + type(node).__name__, None)
        if method is not None:
            return method(node, scope)
        children = [self.eval(child, scope) for child in ast.iter_child_nodes(node)
                    if isinstance(child, ast.expr)]
        return join(*children) if children else NEUTRAL

    def _Constant(self, node, scope):
        if isinstance(node.value, (float, complex)):
            return NEUTRAL
        if isinstance(node.value, str) and re.match(r"/[A-Za-z]", node.value):
            return Taint(frozenset({OUTSIDE}), exact=True)  # an absolute path: /proc, /tmp
        return EXACT

    def _Name(self, node, scope):
        taint = scope.lookup(node.id)
        if taint is not None:
            return taint
        if node.id in OUTSIDE_NAMES:
            return Taint(frozenset({OUTSIDE}))
        return NEUTRAL

    def _Attribute(self, node, scope):
        value = self.eval(node.value, scope)
        if node.attr in EXACT_ATTRIBUTES:
            return EXACT
        dotted = _dotted(node)
        if dotted and self._origin(dotted):  # a constant of a library or of the package
            return Taint(value.labels & {OUTSIDE})
        return Taint(value.labels, False)

    def _Subscript(self, node, scope):
        self.eval(node.slice, scope)
        return self.eval(node.value, scope)

    def _BinOp(self, node, scope):
        taint = join(self.eval(node.left, scope), self.eval(node.right, scope))
        if isinstance(node.op, (ast.Div, ast.Pow)):
            taint = Taint(taint.labels, False)
        return taint

    def _UnaryOp(self, node, scope):
        taint = self.eval(node.operand, scope)
        return EXACT if isinstance(node.op, ast.Not) else taint

    def _BoolOp(self, node, scope):
        return join(*(self.eval(value, scope) for value in node.values))

    def _IfExp(self, node, scope):
        self.eval(node.test, scope)
        return join(self.eval(node.body, scope), self.eval(node.orelse, scope))

    def _JoinedStr(self, node, scope):
        return join(EXACT, *(self.eval(value, scope) for value in node.values))

    def _FormattedValue(self, node, scope):
        if node.format_spec is not None:
            self.eval(node.format_spec, scope)
        return self.eval(node.value, scope)

    def _Lambda(self, node, scope):
        inner = Scope(scope)
        for arg in node.args.args:
            inner.names[arg.arg] = NEUTRAL
        self.eval(node.body, inner)
        return NEUTRAL

    def _comprehend(self, node, scope, parts):
        inner = Scope(scope)
        for generator in node.generators:
            self._bind(generator.target, self.eval(generator.iter, inner), inner)
            for condition in generator.ifs:
                self.eval(condition, inner)
        return join(*(self.eval(part, inner) for part in parts))

    def _ListComp(self, node, scope):
        return self._comprehend(node, scope, [node.elt])

    _SetComp = _GeneratorExp = _ListComp

    def _DictComp(self, node, scope):
        return self._comprehend(node, scope, [node.key, node.value])

    def _Dict(self, node, scope):
        parts = [self.eval(v, scope) for v in node.values]
        parts += [self.eval(k, scope) for k in node.keys if k is not None]
        return join(*parts) if parts else EXACT

    def _List(self, node, scope):
        parts = [self.eval(element, scope) for element in node.elts]
        return join(*parts) if parts else EXACT

    _Tuple = _Set = _List

    def _Yield(self, node, scope):  # a fixture's value
        taint = NEUTRAL if node.value is None else self.eval(node.value, scope)
        self._returned(scope, taint)
        return NEUTRAL

    def _Starred(self, node, scope):
        return self.eval(node.value, scope)

    def _NamedExpr(self, node, scope):
        taint = self.eval(node.value, scope)
        self._bind(node.target, taint, scope)
        return taint

    def _Compare(self, node, scope):
        operands = [node.left] + node.comparators
        taints = [self.eval(operand, scope) for operand in operands]
        for op, (i, j) in zip(node.ops, zip(range(len(operands)), range(1, len(operands)))):
            if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                tolerance = any(self._callee(operands[k]) in TOLERANCE_CALLS for k in (i, j))
                self._check(node, taints[i], taints[j],
                            "pytest.approx" if tolerance else "an exact comparison")
        return EXACT

    # -- calls --------------------------------------------------------------------------

    def _origin(self, dotted):
        """The library or package a dotted name comes from ("numpy.testing.assert_equal"),
        or None for a local name."""
        if dotted[0] not in self.imports:
            return None
        return ".".join([self.imports[dotted[0]]] + dotted[1:])

    def _callee(self, node):
        """The dotted name a call calls, through the module's imports, or None."""
        dotted = _dotted(node.func) if isinstance(node, ast.Call) else None
        return dotted and (self._origin(dotted) or ".".join(dotted))

    def _check(self, node, left, right, kind):
        if left.exact or right.exact:
            return
        if not (LOADED in left.labels and COMPUTED in right.labels
                or COMPUTED in left.labels and LOADED in right.labels):
            return
        lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        opted = [self.opted_lines[line] for line in lines if line in self.opted_lines]
        if opted:
            self.used_opt_outs.update(opted)
            return
        self.findings.add((node.lineno, f"{kind} of a computed value with committed data: use "
                                        f"{HELPER} (tests/helpers/committed.py) with its "
                                        "tolerance and why, or `# committed-exact: <reason>`"))

    def _Call(self, node, scope):
        args = [self.eval(arg, scope) for arg in node.args]
        keywords = {kw.arg: self.eval(kw.value, scope) for kw in node.keywords}
        func = node.func
        dotted = _dotted(func)
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        origin = self._origin(dotted) if dotted else None
        if isinstance(func, ast.Name) and origin is None and scope.lookup(name) is None:
            function, defined_in = scope.function(name)
            if function is not None:  # the module's own function, with these arguments
                return self._call(function, defined_in, dict(enumerate(args)),
                                  {k: t for k, t in keywords.items() if k is not None})
        parts = args + list(keywords.values())
        receiver = NEUTRAL
        if isinstance(func, ast.Attribute):
            receiver = self.eval(func.value, scope)
            parts.insert(0, receiver)
        elif not isinstance(func, ast.Name):
            receiver = self.eval(func, scope)
        inputs = join(*parts) if parts else NEUTRAL
        computed = Taint(frozenset({COMPUTED}) | (inputs.labels & {OUTSIDE}))
        qualified = origin or (name if isinstance(func, ast.Name) else None)
        if name == HELPER:
            return EXACT
        for calls, result in ((EQUALITY_CALLS, EXACT), (TOLERANCE_CALLS, inputs)):
            if qualified in calls or (origin is None and name in calls):
                if len(args) >= 2:
                    self._check(node, args[0], args[1], qualified or name)
                return result
        # reading a file: committed, unless it lies outside the repository (written by this run)
        if qualified in LOAD_FUNCTIONS or (origin is None and name in ("read_text", "read_bytes")):
            path = receiver if name in ("read_text", "read_bytes") else inputs
            return computed if OUTSIDE in path.labels else Taint(frozenset({LOADED}))
        if isinstance(func, ast.Name) and origin is None:  # a builtin (or a local callable)
            return EXACT if name in EXACT_BUILTINS else inputs
        if origin is not None:
            top = origin.split(".")[0]
            if top == "tempfile":
                return Taint(frozenset({OUTSIDE}))
            if top == "opd_literate":
                if name in DETERMINISTIC or name in DATA_METHODS:
                    return inputs  # statistics of records; a method of a docstring, a table
                if name in CONFIGURATION:
                    return Taint(inputs.labels - {COMPUTED})
                return computed
            if top in ("numpy", "math") and (
                    name in TRANSCENDENTAL or set(origin.split(".")[1:-1]) & TRANSCENDENTAL):
                return computed
            return inputs if top in TRANSPARENT_MODULES else computed
        # a method of some object
        if name in EXACT_METHODS:
            return EXACT
        if name in CONFIGURATION:
            return Taint(inputs.labels - {COMPUTED})
        if name in DATA_METHODS or receiver.labels - {OUTSIDE}:
            return inputs
        return computed


# A fast first filter: a module that reads no file, or finds none in the repository (through
# ``__file__``, or a path relative to its root), can have no finding; nor one with no opt-out.
READS = re.compile(r"read_text|read_bytes|json\.load|\bload\(|loadtxt|genfromtxt|fromfile|"
                   r"read_csv|\bopen\(")
IN_THE_REPOSITORY = re.compile(r"__file__|[\"'](docs|benchmarks|tests)/")


def findings(source, path="<source>"):
    """The findings of the rule in one module's source, as "path:line: message" lines."""
    if "committed-exact" not in source and not (READS.search(source)
                                                 and IN_THE_REPOSITORY.search(source)):
        return []
    return [f"{path}:{line}: {message}" for line, message in Module(source).run()]


def test_no_test_compares_a_recomputed_float_with_a_committed_file_exactly():
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        problems += findings(path.read_text(), path.relative_to(ROOT))
    assert not problems, "\n".join(problems)


PLANTED = '''
import json
import pathlib

from opd_literate.mismatch.toy import make_ar_toy
from opd_literate.experiment.quantized import toy_token_mismatch

RECORD = pathlib.Path(__file__).parents[2] / "docs/data/experiment/tinylm_mismatch.json"


def test_the_toy_is_the_committed_one():
    record = json.loads(RECORD.read_text())
    kurtosis = toy_token_mismatch(make_ar_toy(mismatch=0.3))["kurtosis"]
    assert kurtosis == record["toy_b"]["ar_toy"]["kurtosis"]
'''


def test_a_planted_exact_comparison_is_flagged_at_its_line():
    found = findings(PLANTED, "planted.py")
    assert found == [f"planted.py:14: an exact comparison of a computed value with committed "
                     f"data: use {HELPER} (tests/helpers/committed.py) with its tolerance and "
                     "why, or `# committed-exact: <reason>`"]


@pytest.mark.parametrize("comparison", [
    "assert round(kurtosis, 3) == round(record['toy_b']['ar_toy']['kurtosis'], 3)",
    "assert f'{kurtosis:.3f}' in RECORD.read_text()",
    "assert record['toy_b']['ar_toy'] == {'kurtosis': kurtosis}",
    "assert kurtosis != record['toy_b']['ar_toy']['kurtosis']",
    "np.testing.assert_array_equal([kurtosis], record['kurtosis'])",
    "assert kurtosis == pytest.approx(record['kurtosis'], rel=1e-9)",
    "np.testing.assert_allclose(record['kurtosis'], kurtosis)",
    "assert float(np.exp(record['eps'])) == record['kl']",  # a kernel applied to committed data
])
def test_other_forms_of_the_comparison_are_flagged(comparison):
    source = PLANTED.replace("import json\n", "import json\nimport numpy as np\nimport pytest\n")
    source = source.replace('    assert kurtosis == record["toy_b"]["ar_toy"]["kurtosis"]\n',
                            f"    {comparison}\n")
    found = findings(source, "planted.py")
    assert len(found) == 1 and found[0].startswith("planted.py:16: "), found


def test_committed_data_is_followed_through_fixtures_parametrize_and_helpers():
    source = PLANTED + '''

@pytest.fixture
def record():
    return json.loads(RECORD.read_text())


def test_through_a_fixture(record):
    assert toy_token_mismatch(make_ar_toy(mismatch=0.3))["kl"] == record["kl"]


@pytest.mark.parametrize("row", json.loads(RECORD.read_text())["rows"])
def test_through_parametrize(row):
    assert make_ar_toy(mismatch=row["eps"])["mismatch"] != row["eps"]


def _kurtosis(eps):
    return toy_token_mismatch(make_ar_toy(mismatch=eps))["kurtosis"]


def test_through_a_helper():
    assert [_kurtosis(0.3)] == [json.loads(RECORD.read_text())["kurtosis"]]
'''
    source = source.replace("import pathlib\n", "import pathlib\n\nimport pytest\n")
    lines = [int(f.split(":")[1]) for f in findings(source)]
    assert [source.splitlines()[n - 1].strip()[:22] for n in lines] == [
        "assert kurtosis == rec", "assert toy_token_misma", "assert make_ar_toy(mis",
        "assert [_kurtosis(0.3)"]


def test_a_committed_file_written_by_the_run_is_computed():
    source = PLANTED.replace("def test_the_toy_is_the_committed_one():",
                             "def test_the_toy_is_the_committed_one(tmp_path):")
    source = source.replace("json.loads(RECORD.read_text())",
                            "json.loads((tmp_path / 'r.json').read_text())")
    assert findings(source) == []  # both sides computed here


@pytest.mark.parametrize("comparison", [
    # the helper
    "assert_matches_committed(kurtosis, record['toy_b']['ar_toy']['kurtosis'], rtol=1e-12, "
    "why='float64 sums')",
    # integers and counts stay exact
    "assert len(record['seeds']) == len(toy_token_mismatch(make_ar_toy(mismatch=0.3)))",
    "assert int(record['prompts']) == make_ar_toy(mismatch=0.3)['T']",
    "assert record['toy_b']['ar_toy'].keys() == {'kurtosis': kurtosis}.keys()",
    # committed against the text of a committed page: nothing recomputed
    "assert f\"{record['toy_b']['ar_toy']['kurtosis']:.3f}\" in (RECORD.parent / 'p.md')"
    ".read_text()",
    # computed against a literal: no committed file involved
    "assert round(kurtosis, 1) == 3.0",
    # a reasoned opt-out
    "assert kurtosis == record['kurtosis']  # committed-exact: planted, to test the opt-out",
])
def test_near_misses_are_not_flagged(comparison):
    source = PLANTED.replace("import pathlib\n", "import pathlib\n\nfrom tests.helpers.committed "
                             "import assert_matches_committed\n")
    source = source.replace('    assert kurtosis == record["toy_b"]["ar_toy"]["kurtosis"]\n',
                            f"    {comparison}\n")
    assert findings(source) == []


def test_an_opt_out_needs_a_reason_and_a_comparison():
    line = '["ar_toy"]["kurtosis"]\n'
    bare = PLANTED.replace(line, line.replace("\n", "  # committed-exact:\n"))
    found = findings(bare)
    assert len(found) == 1 and found[0].startswith("<source>:14: `# committed-exact:` needs its "
                                                   "reason"), found
    idle = PLANTED.replace("import json\n", "import json  # committed-exact: nothing to silence\n")
    found = findings(idle)
    assert len(found) == 2 and found[0].startswith("<source>:2: ") and "remove it" in found[0]
    assert found[1].startswith("<source>:14: an exact comparison")
    above = PLANTED.replace("    assert kurtosis ==", "    # committed-exact: a reason, above\n"
                                                     "    assert kurtosis ==")
    assert findings(above) == []  # a comment alone on the line above the comparison
