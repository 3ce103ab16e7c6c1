r"""The labs: which modules students complete, and the lab folder written from the library.

A lab folder is self-contained: the student module(s) with every solution region replaced by
its hint and a stub ([strip_solutions][opd_literate.course.markers.strip_solutions]; the
docstrings and derivations are kept), the given code whole, the lab's tests (importing from the
folder), a ``pytest.ini``, a ``conftest.py`` (for ``pytest --task N``), a ``lab.json`` naming
the tasks and a README for students; with ``format="notebook"``, the student module is a
Jupyter notebook instead. The folder gets a ``.opd-handout`` marker that lists the files
written and their SHA-256; ``force`` replaces only such a folder, deletes only those files
(refusing if one was changed since) and keeps every other file.

The lab modules are read from the package's source files (``source_of``), so the handout needs
a source checkout (``pip install -e .``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import textwrap
from dataclasses import dataclass

from .markers import MarkerError, strip_solutions

__all__ = ["LABS", "MARKER", "FORMATS", "Lab", "write_lab", "render_notebook"]

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
REPO = PACKAGE.parent

# The package's relative imports become flat imports inside the lab folder.
RELATIVE_IMPORT = re.compile(r"^from \.+(?P<module>\w+) import ", re.M)
PACKAGE_IMPORT = re.compile(r"^from opd_literate(?:\.\w+)*?(?:\.(?P<module>\w+))? import ", re.M)


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
        tests=("tests/opd/test_lab_opd.py",),
        summary="Implement the three OPD losses: the per-token reward (Task 1), the "
                "REINFORCE loss with discount 0 (Task 2) and the full-vocabulary reverse KL "
                "(Task 3).",
    ),
    "mismatch": Lab(
        name="mismatch",
        title="Training-inference mismatch: rollout-correction estimators",
        student_modules=("estimators",),
        given_modules=("toy", "_numerics"),
        tests=("tests/mismatch/test_lab_estimators.py",),
        summary="Implement the weights of eight gradient estimators for a sampler that is not "
                "the trainer, and check their exact bias on the enumerable toy.",
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


def sha256_of(path: pathlib.Path) -> str:
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
                                                     or sha256_of(path) != digest)):
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
    [MARKER][opd_literate.course.labs.MARKER] file listing every file written, with its SHA-256.
    An existing non-empty ``out_dir`` is refused unless ``force``. ``force`` replaces only a real
    folder (not a symbolic link) that holds this marker, and deletes only the files the marker
    lists; it refuses, before deleting anything, when one of them was changed since, or when a file
    it would write exists and is not one of them. Every other file stays. ``format="notebook"``
    writes each lab's student module as a Jupyter notebook ``<lab>.ipynb`` instead (see
    [opd_literate.course.labs.render_notebook][]). Returns the lab folders written.
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
             for name in names for relative, text in render_lab(LABS[name], format).items()}
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
    source = source_of(module)
    text, tasks = strip_solutions(read_source(source), str(source), keep=keep)
    text = flatten_imports(text)
    task_of = {name: n for n, name in tasks}
    hints = dict(re.findall(r"### BEGIN SOLUTION Task (\d+): (.*)", read_source(source)))
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


def tasks_of(lab: Lab) -> list[tuple[int, str, str]]:
    """The tasks of a lab, ``[(number, function, module)]``, sorted, from the library source."""
    found = []
    for module in lab.student_modules:
        source = source_of(module)
        _, tasks = strip_solutions(read_source(source), str(source))
        found += [(n, name, module) for n, name in tasks]
    return sorted(found)


def render_lab(lab: Lab, format: str = "files") -> dict[str, str]:
    """The files of one lab folder, ``{relative path: text}``, in the order they are written."""
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
            read_source(REPO / test))
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

