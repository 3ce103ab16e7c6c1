"""What the students' README of a lab promises: its dependencies and ``pytest --task N``."""

import ast
import importlib.util
import pathlib
import re
import sys
from types import SimpleNamespace

import pytest

from opd_literate.course import grade
from opd_literate.course.labs import LABS, write_lab


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
