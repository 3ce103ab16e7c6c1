"""The grader against a student who games it: tampered tests, a conftest that passes everything,
code that reads the environment, writes outside its folder, loops forever, patches pytest or
forges results; and the errors a student meets (a syntax error, a missing module)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from opd_literate.course import labs
from opd_literate.course.grade import HARNESS_PATH, format_grade, grade
from opd_literate.course.labs import PACKAGE, write_lab
from opd_literate.course.markers import strip_solutions

# Every test here grades a lab in subprocesses (a few seconds each): the slow tier. The fast
# tier grades once, in tests/course/test_labs.py's command-line test.
pytestmark = pytest.mark.slow


def _tree(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _student(lab_folder, module, stubs, keep=()):
    """Write the student module with the tasks in ``keep`` solved and the stub of each task in
    ``stubs`` replaced by the given lines (indented as a function body)."""
    text, _ = strip_solutions(labs.source_of(module).read_text(), keep=set(keep))
    text = labs.flatten_imports(text)
    for task, lines in stubs.items():
        stub = next(line for line in text.split("\n")
                    if f'raise NotImplementedError("Task {task}:' in line)
        indent = stub[:len(stub) - len(stub.lstrip())]
        text = text.replace(stub, "\n".join(indent + line for line in lines))
    (lab_folder / f"{module}.py").write_text(text)


CONFTEST_THAT_PASSES_EVERYTHING = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
'''


@pytest.fixture(scope="module")
def gamed(tmp_path_factory):
    """One mismatch lab with every trick at once, graded once (each task tests one trick)."""
    root = tmp_path_factory.mktemp("gamed")
    folder = write_lab("mismatch", root / "lab")[0]
    victim = root / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    tests = folder / "tests" / "test_lab_estimators.py"
    # Emptied test bodies: every test passes on the student's copy.
    tests.write_text("import pytest\n\n\n@pytest.mark.task(4)\ndef test_naive():\n    pass\n")
    (folder / "conftest.py").write_text(CONFTEST_THAT_PASSES_EVERYTHING)
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -p no:python\n")
    (folder / "extra").mkdir()
    (folder / "extra" / "conftest.py").write_text(CONFTEST_THAT_PASSES_EVERYTHING)
    _student(folder, "estimators", {
        # Task 1: right, unless the grader's environment (a secret, the real HOME) is visible.
        1: ["import os",
            "if 'OPD_GRADER_SECRET' in os.environ or os.environ.get('HOME') == "
            f"{os.environ.get('HOME', '')!r}:",
            "    raise RuntimeError('saw ' + os.environ.get('OPD_GRADER_SECRET', 'HOME'))",
            "return _finish(toy, np.ones(toy['logp_train'].shape), baseline, return_weights)"],
        # Task 2: right only if every attempt to leave the sandbox is refused.
        2: ["import ctypes, gc, os, shutil, subprocess",
            f"victim, library = {str(victim)!r}, {str(PACKAGE)!r}",
            "attempts = {'open for writing': lambda: open(victim + '/pwned.txt', 'w'),",
            "    'os.open': lambda: os.open(victim + '/pwned.txt', os.O_CREAT | os.O_WRONLY),",
            "    'remove': lambda: os.remove(victim + '/keep.txt'),",
            "    'rmtree': lambda: shutil.rmtree(victim),",
            "    'rename': lambda: os.rename(victim + '/keep.txt', 'stolen.txt'),",
            "    'os.system': lambda: os.system('rm -rf ' + victim),",
            "    'subprocess': lambda: subprocess.run(['rm', '-rf', victim]),",
            "    'kill': lambda: os.kill(os.getppid(), 0),",
            "    'ctypes': lambda: ctypes.CDLL(None),",
            "    'gc': lambda: gc.get_objects(),",
            "    'read the library': lambda: open(library + '/estimators.py').read(),",
            "    'import the library': lambda: __import__('opd_literate.mismatch.estimators')}",
            "escaped = []",
            "for name, attempt in attempts.items():",
            "    try:",
            "        attempt()",
            "        escaped.append(name)",
            "    except (PermissionError, ImportError):",
            "        pass",
            "if escaped:",
            "    raise RuntimeError('escaped: ' + ', '.join(escaped))",
            "return _finish(toy, token_ratios(toy), baseline, return_weights)"],
        # Task 3: an infinite loop.
        3: ["while True:", "    pass"],
        # Task 5: patches pytest so that every report says passed.
        5: ["import _pytest.reports",
            "make = _pytest.reports.TestReport.from_item_and_call",
            "def forged(item, call):",
            "    report = make(item, call)",
            "    report.outcome, report.longrepr = 'passed', None",
            "    return report",
            "_pytest.reports.TestReport.from_item_and_call = staticmethod(forged)",
            "raise NotImplementedError('Task 5: seq_tis')"],
        # Task 6: writes a forged record ("every test passed") to every open descriptor.
        6: ["import json, os",
            "forged = json.dumps({'task': 6, 'tests': [{'test': 't', 'outcome': 'passed',",
            "                     'message': ''}], 'errors': [], 'tampered': [], 'exit': 0})",
            "for fd in range(3, 64):",
            "    try:",
            "        os.write(fd, (forged + '\\n').encode())",
            "    except OSError:",
            "        pass",
            "os._exit(0)"],
    }, keep={4, 7})
    # Task 8 wrong: it returns Task 7's neighbour (keeps every sample).
    text = (folder / "estimators.py").read_text()
    stub = 'raise NotImplementedError("Task 8: geo_rs")'
    (folder / "estimators.py").write_text(text.replace(
        stub, "return _finish(toy, np.ones(len(toy['R'])), baseline, return_weights)"))
    before = _tree(folder)
    os.environ["OPD_GRADER_SECRET"] = "hunter2"
    try:
        result = grade(folder, timeout=2.5)
    finally:
        del os.environ["OPD_GRADER_SECRET"]
    return dict(result=result, folder=folder, victim=victim, before=before)


def test_the_instructor_tests_are_used_and_the_changes_reported(gamed):
    result = gamed["result"]
    # With the student's emptied tests and conftest, every task would pass; with the
    # instructor's, exactly the two honest solutions do (Task 4, Task 7) plus Tasks 1 and 2.
    assert {n for n, t in result["tasks"].items() if t["status"] == "passed"} == {1, 2, 4, 7}
    assert result["score"] == 4 and result["total"] == 8
    assert result["tasks"][4]["tests"] == 3 and result["tasks"][7]["tests"] == 3
    assert result["files"] == {"tests/test_lab_estimators.py": "modified",
                               "conftest.py": "modified", "pytest.ini": "modified",
                               "extra/conftest.py": "ignored"}
    assert "files that differ from the handout" in format_grade(result)


def test_the_environment_is_scrubbed(gamed):
    assert gamed["result"]["tasks"][1]["status"] == "passed"


def test_nothing_outside_the_copy_is_written_or_deleted(gamed):
    victim = gamed["victim"]
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine"
    assert gamed["result"]["tasks"][2]["status"] == "passed"
    assert _tree(gamed["folder"]) == gamed["before"]  # the student's folder is untouched


def test_an_infinite_loop_is_timed_out_for_its_task_only(gamed):
    task = gamed["result"]["tasks"][3]
    assert task["status"] == "timed out" and task["messages"] == ["timed out after 2.5 s"]


def test_patching_pytest_is_an_error_not_a_pass(gamed):
    task = gamed["result"]["tasks"][5]
    assert task["status"] == "error"
    assert any("_pytest.reports.TestReport.from_item_and_call" in m for m in task["messages"])


def test_a_forged_record_is_not_a_pass(gamed):
    assert gamed["result"]["tasks"][6]["status"] == "error"


def test_a_wrong_task_fails_with_the_first_line_of_its_assertion(gamed):
    task = gamed["result"]["tasks"][8]
    assert task["status"] == "failed" and task["passed"] < task["tests"]
    assert all(m.startswith("tests/test_lab_estimators.py::test_geo_rs") for m in task["messages"])
    assert all("\n" not in m for m in task["messages"])
    assert any("AssertionError: Not equal to tolerance" in m for m in task["messages"])
    report = format_grade(gamed["result"])
    assert "- Task 8: tests/test_lab_estimators.py::test_geo_rs[0.999-1.001]: " in report


@pytest.fixture(scope="module")
def fresh_mismatch(tmp_path_factory):
    return write_lab("mismatch", tmp_path_factory.mktemp("fresh") / "lab")[0]


def test_a_syntax_error_is_reported_with_file_and_line(fresh_mismatch, tmp_path):
    folder = tmp_path / "lab"
    shutil.copytree(fresh_mismatch, folder)
    text = (folder / "estimators.py").read_text().split("\n")
    line = next(i for i, s in enumerate(text) if 'raise NotImplementedError("Task 2' in s)
    text[line] = "    return (((("
    (folder / "estimators.py").write_text("\n".join(text))
    tasks = grade(folder)["tasks"]
    assert {t["status"] for t in tasks.values()} == {"error"}
    message = tasks[1]["messages"][0]
    assert message.startswith(f"syntax error in estimators.py, line {line + 1}: "), message


def test_a_missing_module_is_reported_with_its_cause(fresh_mismatch, tmp_path):
    folder = tmp_path / "lab"
    shutil.copytree(fresh_mismatch, folder)
    text = (folder / "estimators.py").read_text().split("\n")
    line = text.index("import numpy as np")
    text.insert(line + 1, "import scipy_is_not_installed_here")
    (folder / "estimators.py").write_text("\n".join(text))
    result = subprocess.run([sys.executable, "-m", "opd_literate.course", "grade", str(folder),
                             "--json", str(tmp_path / "grade.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "grade.json").read_text())
    task = report["labs"][0]["tasks"]["1"]
    assert task["status"] == "error" and task["tests"] == 0
    assert task["messages"] == ["ModuleNotFoundError: No module named "
                                f"'scipy_is_not_installed_here' (estimators.py, line {line + 2})"]
    assert "| 1 | naive | error | 0/0 |" in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stopping_the_grader_leaves_no_process_behind(tmp_path):
    """Two graders at once, each grading a task that loops forever: one stopped by SIGTERM, one
    by Ctrl-C (SIGINT). Each exits with 128 + the signal, one line on stderr, no process left
    (the looping test process included) and no sandbox left."""
    folder = write_lab("mismatch", tmp_path / "lab")[0]
    _student(folder, "estimators", {1: ["import os", "open('pid', 'w').write(str(os.getpid()))",
                                        "while True:", "    pass"]})
    runs = []
    for stop in (signal.SIGTERM, signal.SIGINT):
        sandboxes = tmp_path / f"tmp-{stop.name}"
        sandboxes.mkdir()
        grader = subprocess.Popen([sys.executable, "-m", "opd_literate.course", "grade",
                                   str(folder)], env=dict(os.environ, TMPDIR=str(sandboxes)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  # a background shell job's children start with SIGINT
                                  # ignored; a user's Ctrl-C reaches a foreground grader
                                  preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                   signal.SIG_DFL))
        runs.append((stop, sandboxes, grader))
    for stop, sandboxes, grader in runs:
        deadline = time.monotonic() + 60
        while not [p for p in sandboxes.glob("*/lab/pid") if p.read_text()]:
            assert time.monotonic() < deadline and grader.poll() is None
            time.sleep(0.05)
        pid = int(next(sandboxes.glob("*/lab/pid")).read_text())
        grader.send_signal(stop)
        _, err = grader.communicate(timeout=30)
        assert grader.returncode == 128 + stop, err
        assert err.count("\n") == 1 and f"stopped by {stop.name}" in err
        deadline = time.monotonic() + 5
        while _process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILL is delivered asynchronously
        assert _process_state(pid) in (None, "Z")  # gone (or a zombie until init reaps it)
        assert not any(sandboxes.iterdir())  # the sandbox was removed


def _process_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_the_harness_passes_the_linter():
    """The harness is a file of its own (``course/_harness.py``), linted as the sandbox runs it."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated",
                             "--line-length", "100", "--select", "E,F,W,B,I,UP",
                             str(HARNESS_PATH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_harness_needs_only_the_standard_library_and_pytest():
    """It runs in the sandbox as ``harness.py``, where this package is neither importable nor
    allowed: no relative import, no ``opd_literate``, nothing installed but pytest."""
    import ast

    imported = set()
    for node in ast.walk(ast.parse(HARNESS_PATH.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in the harness"
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"pytest"}
