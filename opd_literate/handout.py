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
students. ``grade`` runs those tests and reports each task as passed, not implemented, blocked
(by another task's stub), failed, or without tests.

Usage:

    python -m opd_literate.handout OUTDIR --lab opd|mismatch|all [--force]
    python -m opd_literate.handout grade LABDIR

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

__all__ = ["LABS", "MARKER", "Lab", "MarkerError", "strip_solutions", "write_lab", "grade", "main"]

PACKAGE = pathlib.Path(__file__).resolve().parent
REPO = PACKAGE.parent

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?P<rest>.*)$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
TASK = re.compile(r"^\s*Task\s+(?P<task>\d+)\s*:\s*(?P<hint>\S.*)$")
DEF = re.compile(r"^\s*def\s+(?P<name>\w+)\s*\(")
# The package's relative imports become flat imports inside the lab folder.
RELATIVE_IMPORT = re.compile(r"^from \.(?P<module>\w+) import ", re.M)
PACKAGE_IMPORT = re.compile(r"^from opd_literate(?:\.(?P<module>\w+))? import ", re.M)


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
        given_modules=("_checks",),
        tests=("tests/test_opd.py",),
        summary="Implement the three OPD losses: the per-token reward (Task 1), the "
                "REINFORCE loss with discount 0 (Task 2) and the full-vocabulary reverse KL "
                "(Task 3).",
    ),
    "mismatch": Lab(
        name="mismatch",
        title="Training-inference mismatch: rollout-correction estimators",
        student_modules=("estimators",),
        given_modules=("toy", "_checks"),
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
python -m pytest --task 1   # only the tests of Task 1
```

Your instructor grades the folder with `python -m opd_literate.handout grade <this folder>`,
which reports each task as passed, not implemented, blocked (its tests fail only on another
task's stub) or failed.
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


def write_lab(lab_name: str, out_dir, force: bool = False) -> list[pathlib.Path]:
    """Write the lab folder(s) for ``lab_name`` ("opd", "mismatch" or "all") under ``out_dir``.

    ``all`` writes one sub-folder per lab. ``out_dir`` gets a [MARKER][opd_literate.handout.MARKER]
    file listing every file written, with its SHA-256. An existing non-empty ``out_dir`` is
    refused unless ``force``. ``force`` replaces only a real folder (not a symbolic link) that
    holds this marker, and deletes only the files the marker lists; it refuses, before deleting
    anything, when one of them was changed since, or when a file it would write exists and is
    not one of them. Every other file stays. Returns the lab folders written.
    """
    if lab_name != "all" and lab_name not in LABS:
        raise ValueError(f"unknown lab {lab_name!r}; choose from {', '.join([*LABS, 'all'])}")
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUTDIR {str(out_dir)!r} exists and is not a folder")
    names = list(LABS) if lab_name == "all" else [lab_name]
    files = {(f"{name}/" if lab_name == "all" else "") + relative: text
             for name in names for relative, text in _render(LABS[name]).items()}
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


def _render(lab: Lab) -> dict[str, str]:
    """The files of one lab folder, ``{relative path: text}``, in the order they are written."""
    files, all_tasks = {}, []
    for module in lab.student_modules:
        source = PACKAGE / f"{module}.py"
        student, tasks = strip_solutions(_read(source), str(source))
        if not tasks:
            raise MarkerError(f"{source}: a student module without any solution region")
        files[f"{module}.py"] = _flatten_imports(student)
        all_tasks += [(n, name, module) for n, name in tasks]
    for module in lab.given_modules:
        source = PACKAGE / f"{module}.py"
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
    files["lab.json"] = json.dumps(manifest, indent=1) + "\n"
    return files


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------
class _Collector:
    """A pytest plugin recording each test's outcome, task markers and failure."""

    def __init__(self):
        self.results = []
        self.tasks = {}  # nodeid -> task numbers, filled at collection

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            message = ""
            if report.outcome == "failed" and report.longrepr is not None:
                crash = getattr(report.longrepr, "reprcrash", None)
                message = crash.message if crash else str(report.longrepr)
            self.results.append(dict(nodeid=report.nodeid, outcome=report.outcome,
                                     tasks=self.tasks.get(report.nodeid, []),
                                     message=message))

    def pytest_collection_modifyitems(self, items):
        for item in items:
            numbers = []
            for marker in item.iter_markers("task"):
                numbers += [int(n) for n in marker.args]
            self.tasks[item.nodeid] = numbers


def _run_tests(folder: pathlib.Path) -> list[dict]:
    """Run the lab's tests in a fresh interpreter (the lab's modules must not meet the
    library's in one process) and return the collector's records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "results.json"
        code = (
            "import json, pytest\n"
            "from opd_literate.handout import _Collector\n"
            "c = _Collector()\n"
            "pytest.main(['-q', '-p', 'no:cacheprovider', '--no-header', '-o', "
            "'addopts=', 'tests'], plugins=[c])\n"
            f"json.dump(c.results, open({str(out)!r}, 'w'))\n"
        )
        env = dict(os.environ, PYTHONPATH=str(folder), PYTHONDONTWRITEBYTECODE="1")
        subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, check=False,
                       capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise RuntimeError(f"the tests of {folder} could not be run")
        return json.loads(out.read_text())


def grade(lab_dir) -> dict:
    """Run a lab folder's tests and grade each task.

    A task is *passed* when all its tests pass, *not implemented* when one of its tests stops on
    its own ``NotImplementedError("Task N: ...")``, *blocked* when its only failures come from
    another task's stub, *no tests* when no test is marked with it, and *failed* otherwise.
    Returns ``{"lab", "tasks": {n: {...}}, "score", "total"}``.
    """
    folder = pathlib.Path(lab_dir)
    manifest_path = folder / "lab.json"
    if not manifest_path.exists():
        raise ValueError(f"{str(folder)!r} is not a lab folder (no lab.json)")
    manifest = json.loads(manifest_path.read_text())
    records = _run_tests(folder)
    tasks = {}
    for number, functions in sorted(manifest["tasks"].items(), key=lambda kv: int(kv[0])):
        n = int(number)
        mine = [r for r in records if n in r["tasks"]]
        failed = [r for r in mine if r["outcome"] == "failed"]
        own_stub = [r for r in failed if f"NotImplementedError: Task {n}:" in r["message"]]
        other_stub = [r for r in failed if re.search(r"NotImplementedError: Task \d+:",
                                                     r["message"]) and r not in own_stub]
        if not mine:
            status = "no tests"
        elif not failed:
            status = "passed"
        elif own_stub:
            status = "not implemented"
        elif len(other_stub) == len(failed):
            status = "blocked"
        else:
            status = "failed"
        tasks[n] = dict(function=", ".join(functions), status=status, tests=len(mine),
                        passed=sum(r["outcome"] == "passed" for r in mine))
    score = sum(t["status"] == "passed" for t in tasks.values())
    return dict(lab=manifest["lab"], tasks=tasks, score=score, total=len(tasks))


def format_grade(result: dict) -> str:
    """The result of [opd_literate.handout.grade][] as a Markdown table and a score line."""
    lines = [f"lab {result['lab']}", "", "| task | function | status | tests passed |",
             "| --- | --- | --- | ---: |"]
    for n, task in result["tasks"].items():
        lines.append(f"| {n} | {task['function']} | {task['status']} | "
                     f"{task['passed']}/{task['tests']} |")
    lines += ["", f"score: {result['score']}/{result['total']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    """The command line: ``OUTDIR --lab NAME [--force]`` writes, ``grade LABDIR`` grades.

    Bad arguments (an unknown lab, a non-empty OUTDIR without ``--force``, ``--force`` on a
    folder this tool did not write or on a symbolic link, an OUTDIR that cannot be written, a
    folder without ``lab.json``) exit with code 2 and a one-line message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:
        parser = _Parser(prog="opd-handout grade",
                         description="Grade a lab folder: run its tests, report each task.")
        parser.add_argument("lab_dir", help="a folder written by opd-handout")
        args = parser.parse_args(argv[1:])
        folder = pathlib.Path(args.lab_dir)
        folders = ([folder] if (folder / "lab.json").exists()
                   else sorted(p.parent for p in folder.glob("*/lab.json")))
        if not folders:
            parser.error(f"{args.lab_dir!r} is not a lab folder (no lab.json)")
        for lab_folder in folders:
            print(format_grade(grade(lab_folder)))
        return 0
    parser = _Parser(prog="opd-handout", description=__doc__.split("\n\n")[0],
                     epilog="To grade a folder: opd-handout grade LABDIR")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write the lab into")
    parser.add_argument("--lab", default="all", help="opd, mismatch or all (default all)")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty OUTDIR that this tool wrote (it deletes only "
                             f"the unchanged files listed in OUTDIR/{MARKER})")
    args = parser.parse_args(argv)
    try:
        folders = write_lab(args.lab, args.out_dir, force=args.force)
    except (ValueError, OSError) as error:  # bad input, or a folder that cannot be written
        parser.error(str(error))
    for folder in folders:
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
