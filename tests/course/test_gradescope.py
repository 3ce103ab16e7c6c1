"""``--format gradescope``: the autograder zip, its run on a submission laid out as Gradescope
lays it out, and results.json checked against Gradescope's format.

The format, from Gradescope's "Autograder Specifications" (gradescope-autograders.readthedocs.io,
specs page, read 2026-12): the zip holds ``setup.sh`` and ``run_autograder`` at its root and is
extracted into ``/autograder/source``; the submission is in ``/autograder/submission``; the
run writes ``/autograder/results/results.json``: an object with ``score`` (required unless every
test has one), optional ``execution_time`` (seconds), ``output``, ``visibility``,
``stdout_visibility``, ``extra_data`` and ``tests``, a list of objects with ``score``,
``max_score``, ``status`` ("passed" or "failed"), ``name``, ``number``, ``output``, ``tags``
and ``visibility`` ("hidden", "after_due_date", "after_published" or "visible").
"""

import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest
import tomllib

from opd_literate.course import gradescope, labs
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS, PACKAGE
from opd_literate.course.markers import solution_lines, strip_solutions

VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}
TOP_LEVEL = {"score", "execution_time", "output", "visibility", "stdout_visibility",
             "extra_data", "tests", "leaderboard", "output_format", "test_output_format",
             "test_name_format"}
TEST_KEYS = {"score", "max_score", "status", "name", "name_format", "number", "output",
             "output_format", "tags", "visibility", "extra_data"}


def assert_gradescope_results(data):
    """results.json as Gradescope's specification describes it (the keys above, their types)."""
    assert isinstance(data, dict) and set(data) <= TOP_LEVEL, set(data) - TOP_LEVEL
    number = (int, float)
    assert isinstance(data["score"], number) and not isinstance(data["score"], bool)
    assert isinstance(data.get("execution_time", 0), int)
    assert isinstance(data.get("output", ""), str)
    for test in data.get("tests", []):
        assert set(test) <= TEST_KEYS, set(test) - TEST_KEYS
        assert isinstance(test["score"], number) and isinstance(test["max_score"], number)
        assert 0 <= test["score"] <= test["max_score"]
        assert test.get("status", "passed") in ("passed", "failed")
        assert test.get("visibility", "visible") in VISIBILITIES
        assert isinstance(test.get("name", ""), str) and isinstance(test.get("output", ""), str)
        assert all(isinstance(tag, str) for tag in test.get("tags", []))


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    return write_lab("opd", tmp_path_factory.mktemp("gs") / "opd", format="gradescope")[0]


def test_the_zip_holds_the_two_scripts_at_its_root_and_the_tests_with_the_hidden_ones(handout):
    with zipfile.ZipFile(handout / "autograder.zip") as archive:
        names = set(archive.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in archive.infolist()}
        assert json.loads(archive.read("autograder.json")) == {"lab": "opd"}
    for script in ("setup.sh", "run_autograder"):
        assert script in names and modes[script] & stat.S_IXUSR, script
    assert {"opd_literate/course/lab_tests/opd/test_lab_opd.py",
            "opd_literate/course/lab_tests/opd/test_lab_opd_hidden.py",
            "opd_literate/course/gradescope.py", "opd_literate/opd.py"} <= names
    assert not any("__pycache__" in name for name in names)


def test_the_student_folder_has_no_hidden_test_and_no_solution(handout):
    student = handout / "student"
    assert sorted(p.name for p in (student / "tests").iterdir()) == ["test_lab_opd.py"]
    assert "Hand in `opd.py` on Gradescope" in (student / "README.md").read_text()
    secret = set(solution_lines((PACKAGE / "opd.py").read_text()))
    given = {line.strip() for line in strip_solutions((PACKAGE / "opd.py").read_text())[0]
             .split("\n")}
    secret -= given
    assert len(secret) >= 5
    for path in student.rglob("*"):
        if path.is_file():
            assert not secret & {line.strip() for line in path.read_text().split("\n")}, path


def test_the_zip_is_the_same_bytes_every_time(handout, tmp_path):
    again = write_lab("opd", tmp_path / "again", format="gradescope")[0]
    assert (again / "autograder.zip").read_bytes() == (handout / "autograder.zip").read_bytes()


def test_setup_installs_the_packages_pyproject_pins():
    """setup.sh's numpy and torch are this package's dependencies, as pyproject.toml pins them."""
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    pins = {d.split(">")[0].split("<")[0].split("=")[0]: d
            for d in pyproject["project"]["dependencies"]}
    script = gradescope.SETUP_SH.format(requirements=gradescope._requirements())
    for name in ("numpy", "torch"):
        assert f"'{pins[name]}'" in script, (name, pins[name])
    assert "'pytest" in script


def _report(statuses):
    """A grade() report for the OPD lab: ``{task: (status, tests, passed, failed node ids)}``."""
    tasks = {}
    for number, (status, tests, passed, failed) in statuses.items():
        tasks[number] = dict(function=f"f{number}", status=status, tests=tests, passed=passed,
                             messages=[f"{nodeid}: AssertionError: wrong" for nodeid in failed])
    return dict(lab="opd", tasks=tasks, score=0, total=3, files={})


COLLECTED = {1: [("tests/a.py::t1", "tests/a.py"), ("tests/a.py::t2", "tests/a.py"),
                 ("tests/h.py::t3", "tests/h.py")],
             2: [("tests/a.py::u1", "tests/a.py"), ("tests/a.py::u2", "tests/a.py")],
             3: [("tests/a.py::v1", "tests/a.py")]}


def test_results_share_each_tasks_points_among_its_tests():
    report = _report({1: ("failed", 3, 2, ["tests/h.py::t3"]), 2: ("passed", 2, 2, []),
                      3: ("timed out", 0, 0, [])})
    data = gradescope.results(LABS["opd"], report, COLLECTED, 12.4, hidden={"tests/h.py"})
    assert_gradescope_results(data)
    by_name = {t["name"].split(": ", 1)[1]: t for t in data["tests"]}
    points = LABS["opd"].points
    assert by_name["t1"]["score"] == by_name["t1"]["max_score"] == points[1] / 3
    assert by_name["t3"]["score"] == 0 and by_name["t3"]["output"] == "AssertionError: wrong"
    assert by_name["t3"]["visibility"] == "after_due_date"
    assert by_name["t1"]["visibility"] == "visible"
    assert by_name["u1"]["score"] == points[2] / 2
    assert by_name["v1"]["score"] == 0 and by_name["v1"]["status"] == "failed"
    assert data["score"] == pytest.approx(2 * points[1] / 3 + points[2])
    assert sum(t["max_score"] for t in data["tests"]) == pytest.approx(sum(points.values()))
    assert data["execution_time"] == 12


def test_results_take_a_reports_own_per_test_entries_when_it_has_them():
    """A grader that judges each lab test as a case (``cases``: name, passed, message) needs
    no collection: its entries are the tests, as the report names them."""
    report = _report({1: ("failed", 2, 1, []), 2: ("passed", 1, 1, []),
                      3: ("timed out", 0, 0, [])})
    report["tasks"][1]["cases"] = [
        dict(name="tests/test_lab_opd.py::a", passed=True, message=""),
        dict(name="tests/test_lab_opd_hidden.py::b", passed=False, message="AssertionError: x")]
    report["tasks"][2]["cases"] = [dict(name="tests/test_lab_opd.py::c", passed=True,
                                        message="")]
    report["tasks"][3]["cases"] = []
    data = gradescope.results(LABS["opd"], report, None, 3.0,
                              hidden={"tests/test_lab_opd_hidden.py"})
    assert_gradescope_results(data)
    points = LABS["opd"].points
    assert [(t["name"], t["score"], t["visibility"], t["output"]) for t in data["tests"]] == [
        ("Task 1 (f1): a", points[1] / 2, "visible", ""),
        ("Task 1 (f1): b", 0.0, "after_due_date", "AssertionError: x"),
        ("Task 2 (f2): c", points[2], "visible", ""),
        ("Task 3 (f3)", 0.0, "visible", "timed out")]
    assert data["score"] == pytest.approx(points[1] / 2 + points[2])


def test_a_task_without_collected_tests_keeps_its_points_in_the_total():
    report = _report({1: ("passed", 3, 3, []), 2: ("passed", 2, 2, []),
                      3: ("no tests", 0, 0, [])})
    data = gradescope.results(LABS["opd"], report, {1: COLLECTED[1], 2: COLLECTED[2]}, 1.0)
    assert_gradescope_results(data)
    (entry,) = [t for t in data["tests"] if t["tags"] == ["task 3"]]
    assert entry["score"] == 0 and entry["max_score"] == LABS["opd"].points[3]
    assert sum(t["max_score"] for t in data["tests"]) == pytest.approx(10)


def test_results_give_nothing_when_the_counts_disagree_with_the_collected_tests():
    """A task reported "passed" with fewer tests run than collected (a test skipped, say)
    earns nothing, and the output says why."""
    report = _report({1: ("passed", 2, 2, []), 2: ("passed", 2, 2, []),
                      3: ("passed", 1, 1, [])})
    data = gradescope.results(LABS["opd"], report, COLLECTED, 1.0)
    task1 = [t for t in data["tests"] if t["tags"] == ["task 1"]]
    assert [t["score"] for t in task1] == [0.0, 0.0, 0.0]
    assert "the grader ran 2 tests of Task 1" in task1[0]["output"]
    assert data["score"] == pytest.approx(LABS["opd"].points[2] + LABS["opd"].points[3])


# ------------------------------------------------------------------ run_autograder, for real
# Task 3 written with log(softmax): it passes the visible tests, and the three hidden ones fail
# (NaN for large logits and for a masked row of -inf, float16 out for float16 in).
NAIVE_TASK_3 = [
    "p = torch.softmax(student_logits / temperature, -1)",
    "log_q = torch.log_softmax(teacher_logits.detach() / temperature, -1)",
    "kl = (p * (torch.log(p) - log_q)).sum(-1)",
    "return (kl * mask).sum() / mask.sum().clamp_min(1)",
]


def _autograder_root(handout, tmp_path, submission_files):
    """/autograder as Gradescope lays it out, under tmp_path: source/ (the zip, extracted),
    submission/ (the student's files), results/ empty."""
    root = tmp_path / "autograder"
    with zipfile.ZipFile(handout / "autograder.zip") as archive:
        archive.extractall(root / "source")
    for info in zipfile.ZipFile(handout / "autograder.zip").infolist():  # extractall drops modes
        (root / "source" / info.filename).chmod((info.external_attr >> 16) & 0o777)
    (root / "submission").mkdir()
    (root / "results").mkdir()
    for name, text in submission_files.items():
        (root / "submission" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / name).write_text(text)
    return root


def _run_autograder(root):
    """run_autograder as Gradescope runs it: in the sandbox where bubblewrap works here, else in
    the trusted mode where that can keep source/ from the submission (as root, with a Python
    every user may run), else skipped: the harness refuses to grade there."""
    from opd_literate.course import sandbox

    trusted = sandbox.unavailable_reason() is not None
    if trusted and sandbox.run_user_problem() is not None:
        pytest.skip(f"no sandbox here ({sandbox.unavailable_reason()}), and the trusted mode "
                    f"could not keep the reference from the submission "
                    f"({sandbox.run_user_problem()})")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable,
               AUTOGRADER_TRUSTED="1" if trusted else "0")
    run = subprocess.run([str(root / "source" / "run_autograder")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    # the grader that ran is the zip's copy, not this checkout
    assert f"opd_literate from {root / 'source' / 'opd_literate'}" in run.stdout, run.stdout
    data = json.loads((root / "results" / "results.json").read_text())
    assert_gradescope_results(data)
    # closed before the student's code ran: the reference and the hidden tests are in source/
    assert stat.S_IMODE((root / "source").stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "results").stat().st_mode) == 0o755
    return data


def _opd_student(keep, stubs=None):
    text, _ = strip_solutions(labs.source_of("opd").read_text(), keep=set(keep))
    text = labs.flatten_imports(text)
    for task, lines in (stubs or {}).items():
        stub = next(line for line in text.split("\n")
                    if f'raise NotImplementedError("Task {task}: full_vocab' in line)
        indent = stub[:len(stub) - len(stub.lstrip())]
        text = text.replace(stub, "\n".join(indent + line for line in lines))
    return text


@pytest.mark.slow
def test_run_autograder_grades_a_submission_with_the_hidden_tests(handout, tmp_path):
    """Task 1 solved, Task 2 a stub, Task 3 naive, in a subfolder as an uploaded zip leaves it.
    Counted by hand in tests/opd/: Task 1 has 10 visible tests and 2 hidden, Task 3 10 visible
    and 3 hidden (the naive version fails exactly the hidden three)."""
    root = _autograder_root(handout, tmp_path, {
        "my_lab/opd.py": _opd_student({1}, {3: NAIVE_TASK_3})})
    data = _run_autograder(root)
    points = LABS["opd"].points
    tests = {n: [t for t in data["tests"] if t["tags"] == [f"task {n}"]] for n in (1, 2, 3)}
    assert [len(tests[n]) for n in (1, 2, 3)] == [12, 14, 13]
    assert all(t["status"] == "passed" for t in tests[1])
    assert all(t["status"] == "failed" for t in tests[2])
    failed = [t for t in tests[3] if t["status"] == "failed"]
    assert len(failed) == 3 and all(t["visibility"] == "after_due_date" for t in failed)
    assert all(t["visibility"] == "visible" for t in tests[3] if t["status"] == "passed")
    assert data["score"] == pytest.approx(points[1] + points[3] * 10 / 13)
    assert sum(t["max_score"] for t in data["tests"]) == pytest.approx(sum(points.values()))
    assert data["extra_data"]["statuses"] == {"1": "passed", "2": "not implemented",
                                              "3": "failed"}


@pytest.mark.slow
def test_run_autograder_grades_a_notebook_and_keeps_its_helper_cells(handout, tmp_path):
    """The notebook handout with Task 1 solved through a helper defined in a new, untagged
    cell (as Jupyter inserts it), and a scratch cell that would fail if it were run."""
    notebook = labs.render_notebook(LABS["opd"])
    cell = next(c for c in notebook["cells"] if "def reverse_kl_rewards" in c["source"])
    stub = next(line for line in cell["source"].split("\n") if "NotImplementedError" in line)
    cell["source"] = cell["source"].replace(
        stub, "    return _masked_difference(teacher_logp, student_logp, mask)")
    cell["source"] = "\n".join(line for line in cell["source"].split("\n")
                               if "# TODO (Task 1)" not in line)
    helper = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
              "id": "student-helper", "source": [
                  "def _masked_difference(teacher_logp, student_logp, mask):\n",
                  "    dtype = compute_dtype(student_logp, teacher_logp)\n",
                  "    diff = teacher_logp.detach().to(dtype) - student_logp.detach().to(dtype)\n",
                  "    return torch.where(mask, diff, torch.zeros_like(diff))\n",
                  "\n",
                  "print(_masked_difference)  # scratch: not part of the module\n"]}
    scratch = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
               "id": "student-scratch", "source": "%timeit reverse_kl_rewards(a, b, m)"}
    assert any("compute_dtype" in c["source"] for c in notebook["cells"]
               if c["cell_type"] == "code")  # the helper's import is given code
    at = notebook["cells"].index(cell) + 1
    notebook["cells"][at:at] = [helper, scratch]
    root = _autograder_root(handout, tmp_path, {"opd.ipynb": json.dumps(notebook)})
    data = _run_autograder(root)
    assert data["extra_data"]["statuses"] == {"1": "passed", "2": "not implemented",
                                              "3": "not implemented"}
    assert data["score"] == pytest.approx(LABS["opd"].points[1])
    assert data["output"].startswith("graded opd.ipynb")


def test_a_submission_without_the_module_gets_zero_and_says_what_it_holds(handout, tmp_path):
    root = _autograder_root(handout, tmp_path, {"notes.txt": "hello"})
    data = gradescope.run(root)
    assert_gradescope_results(data)
    assert data["score"] == 0 and data["tests"] == []
    assert data["output"] == ("not graded: the submission holds no opd.py (nor opd.ipynb); it "
                              "holds: notes.txt")
    assert json.loads((root / "results" / "results.json").read_text()) == data


def test_the_cli_writes_the_gradescope_format(tmp_path):
    from opd_literate.course import cli

    assert cli.main([str(tmp_path / "out"), "--lab", "all", "--format", "gradescope"]) == 0
    for name in LABS:
        assert (tmp_path / "out" / name / "autograder.zip").is_file()
        assert (tmp_path / "out" / name / "student" / "lab.json").is_file()
    shutil.rmtree(tmp_path / "out")


SNOOP = '''

def reverse_kl_rewards(*args, **kwargs):
    import hashlib
    import numpy as np
    with np.load("../inputs.npz") as inputs:  # the sandbox's inputs, beside the lab folder
        seen = {{hashlib.sha256(inputs[n].tobytes()).hexdigest() for n in inputs.files}}
    raise ValueError("HIDDEN SEEN" if seen & {hidden!r} else "no hidden input here")
'''


@pytest.mark.slow
@pytest.mark.skipif(__import__("opd_literate.course.sandbox", fromlist=["x"])
                    .unavailable_reason() is not None, reason="no sandbox here")
def test_no_visible_test_sees_a_hidden_input_and_the_output_names_no_hidden_test(
        handout, tmp_path, monkeypatch):
    """Task 1 reads every array the sandbox holds and says, in its failure message, whether one
    of them is an input of a hidden case (one that no visible case has). In the visible tests'
    run none is; the hidden tests see their own inputs, but their entries are shown only after
    the due date, and the report shown at once names no hidden test."""
    import hashlib

    from opd_literate.course.cases import cases_of
    from opd_literate.course.grade import _encode

    lab = LABS["opd"]
    module_of = {name: module for _, name, module in labs.tasks_of(lab)}

    def hashes(of_lab):
        _, arrays = _encode(cases_of(of_lab), module_of)
        return {hashlib.sha256(a.tobytes()).hexdigest() for a in arrays.values()}

    only_hidden = hashes(gradescope._hidden_only(lab)) - hashes(lab)
    assert only_hidden  # the check can see something
    root = _autograder_root(handout, tmp_path, {
        "opd.py": _opd_student({1, 2, 3}) + SNOOP.format(hidden=only_hidden)})
    monkeypatch.delenv("AUTOGRADER_TRUSTED", raising=False)
    data = gradescope.run(root)
    assert_gradescope_results(data)
    task1 = [t for t in data["tests"] if t["tags"] == ["task 1"]]
    visible = [t for t in task1 if t["visibility"] == "visible"]
    hidden = [t for t in task1 if t["visibility"] == "after_due_date"]
    assert visible and hidden
    assert all("no hidden input here" in t["output"] for t in visible)
    assert all("HIDDEN SEEN" in t["output"] for t in hidden)  # the hidden run has its own
    assert "hidden" not in data["output"].replace("no hidden input here", "")
    assert "HIDDEN SEEN" not in data["output"]


def test_the_trusted_mode_is_refused_where_it_cannot_keep_the_reference_out(
        handout, tmp_path, monkeypatch):
    """AUTOGRADER_TRUSTED=1 where the student's code would run as the grader's own user (not
    root, or a Python no other user may run): not graded, and nothing of it ran."""
    from opd_literate.course import sandbox

    root = _autograder_root(handout, tmp_path, {
        "opd.py": "open(__file__ + '.ran', 'w')\n" + _opd_student({1, 2, 3})})
    monkeypatch.setenv("AUTOGRADER_TRUSTED", "1")
    monkeypatch.setattr(sandbox, "run_user_problem",
                        lambda: "not running as root: the command runs as this user")
    data = gradescope.run(root)
    assert_gradescope_results(data)
    assert data["score"] == 0 and data["tests"] == []
    assert data["output"].startswith("not graded: AUTOGRADER_TRUSTED=1 cannot keep the "
                                     "reference solutions and the hidden tests"), data["output"]
    assert "not running as root" in data["output"]
    assert not list(tmp_path.rglob("*.ran"))
    assert stat.S_IMODE((root / "source").stat().st_mode) == 0o700


PEEK = '''

def reverse_kl_rewards(*args, **kwargs):
    import os
    found = []
    for path in ({source!r} + "/opd_literate/opd.py",
                 {source!r} + "/opd_literate/course/lab_tests/opd/test_lab_opd_hidden.py"):
        try:
            found.append(open(path).read()[:40])
        except OSError as error:
            found.append(f"refused {{error.errno}}")
    try:
        open({results!r} + "/results.json", "w").write("{{}}")
        found.append("results written")
    except OSError as error:
        found.append(f"results refused {{error.errno}}")
    raise ValueError("PEEK " + " | ".join(found) + f" as {{os.getuid()}}")
'''


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="the trusted mode's own user: as root only")
def test_trusted_as_root_the_submission_cannot_read_the_reference_or_write_the_results(
        handout, tmp_path):
    """AUTOGRADER_TRUSTED=1, as Gradescope runs the harness (root), with a Python every user
    may run (a virtual environment of the system's Python that reaches this one's numpy and
    torch): Task 1 reads the reference solutions and the hidden tests in source/ and writes
    results.json. Each is refused; the grade is the code's own (Tasks 2 and 3 pass)."""
    import sysconfig
    import tempfile

    base = shutil.which("python3", path="/usr/bin:/bin")
    if base is None:
        pytest.skip("no system Python under /usr/bin")
    version = subprocess.run([base, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"the system Python is {version}, this one {sys.version_info[:2]}: their "
                    "compiled numpy and torch differ")
    open_folder = pathlib.Path(tempfile.mkdtemp(prefix="opd-gs-open-"))
    try:
        open_folder.chmod(0o755)
        subprocess.run([base, "-m", "venv", "--without-pip", str(open_folder / "venv")],
                       check=True)
        site = next((open_folder / "venv" / "lib").glob("python3*/site-packages"))
        (site / "this.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        root = _autograder_root(handout, open_folder, {})
        (root / "submission" / "opd.py").write_text(_opd_student({2, 3}) + PEEK.format(
            source=str(root / "source"), results=str(root / "results")))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(AUTOGRADER_ROOT=str(root), AUTOGRADER_TRUSTED="1",
                   AUTOGRADER_PYTHON=str(open_folder / "venv" / "bin" / "python"))
        run = subprocess.run([str(root / "source" / "run_autograder")], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        data = json.loads((root / "results" / "results.json").read_text())
        assert_gradescope_results(data)
        task1 = [t for t in data["tests"] if t["tags"] == ["task 1"]]
        peeks = {t["output"] for t in task1 if "PEEK" in t["output"]}
        from opd_literate.course.sandbox import _RUN_USERS

        said = {re.search(r"PEEK (.*) as (\d+)$", p).groups() for p in peeks}
        assert {text for text, _ in said} == {"refused 13 | refused 13 | results refused 13"}
        assert all(int(uid) in _RUN_USERS for _, uid in said)  # EACCES, as the run's own user
        assert data["extra_data"]["statuses"] == {"1": "failed", "2": "passed", "3": "passed"}
        assert "trusted as root: run as a user of its own" in data["output"]
    finally:
        shutil.rmtree(open_folder)
