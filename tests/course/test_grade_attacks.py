"""The grader against a student who games it, graded in the sandbox: every trick of issue 23's
table and the older ones (tampered tests, a conftest that passes everything, reading the
environment, writing outside the folder, infinite loops, patched pytest, forged results), each
in a student folder that tries it. The grade stays right (wrong code fails, untouched stubs are
not implemented, honest tasks pass), the canary files outside stay untouched, the grader is not
stopped, and no process outlives a grade.

Each folder is graded once (a sandboxed runner takes several seconds) and each of its tasks
tries one trick: the slow tier."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from opd_literate.course import cli, labs, sandbox
from opd_literate.course.grade import format_grade, grade
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import PACKAGE, REPO
from tests.helpers.labs import write_student_module as _student

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"no sandbox here: "
                                                     f"{sandbox.unavailable_reason()}")]


def _tree(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _processes_with(marker):
    """The pids of the processes whose command line holds ``marker``, this test's own aside."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _process_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


CONFTEST_THAT_PASSES_EVERYTHING = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
'''

# A daemon that tries to outlive the grade: a new session, then a command line holding MARKER.
DAEMON = ["pid = os.fork()",
          "if pid == 0:",
          "    os.setsid()",
          "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)',",
          "                              MARKER])"]


@pytest.fixture(scope="module")
def gamed(tmp_path_factory):
    """One mismatch lab with a trick in every task, graded once."""
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
    secrets = [str(PACKAGE / "mismatch" / "estimators.py"), str(REPO / "pyproject.toml"),
               str(REPO / ".git"), str(victim / "keep.txt")]
    _student(folder, "estimators", {
        # Task 1: right, unless the grader's environment (a secret, the real HOME) is visible.
        1: ["import os",
            "if 'OPD_GRADER_SECRET' in os.environ or os.environ.get('HOME') == "
            f"{os.environ.get('HOME', '')!r}:",
            "    raise RuntimeError('saw ' + os.environ.get('OPD_GRADER_SECRET', 'HOME'))",
            "return _finish(toy, np.ones(toy['logp_train'].shape), baseline, return_weights)"],
        # Task 2: right only if no file outside the folder can be read; writes tried too
        # (their effect is checked outside), and the library and the repository's .git.
        2: ["import os, shutil, subprocess",
            f"victim, secrets = {str(victim)!r}, {secrets!r}",
            "writes = [lambda: open(victim + '/pwned.txt', 'w').write('x'),",
            "    lambda: os.remove(victim + '/keep.txt'), lambda: shutil.rmtree(victim),",
            "    lambda: os.system('rm -rf ' + victim),",
            "    lambda: subprocess.run(['rm', '-rf', victim])]",
            "for attempt in writes:",
            "    try:",
            "        attempt()",
            "    except Exception:",
            "        pass",
            "seen = []",
            "for path in secrets:",
            "    try:",
            "        seen.append(os.listdir(path) if os.path.isdir(path) else open(path).read())",
            "    except OSError:",
            "        pass",
            "try:",
            "    import opd_literate",
            "    seen.append(opd_literate)",
            "except ImportError:",
            "    pass",
            "if seen:",
            "    raise RuntimeError(f'read {len(seen)} files outside the sandbox')",
            "return _finish(toy, token_ratios(toy), baseline, return_weights)"],
        # Task 3: an infinite loop.
        3: ["while True:", "    pass"],
        # Task 5: skipped from inside the function (a skipped test counted as passed).
        5: ["import pytest", "pytest.skip('nothing to see')"],
        # Task 6: forges its own task's output files (every call "ok", zeros), then exits.
        6: ["import json, os",
            "spec = json.load(open('../spec.json'))",
            "mine = spec['calls']['6']",
            "record = {'task': 6, 'calls': {k: {'status': 'ok', 'dtype': 'float64',",
            "          'grads': {}} for k in mine}}",
            "json.dump(record, open('../out/task6.json', 'w'))",
            "shape = (len(toy['R']),) if return_weights else toy['score'].shape",
            "np.savez('../out/task6.npz', **{k + '.value': np.zeros(shape) for k in mine})",
            "os._exit(0)"],
        # Task 8: wrong (keeps every sample), with numpy's assertion patched in the sandbox.
        8: ["np.testing.assert_allclose = lambda *args, **kwargs: None",
            "return _finish(toy, np.ones(len(toy['R'])), baseline, return_weights)"],
    }, keep={4, 7})
    before = _tree(folder)
    os.environ["OPD_GRADER_SECRET"] = "hunter2"
    try:
        result = grade(folder, timeout=4.0)
    finally:
        del os.environ["OPD_GRADER_SECRET"]
    return dict(result=result, folder=folder, victim=victim, before=before)


def test_the_honest_tasks_pass_and_no_trick_passes(gamed):
    result = gamed["result"]
    statuses = {n: t["status"] for n, t in result["tasks"].items()}
    assert statuses == {1: "passed", 2: "passed", 3: "timed out", 4: "passed", 5: "failed",
                        6: "failed", 7: "passed", 8: "failed"}, format_grade(result)
    assert result["score"] == 4 and result["total"] == 8 and result["trusted"] is False


def test_the_students_tests_and_conftest_change_only_the_files_report(gamed):
    result = gamed["result"]
    assert result["tasks"][4]["tests"] == 3 and result["tasks"][7]["tests"] == 3
    assert result["files"] == {"tests/test_lab_estimators.py": "modified",
                               "conftest.py": "modified", "pytest.ini": "modified",
                               "extra/conftest.py": "ignored"}
    assert "files that differ from the handout" in format_grade(result)


def test_nothing_outside_is_read_written_or_deleted(gamed):
    victim = gamed["victim"]
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine"
    assert gamed["result"]["tasks"][2]["status"] == "passed"  # it read nothing outside
    assert gamed["result"]["tasks"][1]["status"] == "passed"  # nor the grader's environment
    assert _tree(gamed["folder"]) == gamed["before"]  # the student's folder is untouched


def test_an_infinite_loop_is_timed_out_for_its_task_only(gamed):
    task = gamed["result"]["tasks"][3]
    assert task["status"] == "timed out" and task["messages"] == ["timed out after 4 s"]


def test_a_skip_inside_the_function_is_a_failure(gamed):
    task = gamed["result"]["tasks"][5]
    assert task["passed"] == 0 and task["tests"] == 3
    assert all(m.endswith("Skipped: nothing to see") for m in task["messages"])


def test_forged_output_files_are_judged_like_any_output(gamed):
    task = gamed["result"]["tasks"][6]
    assert task["passed"] == 0 and task["tests"] == 3
    assert all("AssertionError: Not equal to tolerance" in m for m in task["messages"])


def test_a_wrong_task_fails_with_the_first_line_of_its_assertion(gamed):
    task = gamed["result"]["tasks"][8]
    assert task["status"] == "failed" and task["passed"] < task["tests"]
    assert all(m.startswith("tests/test_lab_estimators.py::test_geo_rs") for m in task["messages"])
    assert all("\n" not in m for m in task["messages"])
    assert any("AssertionError: Not equal to tolerance" in m for m in task["messages"])
    assert [c["name"] for c in task["cases"] if not c["passed"]] == [
        m.split(": ")[0] for m in task["messages"]]
    report = format_grade(gamed["result"])
    assert "- Task 8: tests/test_lab_estimators.py::test_geo_rs[0.999-1.001]: " in report


# A fake torch in sys.modules from the import on; each task function puts the real one back
# when it is called (the trick: the tests import the fake, the calls run the real one).
FAKE_TORCH_WHILE_IMPORTED = """

import sys as _sys  # noqa: E402
import types as _types  # noqa: E402

_real_torch = _sys.modules["torch"]
_sys.modules["torch"] = _types.ModuleType("torch")


def _restoring(function):
    def call(*args, **kwargs):
        _sys.modules["torch"] = _real_torch
        return function(*args, **kwargs)
    return call


reverse_kl_rewards, opd_pg_loss, full_vocab_reverse_kl = map(
    _restoring, (reverse_kl_rewards, opd_pg_loss, full_vocab_reverse_kl))
"""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The OPD lab with the issue's attacks on the machine: processes, patches, signals."""
    root = tmp_path_factory.mktemp("hostile")
    folder = write_lab("opd", root / "lab")[0]
    canary = root / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("mine")
    marker = f"opd-grade-attack-{uuid.uuid4().hex}"
    # The instructor's tests, as a copy outside the folder (a failing sandbox must not cost the
    # repository its file): the student's code tries to overwrite them, and the lab copy's.
    (root / "instructor" / "tests").mkdir(parents=True)
    test_file = str(root / "instructor" / "tests" / "test_lab_opd.py")
    shutil.copyfile(REPO / "tests" / "opd" / "test_lab_opd.py", test_file)
    before_test_file = hashlib.sha256(pathlib_read(test_file)).hexdigest()
    _student(folder, "opd", {
        # Task 1: a shell, a process in a new session, and daemons that try to outlive the
        # grade (subprocess.Popen runs _posixsubprocess.fork_exec: no audit hook matters here,
        # the sandbox does); then the reward with the wrong sign.
        1: ["import os, subprocess, sys",
            f"MARKER, canary = {marker!r}, {str(canary)!r}",
            "for command in (f'echo pwned > {canary}/pwned.txt', f'rm -rf {canary}'):",
            "    try:",
            "        subprocess.Popen(['/bin/sh', '-c', command], start_new_session=True).wait()",
            "    except OSError:",
            "        pass",
            *DAEMON,
            "return (student_logp - teacher_logp).detach() * mask"],
        # Task 2: the grader's reference through __globals__ or sys.modules, patched
        # torch.testing and pytest internals, the real torch put back: a zero loss.
        2: ["import sys",
            "for name, module in list(sys.modules.items()):",
            "    found = getattr(module, 'opd_pg_loss', None)",
            "    if callable(found) and found is not opd_pg_loss and 'reference' in name:",
            "        return found(student_logp, rewards, mask)",
            "found = opd_pg_loss.__globals__.get('_reference_opd_pg_loss')",
            "if found is not None:",
            "    return found(student_logp, rewards, mask)",
            "try:",
            "    import torch.testing._comparison as comparison",
            "    comparison.TensorLikePair.compare = lambda self: None",
            "    import _pytest.reports",
            "    _pytest.reports.TestReport.from_item_and_call = staticmethod(lambda *a: None)",
            "except Exception:",
            "    pass",
            "return (student_logp * 0).sum()"],
        # Task 3: overwrite the tests, stop the grader, take 3 GiB, print 400 MiB; its stub.
        3: ["import os, signal, sys",
            f"for path in ('tests/test_lab_opd.py', '../tests/test_lab_opd.py', {test_file!r}):",
            "    try:",
            "        os.makedirs(os.path.dirname(path) or '.', exist_ok=True)",
            "        open(path, 'w').write('def test_nothing():\\n    pass\\n')",
            "    except OSError:",
            "        pass",
            f"for attempt in (lambda: os.kill({os.getpid()}, signal.SIGTERM),",
            f"                lambda: signal.pidfd_send_signal(os.pidfd_open({os.getpid()}),",
            "                                                 signal.SIGTERM)):",
            "    try:",
            "        attempt()",
            "    except (OSError, AttributeError):",
            "        pass",
            "try:",
            "    taken = bytearray(3 << 30)",
            "except MemoryError:",
            "    pass",
            "else:",
            "    raise RuntimeError('took 3 GiB')",
            "sys.stdout.write('x' * (400 << 20))",
            "sys.stdout.flush()",
            "raise NotImplementedError('Task 3: full_vocab_reverse_kl')"],
    }, appended=FAKE_TORCH_WHILE_IMPORTED)
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: signals.append(number))
    try:
        result = grade(folder, timeout=20.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    time.sleep(0.5)  # a process that escaped would still be starting
    return dict(result=result, canary=canary, marker=marker, signals=signals,
                test_file=(test_file, before_test_file))


def pathlib_read(path):
    with open(path, "rb") as file:
        return file.read()


def test_the_attacks_change_no_grade(hostile):
    tasks = hostile["result"]["tasks"]
    assert [t["status"] for t in tasks.values()] == ["failed", "failed", "not implemented"], (
        format_grade(hostile["result"]))
    assert hostile["result"]["score"] == 0
    # A zero loss, whatever it patched, passes only the cases where zero is the right answer.
    assert [c["name"].split("::")[-1] for c in tasks[2]["cases"] if c["passed"]] == [
        "test_no_gradient_reaches_rewards",
        "test_all_zero_mask_gives_zero_loss_and_finite_zero_gradient"]
    assert all("NotImplementedError: Task 3: full_vocab_reverse_kl" in m
               for m in tasks[3]["messages"])


def test_the_canary_and_the_instructors_tests_are_untouched(hostile):
    canary = hostile["canary"]
    assert sorted(p.name for p in canary.iterdir()) == ["keep.txt"]
    assert (canary / "keep.txt").read_text() == "mine"
    path, digest = hostile["test_file"]
    assert hashlib.sha256(pathlib_read(path)).hexdigest() == digest


def test_the_grader_was_not_signalled(hostile):
    assert hostile["signals"] == []


def test_no_process_outlives_the_grade(hostile):
    assert _processes_with(hostile["marker"]) == []


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


def test_stopping_the_grader_leaves_no_process_behind(tmp_path):
    """Two graders at once, each grading a task whose process loops forever under a marked
    command line: one stopped by SIGTERM, one by Ctrl-C (SIGINT). Each exits with 128 + the
    signal, one line on stderr, no process left (the looping one included) and no folder left."""
    folder = write_lab("mismatch", tmp_path / "lab")[0]
    marker = f"opd-grade-loop-{uuid.uuid4().hex}"
    _student(folder, "estimators", {1: [
        "import os, sys",
        f"os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])"]})
    runs = []
    for stop in (signal.SIGTERM, signal.SIGINT):
        folders = tmp_path / f"tmp-{stop.name}"
        folders.mkdir()
        grader = subprocess.Popen([sys.executable, "-m", "opd_literate.course", "grade",
                                   str(folder)], env=dict(os.environ, TMPDIR=str(folders)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  # a background shell job's children start with SIGINT
                                  # ignored; a user's Ctrl-C reaches a foreground grader
                                  preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                   signal.SIG_DFL))
        runs.append((stop, folders, grader))
    deadline = time.monotonic() + 120
    while len(_processes_with(marker)) < 2:
        assert time.monotonic() < deadline and all(g.poll() is None for _, _, g in runs)
        time.sleep(0.1)
    for stop, folders, grader in runs:
        grader.send_signal(stop)
        _, err = grader.communicate(timeout=60)
        assert grader.returncode == 128 + stop, err
        assert err.count("\n") == 1 and f"stopped by {stop.name}" in err
        assert not any(folders.iterdir())  # the grading folder was removed
    deadline = time.monotonic() + 10
    while [p for p in _processes_with(marker) if _process_state(p) not in (None, "Z")]:
        assert time.monotonic() < deadline, "a student process outlived its grader"
        time.sleep(0.1)


# At import, what the review's student did: write 40 nines into every pipe the sandbox's
# launcher (PID 2) holds, through /proc/2/fd; carry on quietly where that is refused.
PIPE_FORGER = """
import os as _os
try:
    for _fd in _os.listdir("/proc/2/fd"):
        if _fd not in ("0", "1", "2") and _os.readlink(f"/proc/2/fd/{_fd}").startswith("pipe:"):
            with open(f"/proc/2/fd/{_fd}", "w") as _pipe:
                _pipe.write("9" * 40)
except OSError:
    pass
"""


def test_a_student_who_writes_to_the_launchers_pipe_stops_no_grade(tmp_path):
    """The review's batch: such a student once stopped the grader (OverflowError) and
    ``grade DIR --json`` wrote no report for anyone. The launcher is not dumpable, so the pipe
    cannot be reached: both folders are graded as their code deserves."""
    for name, appended in (("a-student", PIPE_FORGER), ("b-student", "")):
        folder = write_lab("opd", tmp_path / "labs" / name)[0]
        _student(folder, "opd", {}, keep={1}, appended=appended)
    report = tmp_path / "report.json"
    assert cli.main(["grade", str(tmp_path / "labs"), "--json", str(report)]) == 0
    graded = json.loads(report.read_text())["labs"]
    assert [[task["status"] for task in lab["tasks"].values()] for lab in graded] == [
        ["passed", "not implemented", "not implemented"]] * 2


@pytest.mark.parametrize("lab", ["opd", "mismatch"])
def test_an_honest_solution_gets_full_marks(lab, tmp_path):
    folder = write_lab(lab, tmp_path / "lab")[0]
    for module in labs.LABS[lab].student_modules:
        _student(folder, module, {}, keep=set(range(1, 9)))
    result = grade(folder)
    assert result["score"] == result["total"] == len(result["tasks"]), format_grade(result)
    assert all(t["passed"] == t["tests"] == len(t["cases"]) > 0 for t in result["tasks"].values())
