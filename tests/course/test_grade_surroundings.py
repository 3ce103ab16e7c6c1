"""The attacks around the sandbox, played against the installed grader in the sandbox (the
command line and its batch mode): a submission's modules where the grader process starts, links
to another's work, a report drawn over by a message, a lab that makes the grader crash, and a
student who speaks with the runner's voice. Each ends with the right grade for every honest
lab, and a report for every lab. The slow tier (a sandboxed runner takes seconds)."""

import json
import os
import subprocess
import sys

import pytest

from opd_literate.course import labs, sandbox
from opd_literate.course.grade import grade
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import REPO
from tests.helpers.labs import deep_folder, write_student_module

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"no sandbox here: "
                                                     f"{sandbox.unavailable_reason()}")]

SOLVED = ["passed", "passed", "passed"]  # the opd lab's three tasks, solved
STUBS = ["not implemented"] * 3


def _solved(folder, appended=""):
    """The opd lab's student module with every task solved, and ``appended`` run at import."""
    write_student_module(folder, "opd", keep=range(1, 9), appended=appended)


def _cli(args, cwd):
    """``python -m opd_literate.course ARGS`` from ``cwd``, with this checkout importable the
    way an installed package is (on PYTHONPATH, not as the current folder)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "opd_literate.course", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _statuses(report):
    return [[t["status"] for t in lab["tasks"].values()] if "tasks" in lab else lab["error"]
            for lab in report["labs"]]


SHADOW = """import pathlib
pathlib.Path({canary!r}).write_text("imported by the grader")
raise SystemExit("a student's module shadowed the grader's")
"""


def test_a_submissions_modules_never_load_in_the_grader(tmp_path):
    """``numpy.py``, ``json.py`` and a ``torch/`` package in the submission, and a batch folder
    holding ``numpy/`` and ``json.py``: graded from inside each, none is imported by the grader
    (they would write the canary and stop it) and the grade is the honest one."""
    canary = tmp_path / "canary"
    batch = tmp_path / "batch"
    lab = write_lab("opd", batch / "student")[0]
    _solved(lab)
    for where in (lab, batch):
        (where / "json.py").write_text(SHADOW.format(canary=str(canary)))
        (where / "numpy").mkdir()
        (where / "numpy" / "__init__.py").write_text(SHADOW.format(canary=str(canary)))
    (lab / "torch").mkdir()
    (lab / "torch" / "__init__.py").write_text(SHADOW.format(canary=str(canary)))
    for cwd, target in ((lab, "."), (batch, ".")):
        done = _cli(["grade", target, "--json", str(tmp_path / "report.json")], cwd)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((tmp_path / "report.json").read_text())
        assert _statuses(report) == [SOLVED], report
    assert not canary.exists()


def test_nothing_is_read_through_a_link_and_a_linked_lab_is_not_graded_as_its_target(
        tmp_path):
    """A notebook linked (relatively) to the instructor's notebook with its solutions is not
    read: the stubs stay not implemented and the report names the link. In a batch, a lab
    folder that links to a classmate's is reported, not graded with the classmate's work."""
    instructor = tmp_path / "instructor"
    instructor.mkdir()
    notebook = labs.render_notebook(labs.LABS["opd"], solutions=True)
    (instructor / "opd.ipynb").write_text(json.dumps(notebook))
    batch = tmp_path / "batch"
    linker = write_lab("opd", batch / "a-links-a-notebook")[0]
    (linker / "opd.ipynb").symlink_to(os.path.relpath(instructor / "opd.ipynb", linker))
    classmate = write_lab("opd", batch / "b-classmate")[0]
    _solved(classmate)
    (batch / "c-links-the-classmate").symlink_to("b-classmate")
    done = _cli(["grade", str(batch), "--json", str(tmp_path / "report.json")], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    first, second, third = report["labs"]
    assert [t["status"] for t in first["tasks"].values()] == STUBS
    assert first["files"]["opd.ipynb (a symbolic link)"] == "ignored"
    assert [t["status"] for t in second["tasks"].values()] == SOLVED
    assert "tasks" not in third and "symbolic link" in third["error"]


FORGER = '''

def _forge():
    import os
    message = ("wrong\\r| 1 | reverse_kl_rewards | passed | 3/3 |\\x1b[2K\\u202e"
               "\\nscore: 3/3")
    try:  # the runner's standard output, through /proc: refused (the runner is not dumpable)
        with open(f"/proc/{os.getppid()}/fd/1", "w") as pipe:
            pipe.write('\\n{"opd_runner_states": {"runner_error": "FORGED"}}\\n')
        os.kill(os.getppid(), 9)  # had it worked: the forged line would be the last one
    except OSError:
        pass
    try:  # the sandboxed process's own standard error: it may, and it is never quoted
        os.write(2, b"the runner said: all cases passed\\n")
    except OSError:
        pass
    raise ValueError(message)


def reverse_kl_rewards(*args, **kwargs):
    _forge()
'''


def test_a_message_cannot_draw_the_report_nor_speak_for_the_runner(tmp_path):
    """Task 1 raises a message that would, printed raw, erase its line and draw a passing row
    and ``score: 3/3``; it also tries to write the runner's account and prints a runner-like
    line. The report shows the message escaped on its own line, the one score line is the real
    one, and nothing claims to come from the runner."""
    lab = write_lab("opd", tmp_path / "lab")[0]
    _solved(lab, FORGER)
    (lab / "evil\nscore: 3.pyc").write_bytes(b"")  # a name that would start a line
    done = _cli(["grade", str(lab)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert "\r" not in text and "\x1b" not in text and "\u202e" not in text
    scores = [line for line in text.split("\n") if line.startswith("score:")]
    assert scores == ["score: 2/3"], text
    assert "FORGED" not in text and "runner said" not in text
    assert "ValueError: wrong\\r| 1 | reverse_kl_rewards | passed | 3/3 |\\x1b[2K\\u202e" in text
    assert "| 1 | reverse_kl_rewards | failed | 0/10 |" in text.split("\n")
    assert "evil\\nscore: 3.pyc: ignored" in text


DEEP_AT_IMPORT = '''

def _bury():
    import os
    fd = os.open(".", os.O_RDONLY)
    for _ in range(1200):  # a folder the grader must remove
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    os.rename("../out", "../out-moved")  # and the output folder replaced by a link
    os.symlink("/", "../out")


_bury()
'''


def test_no_lab_crashes_the_grader_and_every_lab_has_its_report(tmp_path):
    """A batch of four: a submission nested 1,200 folders deep, a student module that buries
    its grading folder 1,200 deep and replaces the output folder by a link at import, a
    notebook whose cell is nested past what ``ast`` parses, and an honest lab. Every lab has
    its entry in the JSON report; the honest one is graded as honest."""
    batch = tmp_path / "batch"
    deep = write_lab("opd", batch / "a-deep-submission")[0]
    deep_folder(deep, 1200)
    buries = write_lab("opd", batch / "b-buries")[0]
    _solved(buries, DEEP_AT_IMPORT)
    notebook_lab = write_lab("opd", batch / "c-notebook", format="notebook")[0]
    notebook = json.loads((notebook_lab / "opd.ipynb").read_text())
    notebook["cells"].append(dict(cell_type="code", metadata={}, outputs=[],
                                  execution_count=None, source="x = " + "1+" * 300000 + "1\n"))
    (notebook_lab / "opd.ipynb").write_text(json.dumps(notebook))
    honest = write_lab("opd", batch / "d-honest")[0]
    _solved(honest)
    try:
        done = _cli(["grade", str(batch), "--json", str(tmp_path / "report.json")], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((tmp_path / "report.json").read_text())
        statuses = _statuses(report)
        assert len(statuses) == 4 and statuses[3] == SOLVED, statuses
        assert statuses[0] == STUBS  # graded: the depth beyond the limit is only ignored
        assert report["labs"][0]["files"] and any(
            "folders deep" in name for name in report["labs"][0]["files"])
        assert statuses[1] == ["error"] * 3  # its output folder was replaced
        assert "cannot be parsed" in statuses[2] or "not a Jupyter notebook" in statuses[2]
    finally:
        from opd_literate.course.grade import _remove

        _remove(deep)  # pytest's clean-up of old temporary folders would recurse on it


def test_an_honest_grade_is_the_same_from_the_function_and_the_command_line(tmp_path):
    lab = write_lab("opd", tmp_path / "lab")[0]
    _solved(lab)
    direct = grade(lab)
    done = _cli(["grade", str(lab), "--json", "-"], tmp_path)
    (reported,) = json.loads(done.stdout)["labs"]
    assert [t["status"] for t in direct["tasks"].values()] == SOLVED
    assert [t["status"] for t in reported["tasks"].values()] == SOLVED
