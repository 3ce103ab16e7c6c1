r"""Gradescope: a lab's autograder zip, and the program that grades one submission inside it.

``python -m opd_literate.course OUTDIR --lab opd --format gradescope`` writes, per lab, the
student's folder (``student/``, the ``files`` handout) and ``autograder.zip``
([autograder_files][opd_literate.course.gradescope.autograder_files]) for Gradescope's
"Autograder" assignment, laid out as its specification asks
(gradescope-autograders.readthedocs.io, "Autograder Specifications"): ``setup.sh`` and
``run_autograder`` at the root of the zip, which Gradescope extracts into ``/autograder/source``;
the student's files in ``/autograder/submission``; the grade read back from
``/autograder/results/results.json``.

``run_autograder`` calls [run][opd_literate.course.gradescope.run] on that root (the variable
``AUTOGRADER_ROOT`` moves it, for a test): it finds the student's module (``opd.py``) or
notebook (``opd.ipynb``, helper cells kept:
[notebook_modules][opd_literate.course.labs.notebook_modules]) in the submission, writes it
into a fresh copy of the handout, grades that folder with
[grade][opd_literate.course.grade.grade], the lab's hidden tests included, and writes one
Gradescope test per (task, test): ``name``, ``number``, ``score``, ``max_score`` (the task's
points, set in the lab definition, shared equally among its tests), ``status``, ``output`` (the
failure's first line) and ``visibility`` (``visible``; ``after_due_date`` for a hidden test),
with the top-level ``score``, ``execution_time`` and ``output`` (the grader's report).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from .._files import replace_atomically
from . import labs, sandbox
from .grade import format_grade, grade, printable, walk_submission
from .labs import (
    GRADE_TIMEOUT,
    LAB_TESTS,
    LABS,
    PACKAGE,
    Lab,
    flatten_imports,
    lab_file,
    lab_points,
    notebook_modules,
    read_source,
    render_lab,
    source_of,
)

__all__ = ["HIDDEN_VISIBILITY", "autograder_files", "results", "run", "main"]

HIDDEN_VISIBILITY = "after_due_date"
"""Gradescope's visibility of a hidden test's entry: students see it once the due date passed
(the other entries are ``visible``)."""

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image.
set -euo pipefail
apt-get install -y python3 python3-pip python3-venv bubblewrap
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install {requirements}
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission. AUTOGRADER_ROOT (default /autograder) holds
# source/ (this zip), submission/ (the student's files) and results/ (results.json goes there).
set -uo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PYTHON="${AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}"
# 1: no operating-system sandbox, for checking the harness itself on code you wrote. The
# student's code then runs as a user of its own (this script runs as root), which cannot enter
# source/ (the reference solutions, the hidden tests) or write results/, but reads what every
# user may read and uses the network: not for students' work.
export AUTOGRADER_TRUSTED="${AUTOGRADER_TRUSTED:-0}"
# A number of GiB: the memory of all the student's processes together, by a memory cgroup.
export AUTOGRADER_MEMORY_TOTAL_GIB="${AUTOGRADER_MEMORY_TOTAL_GIB:-}"
# `-m opd_literate.course` drops the current folder from sys.path before it imports anything.
cd "$ROOT" && PYTHONPATH="$ROOT/source" exec "$PYTHON" -m opd_literate.course gradescope "$ROOT"
"""

# Collects the instructor's tests of a lab folder with their task marks (run in a subprocess,
# on the reference solution: the instructor's own code).
_COLLECT = """import json, sys
import pytest

class Collect:
    def __init__(self):
        self.items = []
    def pytest_collection_modifyitems(self, items):
        for item in items:
            tasks = sorted({int(n) for m in item.iter_markers("task") for n in m.args})
            self.items.append([item.nodeid, tasks])

plugin = Collect()
code = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "--rootdir", ".",
                    *sys.argv[1:]], plugins=[plugin])
sys.stdout.flush()
sys.__stdout__.write("\\n" + json.dumps({"exit": int(code), "items": plugin.items}) + "\\n")
"""

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same source gives the same zip bytes


def _requirements() -> str:
    """What setup.sh installs: this package's numpy and torch pins, and pytest."""
    return "'numpy>=1.24' 'torch>=2.1,<2.15' 'pytest>=8'"


def _package_sources() -> dict[str, bytes]:
    """The package's Python files, ``{path in the zip: bytes}``: the grader and its reference
    solutions (the lab tests are added beside them, where a wheel installs them)."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if "__pycache__" in relative.parts or LAB_TESTS in path.parents:
            continue
        files[relative.as_posix()] = path.read_bytes()
    return files


def _with_hidden(lab: Lab) -> Lab:
    """The lab with its hidden tests among the others (what the submission's folder holds and
    ``collect_tests`` collects)."""
    return dataclasses.replace(lab, tests=lab.tests + lab.hidden_tests, hidden_tests=())


def _hidden_only(lab: Lab) -> Lab:
    """The lab whose tests are its hidden tests only: graded in a sandbox run of their own."""
    return dataclasses.replace(lab, tests=lab.hidden_tests, hidden_tests=())


# When one task's two runs disagree, the more severe status is the task's.
_SEVERITY = ("error", "timed out", "failed", "not implemented", "blocked", "passed", "no tests")


def merged_report(lab: Lab, visible: dict, hidden: dict | None, collected=None) -> dict:
    """One report from the grade of ``lab``'s visible tests and that of its hidden tests (two
    sandbox runs): each task's cases, counts and messages together, its status the more severe
    of the two. A task that one run could not grade (error, timed out: no per-test entries)
    gets one failed entry per test of that run, from ``collected``
    ([collect_tests][opd_literate.course.gradescope.collect_tests] of the lab with its hidden
    tests), with that run's message: every task keeps an entry for each of its tests, and the
    visible entries never carry the hidden run's text."""
    if hidden is None:
        return visible

    def files(tests):
        return tuple(f"tests/{pathlib.PurePosixPath(t).name}::" for t in tests)

    def entries(task, number, prefixes):
        if task["cases"] or task["status"] not in ("error", "timed out"):
            return task["cases"]
        note = "; ".join(task["messages"]) or task["status"]
        return [dict(name=nodeid, passed=False, message=note)
                for nodeid, _ in (collected or {}).get(number, [])
                if nodeid.startswith(prefixes)]

    tasks = {}
    for number, seen in visible["tasks"].items():
        unseen = hidden["tasks"][number]
        cases = (entries(seen, number, files(lab.tests))
                 + entries(unseen, number, files(lab.hidden_tests)))
        status = min((seen["status"], unseen["status"]), key=_SEVERITY.index)
        tasks[number] = dict(seen, status=status, cases=cases, tests=len(cases),
                             passed=sum(c["passed"] for c in cases),
                             messages=[c["message"] for c in cases if not c["passed"]])
    return dict(visible, tasks=tasks, score=sum(t["status"] == "passed" for t in tasks.values()),
                seconds=round(visible["seconds"] + hidden["seconds"], 2))


def autograder_files(lab: Lab) -> dict[str, bytes]:
    """The files of ``lab``'s Gradescope autograder zip, ``{path: bytes}``: ``setup.sh``,
    ``run_autograder``, ``autograder.json`` (the lab's name), and the package with the lab's
    tests, hidden ones included, as package data."""
    lab_points(lab)  # refuses a lab whose points do not match its tasks
    files = {"setup.sh": SETUP_SH.format(requirements=_requirements()).encode(),
             "run_autograder": RUN_AUTOGRADER.encode(),
             "autograder.json": json.dumps({"lab": lab.name}, indent=1).encode() + b"\n"}
    files.update(_package_sources())
    for test in lab.tests + lab.hidden_tests:
        relative = pathlib.PurePosixPath(test).relative_to("tests")
        files[f"opd_literate/course/lab_tests/{relative}"] = lab_file(test).read_bytes()
    return files


def zip_bytes(files: dict[str, bytes]) -> bytes:
    """``files`` as a zip, byte-identical for the same input (fixed times, sorted names);
    the two scripts executable."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            mode = 0o755 if name in ("setup.sh", "run_autograder") else 0o644
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, files[name])
    return buffer.getvalue()


def _regular_files(submission: pathlib.Path) -> list[pathlib.Path]:
    """The regular files under ``submission``, never through a link, at most
    ``grade.DEPTH_LIMIT`` folders deep (walked without recursion)."""
    return [submission.joinpath(*parts) for parts, link, regular, too_deep
            in walk_submission(submission) if regular]


def _find(submission: pathlib.Path, name: str, files=None):
    """The shallowest regular file called ``name`` under ``submission`` (Gradescope keeps the
    folders of an uploaded zip or repository), or None."""
    found = [p for p in (_regular_files(submission) if files is None else files)
             if p.name == name and "__MACOSX" not in p.parts]
    return min(found, key=lambda p: (len(p.parts), str(p))) if found else None


def _student_folder(lab: Lab, submission: pathlib.Path, folder: pathlib.Path) -> str:
    """Write the handout into ``folder`` and the submission's module(s) over it; returns what
    was graded ("opd.py", "opd.ipynb"). ValueError when the submission holds neither."""
    for relative, text in render_lab(lab).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    files = _regular_files(submission)
    notebook = _find(submission, f"{lab.name}.ipynb", files)
    if notebook is not None:
        try:
            modules = notebook_modules(json.loads(notebook.read_text()), lab)
        except (ValueError, MemoryError, RecursionError) as error:
            raise ValueError(f"{notebook.name}: {type(error).__name__}: {error}") from None
        for module, text in modules.items():
            (folder / f"{module}.py").write_text(text)
        return notebook.name
    found = {m: _find(submission, f"{m}.py", files) for m in lab.student_modules}
    missing = [f"{m}.py" for m, path in found.items() if path is None]
    if missing:
        names = sorted(printable(str(p.relative_to(submission)), 100) for p in files)[:20]
        raise ValueError(f"the submission holds no {' or '.join(missing)} (nor "
                         f"{lab.name}.ipynb); it holds: {', '.join(names) or 'nothing'}")
    given = {pathlib.PurePosixPath(name).name for name in render_lab(lab)}
    for module, path in found.items():
        for helper in path.parent.glob("*.py"):  # the student's own extra modules, beside it
            if helper.name not in given and helper.is_file() and not helper.is_symlink():
                shutil.copyfile(helper, folder / helper.name)
        shutil.copyfile(path, folder / f"{module}.py")
    return ", ".join(f"{m}.py" for m in lab.student_modules)


def collect_tests(lab: Lab) -> dict[int, list[tuple[str, str]]]:
    """Each task's tests, ``{task: [(node id, test file)]}`` in collection order, collected on
    the reference solution in a fresh folder laid out as the grader lays out its copy."""
    with tempfile.TemporaryDirectory(prefix="opd-collect-") as tmp:
        folder = pathlib.Path(tmp)
        for relative, text in render_lab(lab).items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text)
        for module in lab.student_modules:
            (folder / f"{module}.py").write_text(flatten_imports(read_source(source_of(module))))
        (folder / "conftest.py").unlink()  # its --task option plays no part here
        tests = [f"tests/{pathlib.PurePosixPath(t).name}" for t in lab.tests]
        run = subprocess.run([sys.executable, "-c", _COLLECT, *tests], cwd=folder,
                             capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    try:
        report = json.loads(run.stdout.strip().split("\n")[-1])
        assert report["exit"] == 0
    except (ValueError, AssertionError, IndexError) as error:
        raise RuntimeError(f"collecting the tests of lab {lab.name!r} failed: "
                           f"{(run.stdout + run.stderr).strip()[-500:]}") from error
    tasks = {}
    for nodeid, numbers in report["items"]:
        for number in numbers:
            tasks.setdefault(number, []).append((nodeid, nodeid.split("::")[0]))
    return tasks


def _task_outcomes(number: int, task: dict, collected) -> tuple[list, str]:
    """One task's tests as ``[(node id, passed, message)]`` and a note for a task with none.

    From the report's own per-test entries (``cases``: a grader that judges each lab test)
    when it has them; else from the collected node ids and the failures the messages name, as
    long as the counts agree (otherwise, and for a task timed out or in error, none passes)."""
    note = "; ".join(task["messages"]) or task["status"]
    if task.get("cases"):
        return [(c["name"], bool(c["passed"]), c["message"]) for c in task["cases"]], note
    ids = [nodeid for nodeid, _ in (collected or {}).get(number, [])]
    failures = {}
    for message in task["messages"]:
        nodeid, _, text = message.partition(": ")
        failures.setdefault(nodeid, text)
    failed = [nodeid for nodeid in ids if nodeid in failures]
    consistent = task["tests"] == len(ids) and task["passed"] == len(ids) - len(failed)
    judged = consistent and task["status"] in ("passed", "failed", "not implemented", "blocked")
    if not consistent and task["status"] not in ("timed out", "error"):
        note = (f"the grader ran {task['tests']} tests of Task {number} ({task['passed']} "
                f"passed), the autograder expected {len(ids)}: no points. {note}")
    return [(nodeid, judged and nodeid not in failures,
             "" if judged and nodeid not in failures else failures.get(nodeid, note)
             if judged else note) for nodeid in ids], note


def results(lab: Lab, report: dict, collected, seconds: float, hidden=()) -> dict:
    """Gradescope's results.json for one graded submission.

    ``report`` is [grade][opd_literate.course.grade.grade]'s; ``collected`` the tests of each
    task ([collect_tests][opd_literate.course.gradescope.collect_tests]), needed only for a
    report without per-test entries; ``hidden`` the test files (``tests/<name>``) whose entries
    are shown after the due date. A task's points are shared equally among its tests, and a
    test earns its share when it passed. A task timed out or in error earns nothing, nor does
    one whose counts of tests run and passed disagree with the collected tests; a task without
    any test is one entry worth its points, earned only if the task passed.
    """
    tests = []
    for number, points in lab_points(lab).items():
        task = report["tasks"][number]
        outcomes, note = _task_outcomes(number, task, collected)
        tag = [f"task {number}"]
        if not outcomes:  # the task's points stay in the total
            ok = task["status"] == "passed"
            tests.append(dict(name=f"Task {number} ({task['function']})", number=f"{number}.0",
                              score=points if ok else 0.0, max_score=points,
                              status="passed" if ok else "failed", output=note[:2000],
                              visibility="visible", tags=tag))
        for index, (nodeid, ok, message) in enumerate(outcomes, start=1):
            share = points / len(outcomes)
            tests.append(dict(
                name=f"Task {number} ({task['function']}): {nodeid.split('::', 1)[-1]}",
                number=f"{number}.{index}", score=share if ok else 0.0, max_score=share,
                status="passed" if ok else "failed", output=message[:2000],
                visibility=HIDDEN_VISIBILITY if nodeid.split("::")[0] in hidden else "visible",
                tags=tag))
    # rounded: a sum of shares such as 4/13 is not exact in binary
    return dict(score=round(sum(t["score"] for t in tests), 6),
                execution_time=int(round(seconds)),
                output=format_grade(report), tests=tests,
                extra_data={"lab": lab.name,
                            "statuses": {str(n): t["status"] for n, t in report["tasks"].items()}})


def _grade_options() -> dict:
    """``trusted`` (``AUTOGRADER_TRUSTED=1``: no OS sandbox) and ``memory_total``
    (``AUTOGRADER_MEMORY_TOTAL_GIB``, a number of GiB) for ``grade``."""
    options = {"trusted": os.environ.get("AUTOGRADER_TRUSTED") == "1"}
    problem = sandbox.run_user_problem() if options["trusted"] else None
    if problem is not None:  # the student's code would see source/, reference included
        raise ValueError("AUTOGRADER_TRUSTED=1 cannot keep the reference solutions and the "
                         f"hidden tests from the submission here ({problem}); grade it in the "
                         "sandbox (bubblewrap) instead")
    total = os.environ.get("AUTOGRADER_MEMORY_TOTAL_GIB", "").strip()
    if total:
        try:
            options["memory_total"] = int(float(total) * 2**30)
        except ValueError:
            raise ValueError(f"AUTOGRADER_MEMORY_TOTAL_GIB must be a number of GiB, got "
                             f"{printable(total, 50)!r}") from None
    return options


def run(root) -> dict:
    """Grade the submission under ``root`` (Gradescope's ``/autograder``) and write
    ``root/results/results.json``; returns what it wrote. A submission that cannot be graded
    (no module, a grader that refuses) gets 0 with the reason as its output."""
    from unittest import mock

    start = time.monotonic()
    root = pathlib.Path(root)
    config = json.loads((root / "source" / "autograder.json").read_text())
    lab = LABS[config["lab"]]
    graded = _with_hidden(lab)
    hidden = {f"tests/{pathlib.PurePosixPath(t).name}" for t in lab.hidden_tests}
    (root / "results").mkdir(parents=True, exist_ok=True)
    print(f"grading lab {lab.name} with opd_literate from {PACKAGE}", flush=True)
    try:
        # Before any student code runs: source/ (the reference solutions, the hidden tests)
        # is this user's alone, and results/ only this user's to write. The sandbox shows
        # neither; the trusted mode as root runs the student's code as another user, whom
        # these modes keep out.
        os.chmod(root / "source", 0o700)
        os.chmod(root / "results", 0o755)
        options = _grade_options()  # refuses a trusted mode that would not keep source/ closed
        with tempfile.TemporaryDirectory(prefix="opd-submission-") as tmp:
            folder = pathlib.Path(tmp) / lab.name
            folder.mkdir()
            what = _student_folder(graded, root / "submission", folder)
            # grade() reads the lab by name. The visible tests run first, in a sandbox of their
            # own; the hidden tests after, in another: no visible test sees a hidden input, and
            # nothing of the hidden run reaches the visible report.
            with mock.patch.dict(labs.LABS, {lab.name: lab}):
                visible = grade(folder, timeout=GRADE_TIMEOUT, **options)
            hidden_report = None
            if lab.hidden_tests:
                with mock.patch.dict(labs.LABS, {lab.name: _hidden_only(lab)}):
                    hidden_report = grade(folder, timeout=GRADE_TIMEOUT, **options)
        reports = [visible] + ([hidden_report] if hidden_report else [])
        per_test = all(t.get("cases") for r in reports for t in r["tasks"].values())
        collected = None if per_test else collect_tests(graded)
        report = merged_report(lab, visible, hidden_report, collected)
        output = results(lab, report, collected, time.monotonic() - start, hidden)
        # what the student sees at once: the visible tests' report only
        output["output"] = f"graded {what}\n\n" + format_grade(visible)
    except (ValueError, RuntimeError, OSError) as error:
        output = dict(score=0.0, execution_time=int(round(time.monotonic() - start)),
                      output=f"not graded: {printable(str(error), 2000)}", tests=[])
    except Exception as error:  # whatever a submission does, results.json is written
        output = dict(score=0.0, execution_time=int(round(time.monotonic() - start)),
                      output=f"not graded: the grader failed on this submission "
                             f"({type(error).__name__}: {printable(str(error), 500)})", tests=[])
    # last, and whole: a new file renamed over results.json (a reader never sees half of it)
    text = json.dumps(output, indent=1) + "\n"
    replace_atomically(root / "results" / "results.json", lambda tmp: tmp.write_text(text))
    print(output["output"], flush=True)
    return output


def main(argv=None) -> int:
    """``python -m opd_literate.course.gradescope [ROOT]``: what ``run_autograder`` runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run(argv[0] if argv else os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
