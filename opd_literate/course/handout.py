r"""Lab handouts and a grader, generated from the library itself (one source for both).

The library's modules mark each lab task's solution with comment lines, in the manner of
nbgrader:

    ### BEGIN SOLUTION Task 1: teacher_logp - student_logp, detached; exactly 0 where mask is 0
    log_ratio = teacher_logp.detach() - student_logp.detach()
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ### END SOLUTION

Because the markers are comments, the library, its doctests and its tests run unchanged. The
handout replaces every marked region with its hint and a stub:

    # TODO (Task 1): teacher_logp - student_logp, detached; exactly 0 where mask is 0
    raise NotImplementedError("Task 1: reverse_kl_rewards")

and writes a self-contained lab folder: the student module(s) (docstrings and derivations kept),
the given code whole, the lab's tests (importing from the folder), a ``pytest.ini``, a
``conftest.py`` (for ``pytest --task N``), a ``lab.json`` naming the tasks and a README for
students; with ``--format notebook``, the student module is a Jupyter notebook instead.
``grade`` runs the instructor's copy of the tests on a sandboxed copy of a student's folder, one
task at a time, and reports each task as passed, not implemented, blocked, failed, timed out,
error, or without tests.

Usage:

    python -m opd_literate.course OUTDIR --lab opd|mismatch|all [--format notebook] [--force]
    python -m opd_literate.course grade LABDIR [--json PATH] [--timeout SECONDS]

``OUTDIR`` receives a ``.opd-handout`` marker that lists the files written and their SHA-256;
``--force`` replaces only such a folder, deletes only those files (refusing if one was changed
since) and keeps every other file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

__all__ = ["LABS", "MARKER", "FORMATS", "STATUSES", "GRADE_TIMEOUT", "Lab", "MarkerError",
           "strip_solutions", "write_lab", "render_notebook", "grade", "format_grade", "main"]

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
REPO = PACKAGE.parent

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?P<rest>.*)$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
TASK = re.compile(r"^\s*Task\s+(?P<task>\d+)\s*:\s*(?P<hint>\S.*)$")
DEF = re.compile(r"^\s*def\s+(?P<name>\w+)\s*\(")
# The package's relative imports become flat imports inside the lab folder.
RELATIVE_IMPORT = re.compile(r"^from \.+(?P<module>\w+) import ", re.M)
PACKAGE_IMPORT = re.compile(r"^from opd_literate(?:\.\w+)*?(?:\.(?P<module>\w+))? import ", re.M)


class MarkerError(ValueError):
    """Unbalanced, nested or malformed solution markers; the message names file and line."""


@dataclass(frozen=True)
class Lab:
    """A lab: the modules students complete, the given modules, the tests, the tasks."""

    name: str
    title: str
    student_modules: tuple
    given_modules: tuple
    tests: tuple
    summary: str


LABS = {
    "opd": Lab(
        name="opd",
        title="On-policy distillation (OPD)",
        student_modules=("opd",),
        given_modules=("_numerics",),
        tests=("tests/test_opd.py",),
        summary="Implement the three OPD losses: the per-token reward (Task 1), the "
                "REINFORCE loss with discount 0 (Task 2) and the full-vocabulary reverse KL "
                "(Task 3).",
    ),
    "mismatch": Lab(
        name="mismatch",
        title="Training-inference mismatch: rollout-correction estimators",
        student_modules=("estimators",),
        given_modules=("toy", "_numerics"),
        tests=("tests/test_estimators.py",),
        summary="Implement the weights of eight gradient estimators for a sampler that is not "
                "the trainer, and check their exact bias on the enumerable toy.",
    ),
}


def strip_solutions(text: str, filename: str = "<string>",
                    keep=frozenset()) -> tuple[str, list[tuple[int, str]]]:
    """Replace every solution region of ``text`` by its TODO hint and a stub.

    Returns the student text and the tasks found, ``[(number, function name)]``. The regions of
    the task numbers in ``keep`` stay as they are (only their marker lines go): a partial
    solution, as a student who has done those tasks would have it.

    Raises
    ------
    MarkerError
        For a BEGIN without END, an END without BEGIN, nested regions, or a BEGIN without
        ``Task N: hint``; the message names ``filename`` and the line.

    Examples
    --------
    >>> source = '''def f(x):
    ...     ### BEGIN SOLUTION Task 7: double it
    ...     return 2 * x
    ...     ### END SOLUTION
    ... '''
    >>> student, tasks = strip_solutions(source)
    >>> print(student)
    def f(x):
        # TODO (Task 7): double it
        raise NotImplementedError("Task 7: f")
    <BLANKLINE>
    >>> tasks
    [(7, 'f')]
    """
    out, tasks = [], []
    open_at = None  # (line number, indent, task, hint, function)
    function = None
    for number, line in enumerate(text.split("\n"), start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if open_at is None:
            match = DEF.match(line)
            if match:
                function = match.group("name")
        if begin:
            if open_at is not None:
                raise MarkerError(f"{filename}:{number}: nested BEGIN SOLUTION (the region "
                                  f"opened at line {open_at[0]} is not closed)")
            task = TASK.match(begin.group("rest"))
            if task is None:
                raise MarkerError(f"{filename}:{number}: BEGIN SOLUTION needs 'Task N: hint'")
            open_at = (number, begin.group("indent"), int(task.group("task")),
                       task.group("hint").strip(), function)
            continue
        if end:
            if open_at is None:
                raise MarkerError(f"{filename}:{number}: END SOLUTION without BEGIN SOLUTION")
            _, indent, task_number, hint, name = open_at
            if task_number not in keep:
                out.append(f"{indent}# TODO (Task {task_number}): {hint}")
                out.append(f'{indent}raise NotImplementedError("Task {task_number}: {name}")')
            tasks.append((task_number, name))
            open_at = None
            continue
        if open_at is None or open_at[2] in keep:
            out.append(line)
    if open_at is not None:
        raise MarkerError(f"{filename}:{open_at[0]}: BEGIN SOLUTION is never closed")
    return "\n".join(out), tasks


def solution_lines(text: str) -> list[str]:
    """The code lines inside solution regions (stripped, without blank lines and comments)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if BEGIN.match(line):
            inside = True
        elif END.match(line):
            inside = False
        elif inside and line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def _flatten_imports(text: str) -> str:
    text = RELATIVE_IMPORT.sub(lambda m: f"from {m.group('module')} import ", text)
    text = re.sub(r"^from opd_literate import (\w+) as (\w+)$", r"import \1 as \2", text,
                  flags=re.M)
    return PACKAGE_IMPORT.sub(lambda m: f"from {m.group('module')} import ", text)


def _source(module: str) -> pathlib.Path:
    """The library file of a lab module named as the student's file (``estimators``), wherever
    its chapter package keeps it (``opd_literate/mismatch/estimators.py``)."""
    found = sorted(PACKAGE.rglob(f"{module}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"{module}.py: {len(found)} files of that name under {PACKAGE} "
                                "(the handout needs a source checkout, pip install -e ., with "
                                "one file a lab module)")
    return found[0]


def _read(path: pathlib.Path) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the handout needs a source checkout "
                                "(pip install -e .)")
    return path.read_text()


def _student_readme(lab: Lab, tasks: list[tuple[int, str]]) -> str:
    rows = "\n".join(f"| {n} | `{name}` | `{module}.py` |" for n, name, module in tasks)
    return f"""# Lab: {lab.title}

{textwrap.fill(lab.summary, width=96)}

Each task is a function whose body is a `TODO` and a `raise NotImplementedError`. Its
docstring holds the derivation, the shapes and a worked example. Replace the two lines with
your code; do not change the signature.

| task | function | file |
| --- | --- | --- |
{rows}

Check your work (from this folder; needs numpy, torch and pytest):

```bash
python -m pytest            # every test; a task's tests fail until it is implemented
python -m pytest --task 1   # only the tests of Task 1 (a test that also checks another
                            # task is skipped, and says which --task options run it)
```

Your instructor grades the folder with `python -m opd_literate.course grade <this folder>`,
with the instructor's own copy of the tests (changes to the tests, a `conftest.py` or a
`pytest.ini` here do not count), one task at a time: where a test of your task also calls
another task's function, the grader uses the reference version of that one, so each task is
graded on its own. It reports each task as passed, not implemented, blocked (its tests fail
only on another task's stub), failed, timed out (its tests ran past the time limit) or error
(your module cannot be imported: the message names the file and line).
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


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written_files(out_dir: pathlib.Path) -> dict:
    """The files the marker of ``out_dir`` lists, ``{relative path: sha256}``; ValueError when
    the folder has no marker or it is not one this tool writes."""
    marker = out_dir / MARKER
    refuse = (f"OUTDIR {str(out_dir)!r} was not written by opd-handout (no valid {MARKER} "
              "marker); --force replaces only a folder this tool wrote")
    if marker.is_symlink() or not marker.is_file():
        raise ValueError(refuse)
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        assert manifest["tool"] == "opd-handout" and isinstance(files, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ValueError(refuse) from None
    for name in files:
        relative = pathlib.PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(refuse)
    return files


def _replaceable(out_dir: pathlib.Path) -> dict:
    """What ``--force`` may delete in ``out_dir``: the files its marker lists, when every one of
    them is still as this tool wrote it (or gone). Raises ValueError, deleting nothing,
    otherwise: a changed file holds someone else's work."""
    if out_dir.is_symlink():
        raise ValueError(f"OUTDIR {str(out_dir)!r} is a symbolic link (to "
                         f"{os.readlink(out_dir)!r}); --force replaces only a real folder")
    files = _written_files(out_dir)
    for name, digest in sorted(files.items()):
        path = out_dir / name
        above = [p for p in pathlib.PurePosixPath(name).parents if p.parts]
        if any((out_dir / p).is_symlink() for p in above):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: a folder above {name} is a symbolic "
                             "link; --force replaces only real folders")
        if path.is_symlink() or (path.exists() and (not path.is_file()
                                                     or _sha256(path) != digest)):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: {name} was changed since opd-handout "
                             "wrote it; move it away first (--force deletes only unchanged "
                             "files it wrote)")
    return files


def _remove(out_dir: pathlib.Path, files: dict) -> None:
    """Delete ``files`` and the marker, then the folders they leave empty (nothing else)."""
    for name in sorted(files):
        (out_dir / name).unlink(missing_ok=True)
    (out_dir / MARKER).unlink()
    folders = {p for name in files for p in pathlib.PurePosixPath(name).parents if p.parts}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        path = out_dir / folder
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def write_lab(lab_name: str, out_dir, force: bool = False,
              format: str = "files") -> list[pathlib.Path]:
    """Write the lab folder(s) for ``lab_name`` ("opd", "mismatch" or "all") under ``out_dir``.

    ``all`` writes one sub-folder per lab. ``out_dir`` gets a
    [MARKER][opd_literate.course.handout.MARKER] file listing every file written, with its SHA-256.
    An existing non-empty ``out_dir`` is refused unless ``force``. ``force`` replaces only a real
    folder (not a symbolic link) that holds this marker, and deletes only the files the marker
    lists; it refuses, before deleting anything, when one of them was changed since, or when a file
    it would write exists and is not one of them. Every other file stays. ``format="notebook"``
    writes each lab's student module as a Jupyter notebook ``<lab>.ipynb`` instead (see
    [opd_literate.course.handout.render_notebook][]). Returns the lab folders written.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose from {', '.join(FORMATS)}")
    if lab_name != "all" and lab_name not in LABS:
        raise ValueError(f"unknown lab {lab_name!r}; choose from {', '.join([*LABS, 'all'])}")
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUTDIR {str(out_dir)!r} exists and is not a folder")
    names = list(LABS) if lab_name == "all" else [lab_name]
    files = {(f"{name}/" if lab_name == "all" else "") + relative: text
             for name in names for relative, text in _render(LABS[name], format).items()}
    replaceable = {}
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ValueError(f"OUTDIR {str(out_dir)!r} exists and is not empty; "
                             "use --force to replace a folder this tool wrote")
        replaceable = _replaceable(out_dir)
    for relative in files:  # a file that --force keeps must not be overwritten either
        above = [p for p in pathlib.PurePosixPath(relative).parents if p.parts]
        taken = relative not in replaceable and os.path.lexists(out_dir / relative)
        if taken or any((out_dir / p).is_symlink() or (out_dir / p).is_file() for p in above):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: {relative} (or a folder above it) "
                             "exists and was not written by opd-handout; move it away first")
    if replaceable:
        _remove(out_dir, replaceable)
    digests = {relative: hashlib.sha256(text.encode()).hexdigest()
               for relative, text in sorted(files.items())}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for relative, text in files.items():
            path = out_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode())
        (out_dir / MARKER).write_bytes(json.dumps({"tool": "opd-handout", "lab": lab_name,
                                                  "files": digests}, indent=1).encode() + b"\n")
    except OSError as error:
        raise ValueError(f"cannot write OUTDIR {str(out_dir)!r}: "
                         f"{error.strerror or error}") from error
    return [out_dir / name for name in names] if lab_name == "all" else [out_dir]


FORMATS = ("files", "notebook")
"""The ways to write a lab: Python files, or the student module as a Jupyter notebook."""

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


def _cell(kind: str, source: str, tags=()) -> dict:
    cell = {"cell_type": kind, "metadata": {"tags": list(tags)} if tags else {},
            "source": source.strip("\n")}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def render_notebook(lab: Lab, keep=frozenset()) -> dict:
    """The lab as a Jupyter notebook (nbformat 4): the module's docstring as its introduction;
    the student module in code cells tagged ``module:<name>`` (the grader joins them back into
    the module), each task's function after a Markdown cell with its number, hint and docstring;
    then one cell per task that runs that task's tests. ``keep``: tasks left solved (tests)."""
    import ast

    if len(lab.student_modules) != 1:
        raise ValueError(f"lab {lab.name!r}: a notebook holds one student module")
    module = lab.student_modules[0]
    source = _source(module)
    text, tasks = strip_solutions(_read(source), str(source), keep=keep)
    text = _flatten_imports(text)
    task_of = {name: n for n, name in tasks}
    hints = dict(re.findall(r"### BEGIN SOLUTION Task (\d+): (.*)", _read(source)))
    tree = ast.parse(text)
    lines = text.split("\n")
    cells = [_cell("markdown", f"# Lab: {lab.title}\n\n{lab.summary}\n\nEach task is a "
                   "function whose body is a `TODO` and a `raise NotImplementedError`: replace "
                   "the two lines with your code, run the cells from the top, then the task's "
                   "check cell at the end.")]
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        cells.append(_cell("markdown", body[0].value.value))
        body = body[1:]
    pending = []

    def flush():
        if pending:
            cells.append(_cell("code", "\n".join(pending), [f"module:{module}"]))
            pending.clear()

    for node in body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        chunk = "\n".join(lines[start:node.end_lineno]).strip("\n")
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            flush()
            if node.name in task_of:
                n = task_of[node.name]
                doc = ast.get_docstring(node) or ""
                cells.append(_cell("markdown", f"## Task {n}: `{node.name}`\n\n*{hints[str(n)]}*"
                                               f"\n\n{doc}"))
            cells.append(_cell("code", chunk, [f"module:{module}"]))
        else:
            pending += [chunk, ""]
    flush()
    cells.append(_cell("markdown", "## Check your work\n\nEach cell runs the tests of one task "
                                   "on the functions above (the lab's `tests/` folder)."))
    cells.append(_cell("code", _NOTEBOOK_CHECK.format(module=module), ["setup"]))
    for n in sorted({n for n, _ in tasks}):
        cells.append(_cell("code", f"check({n})", [f"check:{n}"]))
    for index, cell in enumerate(cells):
        cell["id"] = f"cell-{index}"  # nbformat 4.5 ids, stable: the same source, same bytes
    return {"cells": cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def _tasks_of(lab: Lab) -> list[tuple[int, str, str]]:
    """The tasks of a lab, ``[(number, function, module)]``, sorted, from the library source."""
    found = []
    for module in lab.student_modules:
        source = _source(module)
        found += [(n, name, module) for n, name in strip_solutions(_read(source), str(source))[1]]
    return sorted(found)


def _render(lab: Lab, format: str = "files") -> dict[str, str]:
    """The files of one lab folder, ``{relative path: text}``, in the order they are written."""
    files, all_tasks = {}, []
    for module in lab.student_modules:
        source = _source(module)
        student, tasks = strip_solutions(_read(source), str(source))
        if not tasks:
            raise MarkerError(f"{source}: a student module without any solution region")
        files[f"{module}.py"] = _flatten_imports(student)
        all_tasks += [(n, name, module) for n, name in tasks]
    for module in lab.given_modules:
        source = _source(module)
        given, tasks = strip_solutions(_read(source), str(source))
        if tasks:
            raise MarkerError(f"{source}: given code must not hold solution regions")
        files[f"{module}.py"] = _flatten_imports(given)
    for test in lab.tests:
        files[f"tests/{pathlib.PurePosixPath(test).name}"] = _flatten_imports(
            _read(REPO / test))
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


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------
GRADE_TIMEOUT = 60.0
"""Seconds each task's tests may run (``--timeout``); past it the task is *timed out*."""

STATUSES = ("passed", "not implemented", "blocked", "failed", "timed out", "error", "no tests")
"""Every status ``grade`` gives a task (see [opd_literate.course.handout.grade][])."""

# The harness runs in the sandbox as its own program (it never imports this package): the
# grader writes it there, starts it, and reads its records from a pipe. Kept here, in one
# string, so that the grader and its harness are one file; tests lint it as a file.
HARNESS = r'''"""The grading harness of ``opd_literate.course.handout``, written into each sandbox.

The grader starts it in a fresh interpreter with a scrubbed environment, in its own process
group, and writes the configuration to its standard input. It imports pytest and the lab's
libraries once, then grades each task in a forked child: the child installs an audit hook,
imports the student's modules, replaces the other tasks' functions by the reference versions,
runs the instructor's tests of that task, and sends one record through a pipe. This process never
imports the student's code; it kills a child that runs past the time limit and forwards each
record, tagged with the run's nonce, through the pipe the grader opened.
"""

import gc
import importlib
import json
import os
import secrets
import selectors
import signal
import sys
import time
import traceback
import types

# Events a student's code may not raise: new processes, signals, foreign code, memory walks.
FORBIDDEN = {
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "socket.connect", "socket.bind",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
}
# Events that change the file system at the paths in their arguments.
PATH_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
    "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move", "shutil.chown",
}
# No cache, no conftest.py, no plugins but these; no collection of every object after the run
# (slow in a forked child, and the grade does not need it); plain tracebacks (pytest's own
# re-parse each source file, most of a failing task's time; the grade keeps one line).
PYTEST_OPTIONS = ["--no-header", "-p", "no:cacheprovider", "--noconftest", "-p",
                  "no:unraisableexception", "-p", "no:threadexception", "--tb=native"]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _inside(path, roots):
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def make_audit_hook(write_roots, secret_roots, blocked_modules):
    """An audit hook (it cannot be removed) that refuses writes outside ``write_roots``, any
    access under ``secret_roots``, the events of FORBIDDEN and imports of ``blocked_modules``."""

    def resolve(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def refuse(what, path=""):
        raise PermissionError(f"grading sandbox: {what} is not allowed"
                              + (f": {path}" if path else ""))

    def hook(event, args):
        if event in FORBIDDEN:
            refuse(event)
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise ImportError(f"grading sandbox: module {args[0]!r} is not available")
        if event == "open":
            path, _, flags = args
            if isinstance(path, int):
                return
            path = resolve(path)
            if path == os.devnull:
                return
            if _inside(path, secret_roots):
                refuse("reading", path)
            if flags is not None and flags & WRITE_FLAGS and not _inside(path, write_roots):
                refuse("writing outside the lab copy", path)
            if not _inside(path, write_roots) and os.path.isdir(path):
                refuse("opening a folder outside the lab copy", path)
        elif event in PATH_EVENTS:
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") else None
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    path = resolve(arg, dir_fd if isinstance(dir_fd, int) else None)
                    if not _inside(path, write_roots):
                        refuse(f"{event} outside the lab copy", path)
                    break  # the first path argument is checked, then the second below
            for arg in args[1:2] if event in ("os.rename", "os.link", "os.symlink",
                                               "shutil.move", "shutil.copyfile") else ():
                if isinstance(arg, (str, bytes, os.PathLike)):
                    path = resolve(arg)
                    if not _inside(path, write_roots):
                        refuse(f"{event} outside the lab copy", path)

    return hook


def _tripwire(modules):
    """The callables of the modules and classes a student could patch to fake a pass."""
    snapshot = {}
    for name in modules:
        owner = sys.modules.get(name.split(":")[0])
        for part in name.split(":")[1:]:
            owner = getattr(owner, part, None)
        if owner is None:
            continue
        for key, value in list(vars(owner).items()):
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                snapshot[f"{name.replace(':', '.')}.{key}"] = value
    return snapshot


TRIPWIRE = [
    "builtins", "pytest", "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.main",
    "_pytest.outcomes", "_pytest.python_api", "pluggy", "numpy.testing",
    "numpy.testing._private.utils", "torch.testing", "torch.testing._comparison", "numpy",
    "torch", "_pytest.reports:TestReport", "_pytest.python:Function",
    "_pytest.runner:CallInfo", "torch:Tensor",
]


def describe_error(error, work):
    """One line naming the cause of an exception raised while importing the student's code:
    the file and line inside the lab copy where it happened."""
    if isinstance(error, SyntaxError):
        where = os.path.relpath(error.filename, work) if error.filename else "?"
        return f"syntax error in {where}, line {error.lineno}: {error.msg}"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename and _inside(os.path.realpath(f.filename), [work])]
    where = (f" ({os.path.relpath(frames[-1].filename, work)}, line {frames[-1].lineno})"
             if frames else "")
    return f"{type(error).__name__}: {error}{where}"


class Collector:
    """A pytest plugin: keeps the tests of one task, records each outcome and first line."""

    def __init__(self, task):
        self.task, self.results, self.errors = task, [], []

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            tasks = {int(n) for marker in item.iter_markers("task") for n in marker.args}
            (keep if self.task in tasks else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid}: {_first_line(report)}")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            message = _first_line(report) if report.outcome == "failed" else ""
            self.results.append(dict(test=report.nodeid, outcome=report.outcome,
                                     message=message))


def _first_line(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    lines = [line.strip() for line in text.split("\n") if line.strip()] or [""]
    if lines[0].endswith(":") and len(lines) > 1:  # numpy: "AssertionError:" then the cause
        lines[0] += " " + lines[1]
    return lines[0][:500]


def run_task(config, task, pytest):
    """In the forked child: grade one task and return its record."""
    work = config["work"]
    os.chdir(work)
    sys.path.append(work)  # last: the student's files never shadow an installed package
    references = config.pop("reference_modules")
    hook = make_audit_hook(config["write_roots"], config["secret_roots"],
                           set(config["blocked_modules"]))
    sys.addaudithook(hook)
    before = _tripwire(TRIPWIRE)
    students = {}
    for module in config["student_modules"]:
        if not os.path.exists(os.path.join(work, f"{module}.py")):
            return dict(task=task, error=f"the lab folder has no {module}.py", at_import=True)
        try:
            students[module] = importlib.import_module(module)
        except BaseException as error:  # anything the student's module raises at import
            return dict(task=task, error=describe_error(error, work), at_import=True)
    for other, functions in config["functions"].items():  # other tasks: the reference
        if int(other) == task:
            continue
        for module, name in functions:
            setattr(students[module], name, getattr(references[module], name))
    collector = Collector(task)
    code = pytest.main(["-q", *PYTEST_OPTIONS, "-c", config["ini"], "--rootdir", work,
                        *config["tests"]], plugins=[collector])
    after = _tripwire(TRIPWIRE)
    tampered = sorted(k for k, v in before.items() if after.get(k) is not v)
    return dict(task=task, tests=collector.results, errors=collector.errors, exit=int(code),
                tampered=tampered)


def _child(config, task, write_end, pytest, token):
    os.close(config["result_fd"])  # the child never writes to the grader's pipe
    started = time.monotonic()
    log = os.open(os.path.join(config["log_dir"], f"task{task}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        record = run_task(config, task, pytest)
    except BaseException as error:  # the harness itself failed in this child
        record = dict(task=task, error=f"grading harness: {type(error).__name__}: {error}",
                      traceback=traceback.format_exc())
    record["seconds"] = round(time.monotonic() - started, 3)
    record["token"] = token
    os.write(write_end, json.dumps(record).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    config = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce = config.pop("nonce")
    results = os.fdopen(config["result_fd"], "w", buffering=1)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p not in ("", here, os.getcwd())]
    sys.dont_write_bytecode = True
    for name in config["preload"]:  # once here, not once per task
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # reported with its real cause when the student's module imports it
    import pytest

    # A first pytest run imports its plugins; on an empty folder, so no student code is run.
    # Then the given modules (the instructor's copies). Each child starts from this state.
    empty = os.path.join(config["log_dir"], "empty")
    os.mkdir(empty)
    pytest.main(["-q", "--co", *PYTEST_OPTIONS, "-c", config["ini"], "--rootdir", empty, empty])
    sys.path.append(config["work"])
    for name in config["given_modules"]:
        importlib.import_module(name)
    references = {}  # the reference modules, run here once (they never reach the lab copy)
    for module, source in config.pop("references").items():
        reference = types.ModuleType(f"_reference_{module}")
        sys.modules[reference.__name__] = reference  # while it runs (dataclasses look it up)
        exec(compile(source, f"<reference {module}>", "exec"), reference.__dict__)
        references[module] = sys.modules.pop(reference.__name__)
    config["reference_modules"] = references
    sys.path.remove(config["work"])
    gc.freeze()  # a child's collections then skip (and do not copy) the parent's objects

    pending = list(config["tasks"])
    running = {}  # read end -> (pid, task, chunks, deadline)
    selector = selectors.DefaultSelector()
    while pending or running:
        while pending and len(running) < config["jobs"]:
            task = pending.pop(0)
            read_end, write_end = os.pipe()
            token = secrets.token_hex(16)  # a record without it was not written by run_task
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                for fd in running:
                    os.close(fd)
                _child(config, task, write_end, pytest, token)
            os.close(write_end)
            running[read_end] = (pid, task, [], time.monotonic() + config["timeout"], token)
            selector.register(read_end, selectors.EVENT_READ)
        now = time.monotonic()
        wait = max(0.0, min(entry[3] for entry in running.values()) - now)
        for key, _ in selector.select(timeout=wait):
            pid, task, chunks, _, token = running[key.fd]
            data = os.read(key.fd, 1 << 16)
            if data:
                chunks.append(data)
                continue
            selector.unregister(key.fd)
            os.close(key.fd)
            del running[key.fd]
            _, status = os.waitpid(pid, 0)
            try:
                record = json.loads(b"".join(chunks))
                assert isinstance(record, dict) and record.pop("token") == token
            except (ValueError, AssertionError, KeyError):
                record = dict(task=task, error="the test process ended without a valid result "
                                               f"(wait status {status})")
            record["task"] = task
            results.write(json.dumps(dict(record, nonce=nonce)) + "\n")
            while record.get("at_import") and pending:  # the same import fails for every task
                results.write(json.dumps(dict(record, task=pending.pop(0), nonce=nonce)) + "\n")
        now = time.monotonic()
        for fd, (pid, task, _, deadline, _) in list(running.items()):
            if now >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                selector.unregister(fd)
                os.close(fd)
                del running[fd]
                results.write(json.dumps(dict(task=task, timed_out=config["timeout"],
                                              nonce=nonce)) + "\n")
    results.close()


if __name__ == "__main__":
    main()
'''

# What a grading sandbox never receives from the student's folder.
_SKIPPED_NAMES = {"__pycache__", ".pytest_cache", "conftest.py", "pytest.ini", "tox.ini",
                  "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py", MARKER}
_SKIPPED_SUFFIXES = {".so", ".pyd", ".pyc", ".pyo", ".pth", ".dylib", ".dll"}
_COPY_LIMIT = 50 * 2**20  # bytes: a lab is a few hundred kilobytes


def _lab_of(folder: pathlib.Path) -> Lab:
    manifest_path = folder / "lab.json"
    if not manifest_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a lab folder (no lab.json)")
    try:
        name = json.loads(manifest_path.read_text())["lab"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(folder / 'lab.json')!r} is not a lab manifest") from None
    if name not in LABS:
        raise ValueError(f"{str(folder / 'lab.json')!r} names an unknown lab {name!r}")
    return LABS[name]


def _copy_student_files(folder: pathlib.Path, work: pathlib.Path) -> list[str]:
    """Copy the student's own files into ``work``: regular files only, without tests, pytest
    configuration, compiled code or caches. Returns the names left out that could change how
    tests run (a ``conftest.py``, a ``pytest.ini``, compiled code, a link)."""
    ignored, size = [], 0
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        parts = relative.parts
        if parts[0] in ("tests", MARKER) or any(p in ("__pycache__", ".pytest_cache", ".git")
                                                for p in parts):
            continue
        if path.is_symlink():
            ignored.append(f"{relative} (a symbolic link)")
            continue
        if not path.is_file():
            continue
        if path.name in _SKIPPED_NAMES or path.suffix in _SKIPPED_SUFFIXES:
            if path.name not in ("pytest.ini", "conftest.py") or len(parts) > 1:
                ignored.append(str(relative))
            continue
        size += path.stat().st_size
        if size > _COPY_LIMIT:
            raise ValueError(f"{str(folder)!r} holds more than {_COPY_LIMIT >> 20} MiB; "
                             "a lab folder is a few hundred kilobytes")
        target = work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return ignored


def _notebook_modules(folder: pathlib.Path, lab: Lab) -> dict[str, str]:
    """The student modules assembled from the code cells of ``<lab>.ipynb`` that carry the
    ``module:<name>`` tag, in order; {} when the folder holds no notebook."""
    path = folder / f"{lab.name}.ipynb"
    if not path.is_file():
        return {}
    try:
        cells = json.loads(path.read_text())["cells"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(path)!r} is not a Jupyter notebook") from None
    modules = {}
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        for tag in tags:
            if cell.get("cell_type") == "code" and tag.startswith("module:"):
                modules.setdefault(tag.split(":", 1)[1], []).append(source.rstrip("\n"))
    return {name: "\n\n\n".join(parts) + "\n" for name, parts in modules.items()
            if name in lab.student_modules}


def _check_files(folder: pathlib.Path, instructor: dict) -> dict:
    """Each handout file other than the student modules that the folder changed or lacks:
    ``{name: "modified" | "missing"}``. The grade uses the instructor's copy either way."""
    found = {}
    for name, text in instructor.items():
        path = folder / name
        if not path.is_file():
            found[name] = "missing"
        elif _sha256(path) != hashlib.sha256(text.encode()).hexdigest():
            found[name] = "modified"
    return found


def _scrubbed_environment(sandbox: pathlib.Path) -> dict:
    """The whole environment of the student's process: nothing from the grader's but PATH."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(sandbox / "home"),
            "TMPDIR": str(sandbox / "tmp"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _third_party(files: dict) -> list[str]:
    """The installed packages the lab's code imports (preloaded once by the harness)."""
    import ast

    own = {pathlib.PurePosixPath(name).stem for name in files}
    names = set()
    for name, text in files.items():
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return sorted(names - own - set(sys.stdlib_module_names))


def _run_harness(config: dict, sandbox: pathlib.Path, deadline: float) -> list[dict]:
    """Start the harness in its own process group and read its records; the group is killed
    however this ends (records read, time out, Ctrl-C, SIGTERM turned into SystemExit)."""
    import secrets
    import signal
    import time

    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    stderr_path = sandbox / "harness.stderr"
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-s", str(sandbox / "harness.py")], cwd=sandbox,
            env=_scrubbed_environment(sandbox), stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(write_end,),
            start_new_session=True)
    os.close(write_end)
    records, buffer = [], b""
    try:
        process.stdin.write(json.dumps(dict(config, nonce=nonce, result_fd=write_end)).encode())
        process.stdin.close()
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(read_end, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if not selector.select(timeout=left):
                    continue
                data = os.read(read_end, 1 << 16)
                if not data:
                    break
                buffer += data
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        pass  # the tasks without a record are reported as timed out
    finally:
        os.close(read_end)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the harness and every child it forked
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
    for line in buffer.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.pop("nonce", None) == nonce:
            records.append(record)
    if not records and process.returncode not in (0, None):
        lines = stderr_path.read_text(errors="replace").strip().split("\n")
        raise RuntimeError(f"the grading harness could not start: {lines[-1]}")
    return records


def _task_status(task: int, record) -> dict:
    """The status, counts and failure messages of one task from its harness record."""
    if record is None or "timed_out" in record:
        return dict(status="timed out", tests=0, passed=0,
                    messages=["timed out" if record is None
                              else f"timed out after {record['timed_out']:g} s"])
    if "error" in record:
        return dict(status="error", tests=0, passed=0, messages=[record["error"]])
    results = record["tests"]
    failed = [r for r in results if r["outcome"] == "failed"]
    messages = [f"{r['test']}: {r['message']}" for r in failed] + record["errors"]
    if record["tampered"]:
        messages.append("the student's code replaced " + ", ".join(record["tampered"][:5]))
    own_stub = [r for r in failed if f"NotImplementedError: Task {task}:" in r["message"]]
    other_stub = [r for r in failed if re.search(r"NotImplementedError: Task \d+:",
                                                 r["message"]) and r not in own_stub]
    if record["tampered"] or record["errors"]:
        status = "error"
    elif not results:
        status = "no tests"
    elif not failed:
        status = "passed"
    elif own_stub:
        status = "not implemented"
    elif len(other_stub) == len(failed):
        status = "blocked"
    else:
        status = "failed"
    return dict(status=status, tests=len(results),
                passed=sum(r["outcome"] == "passed" for r in results), messages=messages)


def grade(lab_dir, *, timeout: float = GRADE_TIMEOUT, jobs: int | None = None) -> dict:
    """Grade a lab folder (or a notebook lab) with the instructor's tests, task by task.

    The student's folder is copied into a temporary sandbox without its tests, ``conftest.py``,
    ``pytest.ini``, compiled files or links; the instructor's tests and given modules (rendered
    from the library) replace the student's copies, which are compared by SHA-256 and reported
    as ``modified`` or ``missing``. Each task's tests run in a forked child of a harness process
    started with a scrubbed environment in its own process group; the other tasks' functions
    are replaced by the reference versions in that child only (nothing is written to the
    student's folder). See ``docs/instructors.md`` for what this does and does not protect.

    A task is *passed* when all its tests pass, *not implemented* when one stops on its own
    ``NotImplementedError("Task N: ...")``, *blocked* when its only failures come from another
    task's stub, *timed out* when its tests run past ``timeout`` seconds, *error* when the
    student's code cannot be imported (a syntax error, a missing module: the message names
    file and line) or replaced a testing function, *no tests* when no test is marked with it,
    and *failed* otherwise. Returns ``{"lab", "tasks": {n: {"function", "status", "tests",
    "passed", "messages"}}, "score", "total", "files"}``.
    """
    import shutil
    import time

    folder = pathlib.Path(lab_dir)
    lab = _lab_of(folder)
    instructor = _render(lab)
    all_tasks = _tasks_of(lab)
    functions = {}
    for number, name, module in all_tasks:
        functions.setdefault(str(number), []).append((module, name))
    notebook = _notebook_modules(folder, lab)
    checked = {name: text for name, text in instructor.items()
               if name.endswith(".py") and pathlib.PurePosixPath(name).stem
               not in lab.student_modules}
    checked.update({name: instructor[name] for name in ("pytest.ini", "conftest.py")})
    start = time.monotonic()
    sandbox = pathlib.Path(tempfile.mkdtemp(prefix="opd-grade-"))
    try:
        work = sandbox / "lab"
        for sub in (work, sandbox / "home", sandbox / "tmp"):
            sub.mkdir()
        ignored = _copy_student_files(folder, work)
        for name, text in notebook.items():
            (work / f"{name}.py").write_text(text)
        for name, text in instructor.items():  # the instructor's tests and given code
            if name.startswith("tests/") or (name.endswith(".py") and name in checked):
                (work / name).parent.mkdir(parents=True, exist_ok=True)
                (work / name).write_text(text)
        for name in ("conftest.py", "pytest.ini"):
            (work / name).unlink(missing_ok=True)
        # The grader's own configuration: the task marker only (no pythonpath, no addopts).
        (sandbox / "pytest.ini").write_text("[pytest]\nmarkers =\n    task(*numbers): the "
                                            "lab tasks a test checks\n")
        (sandbox / "harness.py").write_text(HARNESS)
        references = {m: _flatten_imports(_read(_source(m)))
                      for m in lab.student_modules}
        real = [str(p.resolve()) for p in (work, sandbox / "tmp", sandbox / "home")]
        config = dict(
            work=real[0], write_roots=real, log_dir=str(sandbox),
            secret_roots=[str(PACKAGE.resolve())],
            blocked_modules=["opd_literate"], ini=str(sandbox / "pytest.ini"),
            tests=[f"tests/{pathlib.PurePosixPath(t).name}" for t in lab.tests],
            student_modules=list(lab.student_modules), functions=functions,
            given_modules=list(lab.given_modules),
            tasks=sorted({n for n, _, _ in all_tasks}), references=references,
            preload=_third_party(instructor), timeout=float(timeout),
            jobs=int(jobs or min(2, os.cpu_count() or 1)))
        deadline = start + 30 + len(config["tasks"]) * (timeout + 5)
        records = {r["task"]: r for r in _run_harness(config, sandbox, deadline)}
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)
    tasks = {}
    for number in config["tasks"]:
        names = ", ".join(name for _, name in functions[str(number)])
        tasks[number] = dict(function=names, **_task_status(number, records.get(number)))
    score = sum(t["status"] == "passed" for t in tasks.values())
    files = _check_files(folder, checked)
    files.update({name: "ignored" for name in ignored})
    return dict(lab=lab.name, tasks=tasks, score=score, total=len(tasks), files=files,
                format="notebook" if notebook else "files",
                seconds=round(time.monotonic() - start, 2))


def format_grade(result: dict) -> str:
    """The result of [opd_literate.course.handout.grade][] as a Markdown table, the first line of
    each failure, the files that differ from the handout, and a score line."""
    lines = [f"lab {result['lab']}", "", "| task | function | status | tests passed |",
             "| --- | --- | --- | ---: |"]
    for n, task in result["tasks"].items():
        lines.append(f"| {n} | {task['function']} | {task['status']} | "
                     f"{task['passed']}/{task['tests']} |")
    failures = [(n, m) for n, task in result["tasks"].items()
                if task["status"] not in ("passed", "not implemented") for m in task["messages"]]
    if failures:
        lines += ["", "failures:"] + [f"- Task {n}: {m}" for n, m in failures]
    if result.get("files"):
        lines += ["", "files that differ from the handout (the instructor's copy was used):"]
        lines += [f"- {name}: {state}" for name, state in sorted(result["files"].items())]
    lines += ["", f"score: {result['score']}/{result['total']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _grade_main(argv: list) -> int:
    import signal

    parser = _Parser(prog="opd-handout grade",
                     description="Grade a lab folder with the instructor's tests, task by task.")
    parser.add_argument("lab_dir", help="a folder written by opd-handout (or one holding such "
                                        "folders)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the report as JSON to PATH ('-' for standard output)")
    parser.add_argument("--timeout", type=float, default=GRADE_TIMEOUT,
                        help=f"seconds each task's tests may run (default {GRADE_TIMEOUT:g})")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    folder = pathlib.Path(args.lab_dir)
    folders = ([folder] if (folder / "lab.json").exists()
               else sorted(p.parent for p in folder.glob("*/lab.json")))
    if not folders:
        parser.error(f"{args.lab_dir!r} is not a lab folder (no lab.json)")

    def stop(number, frame):  # SIGTERM: unwind like Ctrl-C, so the harness group is killed
        raise KeyboardInterrupt(number)

    previous = signal.signal(signal.SIGTERM, stop)
    reports = []
    try:
        for lab_folder in folders:
            result = grade(lab_folder, timeout=args.timeout)
            reports.append(dict(folder=str(lab_folder), **result))
            if args.json != "-":
                print(format_grade(result), flush=True)
    except KeyboardInterrupt as interrupt:
        number = interrupt.args[0] if interrupt.args else signal.SIGINT
        print(f"opd-handout grade: stopped by {signal.Signals(number).name}; no process "
              "left running", file=sys.stderr)
        return 128 + int(number)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        text = json.dumps(dict(labs=reports), indent=1) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            pathlib.Path(args.json).write_text(text)
    return 0


def main(argv=None) -> int:
    """The command line: ``OUTDIR --lab NAME [--force]`` writes, ``grade LABDIR`` grades.

    Bad arguments (an unknown lab, a non-empty OUTDIR without ``--force``, ``--force`` on a
    folder this tool did not write or on a symbolic link, an OUTDIR that cannot be written, a
    folder without ``lab.json``) exit with code 2 and a one-line message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:
        return _grade_main(argv[1:])
    parser = _Parser(prog="opd-handout", description=__doc__.split("\n\n")[0],
                     epilog="To grade a folder: opd-handout grade LABDIR")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write the lab into")
    parser.add_argument("--lab", default="all", help="opd, mismatch or all (default all)")
    parser.add_argument("--format", default="files", choices=FORMATS,
                        help="files (default): Python modules; notebook: the student module "
                             "as a Jupyter notebook <lab>.ipynb")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty OUTDIR that this tool wrote (it deletes only "
                             f"the unchanged files listed in OUTDIR/{MARKER})")
    args = parser.parse_args(argv)
    try:
        folders = write_lab(args.lab, args.out_dir, force=args.force, format=args.format)
    except (ValueError, OSError) as error:  # bad input, or a folder that cannot be written
        parser.error(str(error))
    for folder in folders:
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
