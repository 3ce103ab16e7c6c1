"""nbgrader: the notebooks carry nbgrader's cell metadata, and ``--format nbgrader`` writes a
course folder that ``nbgrader generate_assignment`` and ``nbgrader autograde`` accept.

The metadata rules below are nbgrader 0.9.6's (``nbgrader/nbgraderformat/v3.json`` and the
checks of ``v3.py``'s ``MetadataValidatorV3``): the keys ``schema_version`` (3), ``grade``,
``locked``, ``solution`` always; ``grade_id`` (letters, digits, ``_`` and ``-``), unique, on a
graded, solution or locked cell; ``points`` (a number >= 0) exactly on a graded cell; no other
key; a Markdown cell graded only if it is also a solution. The real nbgrader runs in the slow
test, from a virtual environment of its own (the ``nbgrader`` extra: see pyproject.toml).
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS, PACKAGE, lab_points, render_notebook

KEYS = {"schema_version", "grade", "locked", "solution", "task", "grade_id", "points",
        "checksum", "cell_type"}


def assert_nbgrader_v3(notebook):
    ids = set()
    for cell in notebook["cells"]:
        meta = cell["metadata"].get("nbgrader")
        if meta is None:
            continue
        assert set(meta) <= KEYS and {"schema_version", "grade", "locked", "solution"} <= set(
            meta), meta
        assert meta["schema_version"] == 3
        assert all(isinstance(meta[k], bool) for k in ("grade", "locked", "solution"))
        if meta["grade"] or meta["solution"] or meta["locked"]:
            assert re.fullmatch(r"[a-zA-Z0-9_\-]+", meta["grade_id"]), meta
            assert meta["grade_id"] not in ids, meta["grade_id"]
            ids.add(meta["grade_id"])
        assert ("points" in meta) == meta["grade"], meta
        if meta["grade"]:
            assert isinstance(meta["points"], (int, float)) and meta["points"] >= 0
        if cell["cell_type"] == "markdown":
            assert meta["grade"] == meta["solution"], meta


@pytest.mark.parametrize("name", list(LABS))
@pytest.mark.parametrize("solutions", [False, True])
def test_every_code_cell_carries_valid_nbgrader_metadata(name, solutions):
    notebook = render_notebook(LABS[name], solutions=solutions)
    assert_nbgrader_v3(notebook)
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all("nbgrader" in c["metadata"] for c in code)
    graded = {c["metadata"]["nbgrader"]["grade_id"]: c["metadata"]["nbgrader"]["points"]
              for c in code if c["metadata"]["nbgrader"]["grade"]}
    # each check(N) cell is graded with Task N's points; nothing else is graded
    assert graded == {f"check_task{n}": p for n, p in lab_points(LABS[name]).items()}
    for cell in code:
        meta = cell["metadata"]["nbgrader"]
        is_task = "NotImplementedError(\"Task" in cell["source"] or "BEGIN SOLUTION" in cell[
            "source"]
        assert meta["solution"] == is_task, cell["source"][:80]
        assert meta["locked"] == (not is_task), cell["source"][:80]


def test_the_source_notebook_marks_each_solution_in_nbgraders_form():
    """The hint on a TODO line right above a plain ``### BEGIN SOLUTION``, closed in the same
    cell: nbgrader replaces the region, its BEGIN line included, by its stub."""
    notebook = render_notebook(LABS["opd"], solutions=True)
    solution_cells = [c for c in notebook["cells"]
                      if c["metadata"].get("nbgrader", {}).get("solution")]
    assert len(solution_cells) == 4  # Task 3 is two functions
    for cell in solution_cells:
        lines = [line.strip() for line in cell["source"].split("\n")]
        begin = lines.index("### BEGIN SOLUTION")
        assert re.fullmatch(r"# TODO \(Task \d\): .+", lines[begin - 1]), lines[begin - 1]
        assert lines.count("### END SOLUTION") == 1 and lines.index("### END SOLUTION") > begin
        assert "NotImplementedError" not in cell["source"]


def test_the_nbgrader_format_is_a_course_folder(tmp_path):
    write_lab("all", tmp_path / "course", format="nbgrader")
    course = tmp_path / "course"
    assert (course / "nbgrader_config.py").is_file()
    for name in LABS:
        source = course / "source" / name
        assert (source / f"{name}.ipynb").is_file() and (source / "tests").is_dir()
        assert not any(p.suffix == ".py" and p.stem in LABS[name].student_modules
                       for p in source.iterdir())


def _nbgrader():
    """The nbgrader command: $OPD_NBGRADER, the project's .venv-nbgrader, or one on PATH."""
    given = os.environ.get("OPD_NBGRADER")
    if given:  # set by .ci/run: the test must run, not skip
        assert pathlib.Path(given).is_file(), f"OPD_NBGRADER={given} is not a file"
    for candidate in (os.environ.get("OPD_NBGRADER"),
                      PACKAGE.parent / ".venv-nbgrader" / "bin" / "nbgrader",
                      shutil.which("nbgrader")):
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    pytest.skip("nbgrader is not installed: bash tools/env.sh nbgrader .venv-nbgrader "
                "(nbgrader 0.9.6 in an environment of its own)")


@pytest.mark.slow
def test_nbgrader_generates_the_assignment_and_autogrades_a_submission(tmp_path):
    """generate_assignment strips the solutions (the hints stay); a student solves Task 1
    through a helper in a new, untagged cell; autograde gives Task 1's points and no others."""
    nbgrader = _nbgrader()
    course = tmp_path / "course"
    write_lab("opd", course, format="nbgrader")
    # nothing of this test run (PYTHONPATH, pytest's and xdist's variables) reaches nbgrader
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("PYTEST_", "COV_"))}
    env["PATH"] = f"{nbgrader.parent}{os.pathsep}{env.get('PATH', '')}"  # its alembic

    def run(*args):
        result = subprocess.run([str(nbgrader), *args], cwd=course, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run("generate_assignment", "opd")
    release = json.loads((course / "release" / "opd" / "opd.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in release["cells"])
    assert "### BEGIN SOLUTION" not in text
    assert text.count("# YOUR CODE HERE") == 4  # nbgrader's stub, once a solution region
    assert "# TODO (Task 1): teacher_logp - student_logp" in text

    submitted = course / "submitted" / "alice" / "opd"
    shutil.copytree(course / "release" / "opd", submitted)
    cells = release["cells"]
    task1 = next(i for i, c in enumerate(cells) if "def reverse_kl_rewards(" in "".join(
        c["source"]))
    source = "".join(cells[task1]["source"])
    cells[task1]["source"] = source.replace(
        "    # YOUR CODE HERE\n    raise NotImplementedError()",
        "    return _masked_difference(teacher_logp, student_logp, mask)")
    cells.insert(task1 + 1, {"cell_type": "code", "metadata": {}, "execution_count": None,
                             "outputs": [], "id": "alice-helper", "source": (
        "def _masked_difference(teacher_logp, student_logp, mask):\n"
        "    dtype = compute_dtype(student_logp, teacher_logp)\n"
        "    diff = teacher_logp.detach().to(dtype) - student_logp.detach().to(dtype)\n"
        "    return torch.where(mask, diff, torch.zeros_like(diff))\n")})
    (submitted / "opd.ipynb").write_text(json.dumps(release))
    run("autograde", "opd")
    python = nbgrader.parent / "python"
    scores = subprocess.run([str(python), "-c", (
        "import json\nfrom nbgrader.api import Gradebook\n"
        "with Gradebook('sqlite:///gradebook.db') as gb:\n"
        "    s = gb.find_submission('opd', 'alice')\n"
        "    print(json.dumps({g.name: [g.score, g.max_score] for n in s.notebooks "
        "for g in n.grades}))")], cwd=course, env=env, capture_output=True, text=True,
        timeout=120)
    assert scores.returncode == 0, scores.stderr
    points = lab_points(LABS["opd"])
    assert json.loads(scores.stdout.strip().split("\n")[-1]) == {
        "check_task1": [points[1], points[1]], "check_task2": [0.0, points[2]],
        "check_task3": [0.0, points[3]]}
