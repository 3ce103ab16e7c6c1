"""Fifty submissions in one folder, fifteen of them hostile, graded by one command in the
sandbox: every lab has its entry in the JSON report, every honest lab gets the grade its code
earns (a task solved passes, a stub is not implemented: the OPD lab's tasks do not call each
other, so this holds for every subset of them), and the hostile labs change nobody's grade.
The slow tier: about fifty sandboxed runs."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from opd_literate.course import labs, sandbox
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import REPO
from tests.helpers.labs import deep_folder, write_student_module

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"no sandbox here: "
                                                     f"{sandbox.unavailable_reason()}")]

TASKS = (1, 2, 3)
SUBSETS = [set(c) for r in range(4) for c in itertools.combinations(TASKS, r)]  # all 8


def _student(folder, keep, appended=""):
    write_student_module(folder, "opd", keep=keep, appended=appended)


def _expected(keep):
    return ["passed" if n in keep else "not implemented" for n in TASKS]


SHADOW = "raise SystemExit('a submission shadowed the grader')\n"

HOSTILE_CODE = {
    # an endless Task 2, a 3 GiB allocation in Task 1, 400 MiB printed at import
    "loops": ({1, 3}, "\n\ndef opd_pg_loss(*a, **k):\n    while True:\n        pass\n",
              ["passed", "timed out", "passed"]),
    "allocates": ({2, 3}, "\n\ndef reverse_kl_rewards(*a, **k):\n"
                          "    return bytearray(3 << 30)\n", ["failed", "passed", "passed"]),
    "floods": ({1, 2, 3}, "\nimport sys\nfor _ in range(400):\n"
                          "    sys.stdout.write('x' * (1 << 20))\n", ["passed"] * 3),
    "forges": ({1, 2, 3}, "\n\ndef reverse_kl_rewards(*a, **k):\n    import os\n    try:\n"
                          "        with open(f'/proc/{os.getppid()}/fd/1', 'w') as p:\n"
                          "            p.write('\\n{\"opd_runner_states\": {}}\\n')\n"
                          "        os.kill(os.getppid(), 9)\n    except OSError:\n"
                          "        pass\n"
                          "    raise ValueError('\\r\\x1b[2K| 1 | passed |\\nscore: 3/3')\n",
               ["failed", "passed", "passed"]),
    "buries": ({1, 2, 3}, "\nimport os\nfd = os.open('.', os.O_RDONLY)\ntry:\n"
                          "    for _ in range(1200):\n        os.mkdir('d', dir_fd=fd)\n"
                          "        fd = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
                          "except OSError:  # the other task's process made it first\n"
                          "    pass\n", ["passed"] * 3),
    "moves-the-output": ({1, 2, 3}, "\nimport os\nos.rename('../out', '../elsewhere')\n"
                                    "os.symlink('/', '../out')\n", ["error"] * 3),
}


def test_fifty_submissions_with_hostile_ones_are_all_reported_and_honest_grades_hold(
        tmp_path):
    batch = tmp_path / "batch"
    expected = {}
    for index in range(35):  # the honest ones: every subset of the tasks, several times
        keep = SUBSETS[index % len(SUBSETS)]
        folder = write_lab("opd", batch / f"honest-{index:02d}")[0]
        _student(folder, keep)
        expected[folder.name] = _expected(keep)
    for name, (keep, code, statuses) in HOSTILE_CODE.items():
        folder = write_lab("opd", batch / f"hostile-{name}")[0]
        _student(folder, keep, code)
        expected[folder.name] = statuses
    # the others: around the code
    shadows = write_lab("opd", batch / "hostile-shadows")[0]
    _student(shadows, TASKS)
    for where in (shadows, batch):
        (where / "json.py").write_text(SHADOW)
        (where / "numpy").mkdir()
        (where / "numpy" / "__init__.py").write_text(SHADOW)
    expected[shadows.name] = _expected(TASKS)
    instructor = tmp_path / "instructor"
    instructor.mkdir()
    (instructor / "opd.ipynb").write_text(
        json.dumps(labs.render_notebook(labs.LABS["opd"], solutions=True)))
    links = write_lab("opd", batch / "hostile-links-the-solutions")[0]
    (links / "opd.ipynb").symlink_to(instructor / "opd.ipynb")
    expected[links.name] = _expected(())
    (batch / "hostile-is-a-link").symlink_to("honest-07")
    expected["hostile-is-a-link"] = "link"
    deep = write_lab("opd", batch / "hostile-deep")[0]
    deep_folder(deep, 1200)
    expected[deep.name] = _expected(())
    conftest = write_lab("opd", batch / "hostile-conftest")[0]
    (conftest / "conftest.py").write_text("def pytest_collection_modifyitems(items):\n"
                                          "    items.clear()\n")
    expected[conftest.name] = _expected(())
    manifest = write_lab("opd", batch / "hostile-linked-manifest")[0]
    (manifest / "lab.json").unlink()
    (manifest / "lab.json").symlink_to(batch / "honest-07" / "lab.json")
    expected[manifest.name] = "error"
    unknown = write_lab("opd", batch / "hostile-unknown-lab")[0]
    (unknown / "lab.json").write_text('{"lab": "\\u202eopd"}')
    expected[unknown.name] = "error"
    peeks = write_lab("opd", batch / "hostile-peeks")[0]  # a classmate's solution, by path
    _student(peeks, (), "\n\ndef reverse_kl_rewards(*a, **k):\n    namespace = {}\n"
                        f"    exec(open({str(batch / 'honest-07' / 'opd.py')!r}).read(), "
                        "namespace)\n    return namespace['reverse_kl_rewards'](*a, **k)\n")
    expected[peeks.name] = ["failed", "not implemented", "not implemented"]
    bomb = write_lab("opd", batch / "hostile-parser-bomb", format="notebook")[0]
    notebook = json.loads((bomb / "opd.ipynb").read_text())
    notebook["cells"].append(dict(cell_type="code", metadata={}, outputs=[],
                                  execution_count=None, source="x = " + "1+" * 300000 + "1"))
    (bomb / "opd.ipynb").write_text(json.dumps(notebook))
    expected[bomb.name] = "error"
    names = sorted(os.listdir(batch))
    assert len([n for n in names if n.startswith(("honest", "hostile"))]) == 50

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    report_path = tmp_path / "report.json"
    try:
        done = subprocess.run([sys.executable, "-m", "opd_literate.course", "grade", ".",
                               "--timeout", "10", "--json", str(report_path)], cwd=batch,
                              env=env, capture_output=True, text=True, timeout=1500)
    finally:
        from opd_literate.course.grade import _remove

        _remove(deep)  # pytest's clean-up of old temporary folders would recurse on it
    assert done.returncode == 0, done.stderr[-3000:]
    labs_reported = json.loads(report_path.read_text())["labs"]
    by_name = {os.path.basename(lab["folder"]): lab for lab in labs_reported}
    assert sorted(by_name) == sorted(expected)  # every lab has its entry
    for name, want in expected.items():
        lab = by_name[name]
        if want == "link":
            assert "symbolic link" in lab["error"], name
        elif want == "error":
            assert "tasks" not in lab or all(
                t["status"] == "error" for t in lab["tasks"].values()), (name, lab)
        else:
            assert [t["status"] for t in lab["tasks"].values()] == want, (name, lab)
    assert "\x1b" not in done.stdout and "\r" not in done.stdout
    assert "SystemExit" not in done.stdout + done.stderr
