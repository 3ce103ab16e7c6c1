"""What the students' README of a lab promises: its dependencies and ``pytest --task N``."""

import ast
import importlib.util
import os
import pathlib
import re
import sys
from types import SimpleNamespace

import pytest

from opd_literate.course import grade
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS


@pytest.fixture(scope="module")
def labs(tmp_path_factory):
    out = tmp_path_factory.mktemp("readme") / "labs"
    write_lab("all", out)
    return out


def _imported_top_level_modules(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", list(LABS))
def test_a_lab_needs_only_numpy_torch_and_pytest(labs, name):
    """The README: "needs numpy, torch and pytest". Every import of the lab's code and tests is
    the standard library, one of those three, or a module of the folder itself."""
    folder = labs / name
    assert "needs numpy, torch and pytest" in (folder / "README.md").read_text()
    own = {p.stem for p in folder.glob("*.py")}
    for path in folder.rglob("*.py"):
        third_party = _imported_top_level_modules(path) - set(sys.stdlib_module_names) - own
        assert third_party <= {"numpy", "torch", "pytest"}, (path.name, third_party)


def test_the_task_option_selects_the_tests_of_that_task(labs):
    """The README: ``python -m pytest --task 1`` runs only the tests of Task 1. The lab's
    conftest hook, called on stand-in test items marked as pytest marks them."""
    spec = importlib.util.spec_from_file_location("lab_conftest", labs / "opd" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    def item(*tasks):
        marks = [SimpleNamespace(args=(n,)) for n in tasks]
        return SimpleNamespace(iter_markers=lambda name: marks if name == "task" else [],
                               tasks=tasks)

    items = [item(1), item(2), item(1, 3), item()]
    deselected = []
    config = SimpleNamespace(getoption=lambda option: [1],
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected
                                                  .extend(items)))
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.tasks for i in items] == [(1,), (1, 3)]
    assert [i.tasks for i in deselected] == [(2,), ()]
    every = [item(1), item(2)]
    conftest.pytest_collection_modifyitems(
        SimpleNamespace(getoption=lambda option: [], hook=None), every)
    assert len(every) == 2  # without --task, nothing is deselected


def test_the_readme_names_every_grade_a_task_of_these_labs_can_get(labs):
    """``grade`` gives each task one of ``STATUSES`` (every status the source assigns is one of
    them); the README names all but "no tests", which no task of these labs can get."""
    source = pathlib.Path(grade.__file__).read_text()
    assigned = set(re.findall(r'status = "([a-z ]+)"', source))
    assigned |= set(re.findall(r'status="([a-z ]+)"', source))
    assert assigned == set(grade.STATUSES)
    text = " ".join((labs / "opd" / "README.md").read_text().split())
    for status in set(grade.STATUSES) - {"no tests"}:
        assert status in text.split("reports each task as")[1], status


@pytest.mark.parametrize("name", list(LABS))
def test_the_readme_states_each_tasks_points_and_their_total(labs, name):
    text = (labs / name / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| `\w+\.py` \| ([^|]+) \|$", text, re.M)
    stated = {int(n): float(p) for n, _, p in rows if p.strip() != "(with the row above)"}
    assert stated == {n: float(p) for n, p in LABS[name].points.items()}
    assert {int(n) for n, _, _ in rows} == set(stated)  # every task has a row
    assert f"{sum(LABS[name].points.values()):g} points in all" in text


def test_the_readme_states_the_time_limit_the_grader_applies(labs):
    """The README's time limit is the default of grade() and of the command's --timeout."""
    import inspect
    import subprocess

    text = " ".join((labs / "opd" / "README.md").read_text().split())
    assert f"Each task's tests may run for {grade.GRADE_TIMEOUT:g} seconds" in text
    assert inspect.signature(grade.grade).parameters["timeout"].default == grade.GRADE_TIMEOUT
    usage = subprocess.run([sys.executable, "-m", "opd_literate.course", "grade", "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    assert f"(default {grade.GRADE_TIMEOUT:g})" in " ".join(usage.split())


@pytest.mark.slow
def test_task_option_skips_exactly_the_joint_tests_the_readme_names(labs, tmp_path):
    """``pytest --task 1`` in the OPD lab with Task 1 solved: the tests the README names as
    also checking other tasks are skipped (each instance of them), every other Task 1 test
    passes; the grader runs all of them (tests/course/test_labs.py: 10 of 10)."""
    import shutil
    import subprocess

    from opd_literate.course import labs as course_labs
    from opd_literate.course.markers import strip_solutions

    folder = tmp_path / "opd"
    shutil.copytree(labs / "opd", folder)
    text, _ = strip_solutions(course_labs.source_of("opd").read_text(), keep={1})
    (folder / "opd.py").write_text(course_labs.flatten_imports(text))
    run = subprocess.run([sys.executable, "-m", "pytest", "--task", "1", "-v", "-p",
                          "no:cacheprovider"], cwd=folder, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items()
                                           if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stdout[-2000:]
    outcomes = dict(re.findall(r"^tests/test_lab_opd\.py::(\S+) (PASSED|SKIPPED)", run.stdout,
                               re.M))
    skipped = {test.split("[")[0] for test, outcome in outcomes.items() if outcome == "SKIPPED"}
    readme = (folder / "README.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", readme))
    assert skipped == named and len(named) == 2
    assert sum(outcome == "PASSED" for outcome in outcomes.values()) == 4
    assert len(outcomes) == 10
