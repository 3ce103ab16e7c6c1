"""Lab handouts from the single source: stubs, tests, grader, and their failure modes."""

import ast
import filecmp
import json
import pathlib
import subprocess
import sys

import pytest

from opd_literate.course import cli as course_cli
from opd_literate.course import labs as course_labs
from opd_literate.course import sandbox
from opd_literate.course.grade import grade
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS, PACKAGE
from opd_literate.course.markers import MarkerError, solution_lines, strip_solutions


@pytest.fixture(scope="module")
def labs(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "labs"
    write_lab("all", out)
    return out


def _restore(lab_folder, keep):
    """Overwrite the student modules with versions whose tasks in ``keep`` are solved."""
    lab = LABS[json.loads((lab_folder / "lab.json").read_text())["lab"]]
    for module in lab.student_modules:
        text, _ = strip_solutions(course_labs.source_of(module).read_text(), keep=keep)
        (lab_folder / f"{module}.py").write_text(course_labs.flatten_imports(text))


def test_layout_and_compilation(labs):
    for name, lab in LABS.items():
        folder = labs / name
        expected = {f"{m}.py" for m in lab.student_modules + lab.given_modules}
        expected |= {"README.md", "lab.json", "pytest.ini", "conftest.py"}
        assert expected <= {p.name for p in folder.iterdir()}
        for path in folder.rglob("*.py"):
            compile(path.read_text(), str(path), "exec")  # writes no .pyc into the lab


def test_generated_files_pass_the_linter(labs):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--line-length", "100",
         "--select", "E,F,W,D301", str(labs)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_task_is_a_stub_that_raises(labs):
    for name, lab in LABS.items():
        tasks = json.loads((labs / name / "lab.json").read_text())["tasks"]
        assert tasks, name
        for module in lab.student_modules:
            tree = ast.parse((labs / name / f"{module}.py").read_text())
            functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
            for number, names in tasks.items():
                for function in names:
                    last = functions[function].body[-1]
                    assert isinstance(last, ast.Raise), function
                    assert last.exc.func.id == "NotImplementedError"
                    assert last.exc.args[0].value == f"Task {number}: {function}"


def test_seed_tasks_of_the_opd_lab(labs):
    tasks = json.loads((labs / "opd" / "lab.json").read_text())["tasks"]
    assert tasks["1"] == ["reverse_kl_rewards"] and tasks["2"] == ["opd_pg_loss"]
    assert "full_vocab_reverse_kl" in tasks["3"]
    text = (labs / "opd" / "opd.py").read_text()
    assert "Exact reverse KL at every visited position" in text  # docstrings kept
    assert "from _numerics import" in text and "from .._numerics" not in text


def test_no_solution_line_leaks(labs):
    """No code line of a solution region appears in the handout, unless the same line is also
    given code outside every region of the library (a shared ``return`` line, say)."""
    sources = [p.read_text() for p in PACKAGE.rglob("*.py")]
    given = set()
    for text in sources:
        student, _ = strip_solutions(text)
        given |= {line.strip() for line in student.split("\n")}
    secret = {line for text in sources for line in solution_lines(text)} - given
    assert len(secret) >= 15
    for path in labs.rglob("*"):
        if path.is_file():
            found = secret & {line.strip() for line in path.read_text().split("\n")}
            assert not found, (path, found)


def test_running_twice_is_byte_identical(labs, tmp_path):
    again = tmp_path / "again"
    write_lab("all", again)
    comparison = filecmp.dircmp(labs, again)

    def assert_same(cmp):
        assert not cmp.left_only and not cmp.right_only and not cmp.diff_files, cmp.report()
        _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files,
                                               shallow=False)
        assert not mismatch and not errors
        for sub in cmp.subdirs.values():
            assert_same(sub)

    assert_same(comparison)


# Each grade starts a sandboxed runner (several seconds), so the grading tests share the work:
# the OPD lab is graded with Task 1 alone (by the command line) here; the mismatch lab solved
# but for one wrong task in tests/course/test_notebooks.py, and attacked in
# tests/course/test_grade_attacks.py. Every case is judged in process, reference and stubs, in
# tests/course/test_grade.py.
def test_cli_writes_and_a_one_task_solution_scores_exactly_that_task(tmp_path, capsys):
    """Task 1 alone is passed, though the identity tests of Task 1 also call Tasks 2 and 3: in
    the cases that stand for them, only Task 1's function is the student's, and the grader
    computes the rest with the reference in its own process (never in the sandbox). Written and
    graded by the command line's ``main`` (in this process: a new interpreter would only import
    torch again; ``python -m opd_literate.course`` itself is run by the tests below), the
    student's code in the sandbox where it runs, with its JSON report."""
    folder = tmp_path / "opd"
    assert course_cli.main([str(folder), "--lab", "opd"]) == 0
    assert (folder / "lab.json").exists()
    _restore(folder, keep={1})
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    trusted = ["--trusted"] if sandbox.unavailable_reason() else []  # no bwrap on this machine
    capsys.readouterr()
    assert course_cli.main(["grade", str(folder), "--json", "-", *trusted]) == 0
    report = json.loads(capsys.readouterr().out)["labs"][0]
    assert report["lab"] == "opd" and report["score"] == 1 and report["total"] == 3
    assert report["files"] == {} and report["trusted"] == bool(trusted)
    # (status, passed, tests): the tests of each task, counted by hand in tests/opd/test_lab_opd.py
    assert [(t["status"], t["passed"], t["tests"]) for t in report["tasks"].values()] == [
        ("passed", 10, 10), ("not implemented", 0, 12), ("not implemented", 0, 10)]
    assert [c["name"] for c in report["tasks"]["1"]["cases"]][0] == (
        "tests/test_lab_opd.py::TestTask1Rewards::test_values_and_zeros_where_masked")
    for number in ("2", "3"):
        task = report["tasks"][number]
        assert task["messages"][0].endswith(f"NotImplementedError: Task {number}: "
                                            f"{task['function'].split(', ')[-1]}")
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


class TestBadInput:
    def test_unknown_lab(self, tmp_path):
        run = subprocess.run([sys.executable, "-m", "opd_literate.course", str(tmp_path / "x"),
                              "--lab", "rlhf"], capture_output=True, text=True)
        assert run.returncode == 2 and "unknown lab 'rlhf'" in run.stderr
        assert run.stderr.count("\n") == 1

    def test_non_empty_outdir_needs_force_and_force_needs_a_handout(self, tmp_path):
        (tmp_path / "old.txt").write_text("keep me")
        with pytest.raises(ValueError, match="exists and is not empty; use --force"):
            write_lab("opd", tmp_path)
        with pytest.raises(ValueError, match="was not written by opd-handout"):
            write_lab("opd", tmp_path, force=True)
        assert (tmp_path / "old.txt").read_text() == "keep me"
        assert not (tmp_path / "opd.py").exists()

    @pytest.mark.parametrize("text, message", [
        ("def f():\n    ### BEGIN SOLUTION Task 1: x\n    return 1\n", "src.py:2: .*never closed"),
        ("def f():\n    return 1\n    ### END SOLUTION\n", "src.py:3: END SOLUTION without"),
        ("def f():\n    ### BEGIN SOLUTION Task 1: a\n    ### BEGIN SOLUTION Task 2: b\n"
         "    ### END SOLUTION\n", "src.py:3: nested BEGIN SOLUTION"),
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n",
         "src.py:2: BEGIN SOLUTION needs 'Task N: hint'"),
    ])
    def test_bad_markers_name_file_and_line(self, text, message):
        with pytest.raises(MarkerError, match=message):
            strip_solutions(text, "src.py")

    @pytest.mark.parametrize("points, message", [
        ({1: 3, 2: 3}, r"points are given for tasks \[1, 2\], expected exactly the tasks of "
                       r"the source, \[1, 2, 3\]"),
        ({1: 3, 2: 3, 3: 0}, "Task 3 has points 0, expected a positive finite number"),
        ({1: 3, 2: float("nan"), 3: 4}, "Task 2 has points nan"),
        ({1: True, 2: 3, 3: 4}, "Task 1 has points True"),
    ])
    def test_points_that_do_not_fit_the_tasks(self, points, message):
        import dataclasses

        lab = dataclasses.replace(LABS["opd"], points=points)
        with pytest.raises(ValueError, match=f"lab 'opd': {message}"):
            course_labs.lab_points(lab)
        with pytest.raises(ValueError, match=message):
            course_labs.render_lab(lab)

    def test_grade_a_folder_that_is_not_a_lab(self, tmp_path):
        with pytest.raises(ValueError, match="is not a lab folder"):
            grade(tmp_path)
        run = subprocess.run([sys.executable, "-m", "opd_literate.course", "grade",
                              str(tmp_path)], capture_output=True, text=True)
        assert run.returncode == 2 and "not a lab folder" in run.stderr


def test_library_markers_are_balanced():
    """Every module of the package parses: the markers are well formed everywhere."""
    for path in pathlib.Path(PACKAGE).rglob("*.py"):
        strip_solutions(path.read_text(), str(path))
