r"""The labs: which modules students complete, and the student's folder rendered from the library.

A lab folder is self-contained: the student module(s) with every solution region replaced by
its hint and a stub ([strip_solutions][opd_literate.course.markers.strip_solutions]; the
docstrings and derivations are kept), the given code whole, the lab's tests (importing from the
folder), a ``pytest.ini``, a ``conftest.py`` (for ``pytest --task N``), a ``lab.json`` naming
the tasks and a README for students ([render_lab][opd_literate.course.labs.render_lab]); with
``format="notebook"``, the student module is a Jupyter notebook instead
([render_notebook][opd_literate.course.labs.render_notebook]).

This module says what a lab is; the grader ([grade][opd_literate.course.grade]) and the
platforms' formats ([gradescope][opd_literate.course.gradescope], nbgrader) are built on it,
and [handouts][opd_literate.course.handouts] writes any of them to a folder. It imports
neither of them.

The lab modules are the package's own source files (``source_of``); the lab tests are the
repository's ``tests/`` files in a source checkout and, in an installed wheel, the same files
shipped as package data under ``opd_literate/course/lab_tests/`` (``lab_file``). So an
instructor can ``pip install`` the package and write labs without a checkout.
"""

from __future__ import annotations

import ast
import json
import math
import pathlib
import re
import textwrap
from dataclasses import dataclass, field

from .markers import MarkerError, strip_solutions

__all__ = ["LABS", "MARKER", "GRADE_TIMEOUT", "STUDENT_FORMATS", "Lab", "render_lab",
           "render_notebook", "lab_file", "lab_points", "notebook_modules"]

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
REPO = PACKAGE.parent
GRADE_TIMEOUT = 60.0
"""Seconds each task's tests may run when graded (the student's README states it; the grader's
default ``timeout``)."""
LAB_TESTS = PACKAGE / "course" / "lab_tests"
"""Where a wheel installs the lab tests (``tests/<chapter>/<file>`` of the repository becomes
``lab_tests/<chapter>/<file>``: pyproject.toml maps the package ``opd_literate.course.lab_tests``
to the repository's ``tests/`` and ships only the lab test files from it)."""

# The package's relative imports become flat imports inside the lab folder.
RELATIVE_IMPORT = re.compile(r"^from \.+(?P<module>\w+) import ", re.M)
PACKAGE_IMPORT = re.compile(r"^from opd_literate(?:\.\w+)*?(?:\.(?P<module>\w+))? import ", re.M)


@dataclass(frozen=True)
class Lab:
    """A lab: the modules students complete, the given modules, the tests, the tasks.

    ``tests`` go into the student's folder and are run by the grader; ``hidden_tests`` are run
    only by the Gradescope autograder (``--format gradescope``) and never written into the
    student's copy. ``points`` gives each task number its points (Gradescope, nbgrader, the
    README); [lab_points][opd_literate.course.labs.lab_points] checks them against the tasks
    of the source.
    """

    name: str
    title: str
    student_modules: tuple
    given_modules: tuple
    tests: tuple
    summary: str
    points: dict = field(default_factory=dict)
    hidden_tests: tuple = ()


LABS = {
    "opd": Lab(
        name="opd",
        title="On-policy distillation (OPD)",
        student_modules=("opd",),
        given_modules=("_numerics",),
        tests=("tests/opd/test_lab_opd.py",),
        summary="Implement the three OPD losses: the per-token reward (Task 1), the "
                "REINFORCE loss with discount 0 (Task 2) and the full-vocabulary reverse KL "
                "(Task 3).",
        points={1: 3, 2: 3, 3: 4},
        hidden_tests=("tests/opd/test_lab_opd_hidden.py",),
    ),
    "mismatch": Lab(
        name="mismatch",
        title="Training-inference mismatch: rollout-correction estimators",
        student_modules=("estimators",),
        given_modules=("toy", "_numerics"),
        tests=("tests/mismatch/test_lab_estimators.py",),
        summary="Implement the weights of eight gradient estimators for a sampler that is not "
                "the trainer, and check their exact bias on the enumerable toy.",
        points={n: 1 for n in range(1, 9)},
    ),
    "engine": Lab(
        name="engine",
        title="The mismatch in practice: an inference engine's top-p and kept mass",
        student_modules=("engine",),
        given_modules=("toy", "_numerics"),
        tests=("tests/mismatch/test_lab_engine.py",),
        summary="Implement the exact nucleus (Task 1), the top-p cut of vLLM, transformers and "
                "SGLang as each computes it in float32 (Task 2), and the log of the kept mass "
                "that truncation-aware importance sampling needs (Task 3).",
        points={1: 3, 2: 4, 3: 3},
    ),
}


def flatten_imports(text: str) -> str:
    text = RELATIVE_IMPORT.sub(lambda m: f"from {m.group('module')} import ", text)
    text = re.sub(r"^from opd_literate import (\w+) as (\w+)$", r"import \1 as \2", text,
                  flags=re.M)
    return PACKAGE_IMPORT.sub(lambda m: f"from {m.group('module')} import ", text)


def source_of(module: str) -> pathlib.Path:
    """The library file of a lab module named as the student's file (``estimators``), wherever
    its chapter package keeps it (``opd_literate/mismatch/estimators.py``)."""
    found = sorted(PACKAGE.rglob(f"{module}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"{module}.py: {len(found)} files of that name under {PACKAGE} "
                                "(the handout needs a source checkout, pip install -e ., with "
                                "one file a lab module)")
    return found[0]


def read_source(path: pathlib.Path) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: this installation of opd_literate lacks a "
                                "file the handout needs (reinstall the wheel)")
    return path.read_text()


def lab_file(relative: str) -> pathlib.Path:
    """The file of a lab test named as in the repository (``tests/opd/test_lab_opd.py``): the
    copy installed as package data when there is one (a wheel), else the checkout's file."""
    parts = pathlib.PurePosixPath(relative).parts
    if len(parts) < 2 or parts[0] != "tests" or ".." in parts:
        raise ValueError(f"lab test {relative!r}: expected a path under tests/")
    installed = LAB_TESTS.joinpath(*parts[1:])
    if installed.is_file():
        return installed
    checkout = REPO.joinpath(*parts)
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(f"lab test {relative}: neither {installed} (package data of a "
                            f"wheel) nor {checkout} (a source checkout) exists")


def lab_points(lab: Lab) -> dict[int, float]:
    """The points of each task of ``lab``, ``{number: points}`` sorted by task; ValueError when
    they do not name exactly the tasks of the source, or a value is not a positive number."""
    numbers = sorted({n for n, _, _ in tasks_of(lab)})
    points = dict(lab.points)
    if sorted(points) != numbers:
        raise ValueError(f"lab {lab.name!r}: points are given for tasks {sorted(points)}, "
                         f"expected exactly the tasks of the source, {numbers}")
    for number, value in points.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise ValueError(f"lab {lab.name!r}: Task {number} has points {value!r}, expected "
                             "a positive finite number")
    return {n: points[n] for n in numbers}


def joint_tests(lab: Lab) -> list[tuple[str, tuple[int, ...]]]:
    """The tests (functions or classes) of ``lab`` marked with more than one task, with those
    tasks, ``[(name, tasks)]`` in file order: what ``pytest --task N`` alone skips."""
    found = []
    for test in lab.tests:
        for node in ast.parse(read_source(lab_file(test))).body:
            for decorator in getattr(node, "decorator_list", []):
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                        and decorator.func.attr == "task" and len(decorator.args) > 1):
                    found.append((node.name, tuple(a.value for a in decorator.args)))
    return found


def _and(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _student_readme(lab: Lab, tasks: list[tuple[int, str, str]]) -> str:
    points = lab_points(lab)
    rows = "\n".join(  # a task of two functions: its points on its first row
        f"| {n} | `{name}` | `{module}.py` | "
        f"{'(with the row above)' if n in [t[0] for t in tasks[:i]] else f'{points[n]:g}'} |"
        for i, (n, name, module) in enumerate(tasks))
    joint = joint_tests(lab)
    if joint:
        groups = {}
        for name, numbers in joint:
            groups.setdefault(numbers, []).append(f"`{name}`")
        listed = "; ".join(f"{_and(names)} (Tasks {_and(numbers)})"
                           for numbers, names in groups.items())
        example = max(groups, key=len)
        options = " ".join(f"--task {n}" for n in example)
        task_option = (
            f"`--task N` alone skips the tests that also check another task: in this lab "
            f"{listed}. Each skip names the options that run it (`python -m pytest {options}`, "
            "once those tasks are done). The grader runs every test of a task, these "
            "included, with its own reference versions of the other tasks, so a task's grade "
            "counts more tests than `--task N` runs here.")
    else:
        task_option = ("Every test of this lab checks a single task, so `--task N` runs all "
                       "the tests the grader runs for Task N.")
    return f"""# Lab: {lab.title}

{textwrap.fill(lab.summary, width=96)}

Each task is a function whose body is a `TODO` and a `raise NotImplementedError`. Its
docstring holds the derivation, the shapes and a worked example. Replace the two lines with
your code; do not change the signature. You may add helper functions.

| task | function | file | points |
| --- | --- | --- | ---: |
{rows}

{textwrap.fill(f"{sum(points.values()):g} points in all. On Gradescope a task's points are "
                "shared among its tests; a notebook graded by nbgrader earns them when the "
                "task's check cell runs without an error, that is when all the tests it runs "
                "pass.", width=96)}

Check your work (from this folder; needs numpy, torch and pytest):

```bash
python -m pytest            # every test; a task's tests fail until it is implemented
python -m pytest --task 1   # only the tests of Task 1
```

{textwrap.fill(task_option, width=96)}

Your instructor grades the folder with `python -m opd_literate.course grade <this folder>`,
with the instructor's own copy of the tests (changes to the tests, a `conftest.py` or a
`pytest.ini` here do not count) and possibly more tests than this folder holds, one task at a
time: where a test of your task also calls another task's function, the grader uses the
reference version of that one, so each task is graded on its own. Each task's tests may run
for {GRADE_TIMEOUT:g} seconds (the grader's default time limit; your instructor may set another).
It reports each task as passed, not implemented, blocked (its tests fail only on
another task's stub), failed, timed out (its tests ran past the time limit) or error (your
module cannot be imported: the message names the file and line).
"""


_CONFTEST = '''"""Lab test options: ``python -m pytest --task 2`` runs only the tests of Task 2."""


def pytest_addoption(parser):
    parser.addoption("--task", type=int, action="append", default=[],
                     help="run only the tests of this task (repeatable)")


def pytest_collection_modifyitems(config, items):
    wanted = set(config.getoption("--task"))
    if not wanted:
        return
    selected, deselected = [], []
    for item in items:
        tasks = {n for marker in item.iter_markers("task") for n in marker.args}
        (selected if tasks & wanted else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = selected


def pytest_runtest_setup(item):
    """A test that checks several tasks together runs when all of them are selected."""
    wanted = set(item.config.getoption("--task"))
    tasks = {n for marker in item.iter_markers("task") for n in marker.args}
    missing = sorted(tasks - wanted) if wanted else []
    if missing:
        import pytest

        options = " ".join(f"--task {n}" for n in sorted(tasks))
        pytest.skip(f"it also checks Task {', '.join(map(str, missing))}: "
                    f"python -m pytest {options}")
'''

_PYTEST_INI = """[pytest]
testpaths = tests
pythonpath = .
addopts = -p no:cacheprovider
markers =
    task(*numbers): the lab tasks a test checks
"""


MARKER = ".opd-handout"
"""The file that marks a folder as written by this tool: the files it wrote and their SHA-256."""



_NOTEBOOK_CHECK = """import sys
import types

import pytest


def check(task):
    \"\"\"Run the lab's tests of ``task`` on the functions defined in this notebook.\"\"\"
    module = types.ModuleType({module!r})
    module.__dict__.update({{k: v for k, v in globals().items() if not k.startswith("__")}})
    sys.modules[{module!r}] = module
    for name in [n for n in sys.modules if n.startswith("test_")]:
        del sys.modules[name]  # the tests import this notebook's functions afresh
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                        "--task", str(task), "tests"])  # (that plugin is slow in a kernel)
    assert code == 0, f"Task {{task}}: some tests fail (see above)\""""


NBGRADER_SCHEMA = 3
"""The version of nbgrader's cell metadata the notebooks carry (nbgrader 0.9's
``nbgraderformat/v3.json``: ``grade``, ``grade_id``, ``locked``, ``points``, ``solution``,
``schema_version``)."""

# The cells of the notebook's own checking machinery: never part of the student module.
_CHECK_TAGS = ("setup", "check:")
# What an untagged cell a student added contributes to the module: its definitions, not its
# scratch work (calls, prints, loops run only in the notebook).
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                ast.Assign, ast.AnnAssign)


def _cell(kind: str, source: str, tags=(), nbgrader=None) -> dict:
    metadata = {}
    if tags:
        metadata["tags"] = list(tags)
    if nbgrader is not None:
        metadata["nbgrader"] = nbgrader
    cell = {"cell_type": kind, "metadata": metadata, "source": source.strip("\n")}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _nbgrader(grade_id: str, *, grade=False, solution=False, locked=False, points=None) -> dict:
    """nbgrader's metadata of one cell: a solution cell (the student writes it), a locked one
    (restored from the instructor's copy at autograde) or a graded test cell with its points."""
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked,
            "schema_version": NBGRADER_SCHEMA, "solution": solution}
    if grade:
        meta["points"] = points
    return meta


def _statements(text: str) -> list[tuple[ast.stmt, str]]:
    """The top-level statements of ``text`` with their source lines (decorators included)."""
    lines = text.split("\n")
    found = []
    for node in ast.parse(text).body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        end = node.end_lineno
        # A body's trailing comments (an "### END SOLUTION" line) belong to it, not to the
        # next statement: the AST ends at the last statement.
        for index in range(end, len(lines)):
            if lines[index][:1].isspace() and lines[index].lstrip().startswith("#"):
                end = index + 1
            elif lines[index].strip():
                break
        found.append((node, "\n".join(lines[start:end]).strip("\n")))
    return found


def render_notebook(lab: Lab, keep=frozenset(), solutions: bool = False) -> dict:
    r"""The lab as a Jupyter notebook (nbformat 4.5) that nbgrader also accepts.

    The module's docstring is its introduction; the student module is in code cells tagged
    ``module:<name>`` (the grader joins them back into the module), each task's function after
    a Markdown cell with its number, hint and docstring; then one cell per task, ``check(N)``,
    that runs that task's tests. Every code cell carries nbgrader's metadata (schema 3): a task's
    function is a *solution* cell, the given code and the checking helper are *locked*, and each
    ``check(N)`` is a *graded* test cell worth the task's points
    ([lab_points][opd_literate.course.labs.lab_points]).

    ``keep``: tasks left solved (tests). ``solutions=True``: nbgrader's *source* version, every
    task solved between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines under a
    ``# TODO (Task N): hint`` line, for ``nbgrader generate_assignment`` to strip.
    """
    from .markers import nbgrader_solutions

    if len(lab.student_modules) != 1:
        raise ValueError(f"lab {lab.name!r}: a notebook holds one student module")
    module = lab.student_modules[0]
    source = source_of(module)
    original = read_source(source)
    text, tasks = strip_solutions(original, str(source), keep=keep)
    if solutions:
        text = nbgrader_solutions(original, str(source))
    text = flatten_imports(text)
    points = lab_points(lab)
    task_of = {name: n for n, name in tasks}
    hints = dict(re.findall(r"### BEGIN SOLUTION Task (\d+): (.*)", original))
    tag = [f"module:{module}"]
    cells = [_cell("markdown", f"# Lab: {lab.title}\n\n{lab.summary}\n\nEach task is a "
                   "function whose body is a `TODO` and a `raise NotImplementedError`: replace "
                   "the two lines with your code, run the cells from the top, then the task's "
                   "check cell at the end. You may add cells with helper functions: their "
                   "definitions are graded with the module.")]
    statements = _statements(text)
    if statements and isinstance(statements[0][0], ast.Expr) and isinstance(
            statements[0][0].value, ast.Constant):
        cells.append(_cell("markdown", statements[0][0].value.value))
        statements = statements[1:]
    pending = []

    def flush():
        if pending:
            number = sum(c["metadata"].get("nbgrader", {}).get("grade_id", "").startswith(
                "given_code") for c in cells) + 1
            cells.append(_cell("code", "\n".join(pending), tag,
                               _nbgrader(f"given_code_{number}", locked=True)))
            pending.clear()

    for node, chunk in statements:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            flush()
            if node.name in task_of:
                n = task_of[node.name]
                doc = ast.get_docstring(node) or ""
                cells.append(_cell("markdown", f"## Task {n}: `{node.name}`\n\n*{hints[str(n)]}*"
                                               f"\n\n{doc}"))
                meta = _nbgrader(f"task{n}_{node.name}", solution=True)
            else:
                meta = _nbgrader(f"given_{node.name}", locked=True)
            cells.append(_cell("code", chunk, tag, meta))
        else:
            pending += [chunk, ""]
    flush()
    cells.append(_cell("markdown", "## Check your work\n\nEach cell runs the tests of one task "
                                   "on the functions above (the lab's `tests/` folder)."))
    cells.append(_cell("code", _NOTEBOOK_CHECK.format(module=module), ["setup"],
                       _nbgrader("check_setup", locked=True)))
    for n in sorted({n for n, _ in tasks}):
        cells.append(_cell("code", f"check({n})", [f"check:{n}"],
                           _nbgrader(f"check_task{n}", grade=True, locked=True,
                                     points=points[n])))
    for index, cell in enumerate(cells):
        cell["id"] = f"cell-{index}"  # nbformat 4.5 ids, stable: the same source, same bytes
    return {"cells": cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def notebook_modules(notebook: dict, lab: Lab) -> dict[str, str]:
    """The student module of a notebook lab as Python source, ``{module: text}``.

    The code cells tagged ``module:<name>`` are taken whole, and of every other code cell (a
    cell the student added, which Jupyter leaves untagged) its top-level definitions: ``def``,
    ``class``, ``import`` and assignments, so a helper function written in a new cell is graded
    with the module. Its other statements (calls, prints, loops: scratch work) run only in the
    notebook, and a cell that is not plain Python (IPython ``%`` or ``!`` lines) is left out
    whole, with a comment saying so. The notebook's checking cells (tagged ``setup`` and
    ``check:N``) are never part of the module. Cells keep the notebook's order.
    """
    if len(lab.student_modules) != 1:
        raise ValueError(f"lab {lab.name!r}: a notebook holds one student module")
    try:
        cells = [c for c in notebook["cells"] if c.get("cell_type") == "code"]
    except (KeyError, TypeError, AttributeError):
        raise ValueError("not a Jupyter notebook (no list of cells)") from None
    parts = {}
    for index, cell in enumerate(cells, start=1):
        tags = cell.get("metadata", {}).get("tags", [])
        source = cell.get("source", "")
        source = ("".join(source) if isinstance(source, list) else str(source)).rstrip("\n")
        modules = [t.split(":", 1)[1] for t in tags if t.startswith("module:")]
        if modules:
            for name in modules:
                parts.setdefault(name, []).append(source)
            continue
        if any(t.startswith(_CHECK_TAGS) for t in tags) or not source.strip():
            continue
        try:
            kept = [chunk for node, chunk in _statements(source) if isinstance(node, _DEFINITIONS)]
        except SyntaxError:
            kept = [f"# (code cell {index} left out: it is not plain Python)"]
        if kept:
            parts.setdefault(lab.student_modules[0], []).append("\n\n".join(kept))
    return {name: "\n\n\n".join(chunks) + "\n" for name, chunks in parts.items()
            if name in lab.student_modules}


def tasks_of(lab: Lab) -> list[tuple[int, str, str]]:
    """The tasks of a lab, ``[(number, function, module)]``, sorted, from the library source."""
    found = []
    for module in lab.student_modules:
        source = source_of(module)
        _, tasks = strip_solutions(read_source(source), str(source))
        found += [(n, name, module) for n, name in tasks]
    return sorted(found)


STUDENT_FORMATS = ("files", "notebook")
"""The forms of a student's folder: the student module(s) as Python files, or as one Jupyter
notebook ``<lab>.ipynb``."""


def render_lab(lab: Lab, format: str = "files") -> dict[str, str]:
    """The files of one lab's student folder, ``{relative path: text}``, in the order they are
    written; ``format`` is one of [STUDENT_FORMATS][opd_literate.course.labs.STUDENT_FORMATS]
    (the platforms' forms:
    [handouts.render_handout][opd_literate.course.handouts.render_handout])."""
    if format not in STUDENT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(STUDENT_FORMATS)}, got "
                         f"{format!r} (Gradescope's and nbgrader's folders: "
                         "handouts.render_handout)")
    files, all_tasks = {}, []
    for module in lab.student_modules:
        source = source_of(module)
        student, tasks = strip_solutions(read_source(source), str(source))
        if not tasks:
            raise MarkerError(f"{source}: a student module without any solution region")
        files[f"{module}.py"] = flatten_imports(student)
        all_tasks += [(n, name, module) for n, name in tasks]
    for module in lab.given_modules:
        source = source_of(module)
        given, tasks = strip_solutions(read_source(source), str(source))
        if tasks:
            raise MarkerError(f"{source}: given code must not hold solution regions")
        files[f"{module}.py"] = flatten_imports(given)
    for test in lab.tests:
        files[f"tests/{pathlib.PurePosixPath(test).name}"] = flatten_imports(
            read_source(lab_file(test)))
    files["pytest.ini"] = _PYTEST_INI
    files["conftest.py"] = _CONFTEST
    all_tasks.sort()
    files["README.md"] = _student_readme(lab, all_tasks)
    functions = {}
    for n, name, _ in all_tasks:
        functions.setdefault(str(n), []).append(name)
    manifest = {"lab": lab.name, "title": lab.title, "tasks": functions}
    if format == "notebook":
        for module in lab.student_modules:
            del files[f"{module}.py"]
        files[f"{lab.name}.ipynb"] = json.dumps(render_notebook(lab), indent=1) + "\n"
        files["README.md"] = files["README.md"].replace(
            "Replace the two lines with\nyour code", f"In `{lab.name}.ipynb`, replace the two "
            "lines with\nyour code").replace("| `" + f"{lab.student_modules[0]}.py" + "` |",
                                             f"| `{lab.name}.ipynb` |")
        manifest["format"] = "notebook"
    files["lab.json"] = json.dumps(manifest, indent=1) + "\n"
    return files
