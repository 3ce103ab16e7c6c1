"""What reaches a grade report, without a sandbox: the strings a student controls are made
printable, nothing of a submission is read through a link or walked recursively, a grading
folder is removed whatever was done to it, and a batch reports every lab, whatever one of them
does to the grader. (The same attacks against the sandboxed grader: test_grade_surroundings.)"""

import json
import os
import re
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.course import cli, sandbox
from opd_literate.course import grade as grader
from opd_literate.course.grade import DEPTH_LIMIT, printable
from opd_literate.course.handouts import write_lab
from tests.helpers.labs import deep_folder

HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[rnt])")
_NAMED = {"\\": "\\", "r": "\r", "n": "\n", "t": "\t"}


def _read_back(shown):
    """The text that ``printable`` escaped, read back from its escapes."""
    return _ESCAPE.sub(lambda m: _NAMED.get(m.group(1)) or chr(int(m.group(1)[1:], 16)), shown)


@given(st.text(alphabet=st.characters(codec=None), max_size=300),
       st.integers(min_value=1, max_value=400))
def test_printable_shows_only_visible_characters_within_its_limit(text, limit):
    whole = printable(text, 10**6)
    assert not any(unicodedata.category(c) in HIDDEN for c in whole)
    whole.encode("utf-8")  # no lone surrogate: it encodes
    assert _read_back(whole) == text  # every escape stands for one character of the text
    shown = printable(text, limit)
    assert shown == (whole if len(whole) <= limit else whole[:limit - 1] + "…")


@given(st.text(alphabet=st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn",
                                                          "Zl", "Zp"),
                                      exclude_characters="\\"), max_size=200))
def test_printable_leaves_visible_text_as_it_is(text):
    assert printable(text, 200) == text


def test_printable_escapes_what_draws_over_a_terminal_or_reorders_a_page():
    # carriage return, an erase-line sequence, a newline, the right-to-left override, a lone
    # surrogate, a zero-width joiner, a line separator, a C1 control (CSI)
    forged = "0/3\r\x1b[2Kscore: 3/3\n\u202e\ud800\u200d\u2028\x9b"
    assert printable(forged, 200) == (
        "0/3\\r\\x1b[2Kscore: 3/3\\n\\u202e\\ud800\\u200d\\u2028\\x9b")
    # a backslash is doubled: a student's literal "\r" never reads as an escaped one
    assert printable("\\r") == "\\\\r" and printable("\r") == "\\r"
    assert printable("é, ü, 漢字, 🙂") == "é, ü, 漢字, 🙂"
    assert printable("x" * 1000) == "x" * 499 + "…"


def test_a_folder_thousands_deep_and_locked_is_removed_without_recursion(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # 150,000 characters of path: no path can name it
    deep_folder(work, 1500, name="d" * 100, bottom="bottom.py")
    (work / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("kept")
    locked = work / "locked"
    locked.mkdir()
    (locked / "f").write_text("x")
    locked.chmod(0o500)
    grader._remove(work)
    assert not work.exists() and (tmp_path / "outside" / "keep").read_text() == "kept"


def test_a_folder_moved_away_during_the_removal_never_leads_it_outside(tmp_path, monkeypatch):
    """A process that survived the run renames a folder the walk has entered into a folder
    beside the grading folder (as into /tmp): ".." from there is no longer the way back, so the
    removal stops rather than delete what lies beside it (found by a hostile review: the walk
    climbed to the stand-in for / and removed everything under it)."""
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    (root / "source").mkdir()
    (root / "source" / "reference.py").write_text("SOLUTION = 42\n")
    work = root / "tmp" / "opd-grade-x"
    (work / "lab" / "a" / "b").mkdir(parents=True)
    (work / "lab" / "a" / "b" / "f.py").write_text("x = 1\n")
    real_open = grader.os.open

    def open_and_move(path, flags, *args, dir_fd=None, **kwargs):
        fd = real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)
        if path == "b" and (work / "lab" / "a").exists():  # the walk is in lab/a/b now
            (work / "lab" / "a").rename(root / "tmp" / "moved")
        return fd

    monkeypatch.setattr(grader.os, "open", open_and_move)
    grader._remove(work)
    monkeypatch.undo()
    assert (root / "source" / "reference.py").read_text() == "SOLUTION = 42\n"
    assert (root / "tmp").is_dir() and oct((root / "tmp").stat().st_mode & 0o777) != "0o700"


def test_the_walk_of_a_submission_follows_no_link_and_stops_at_the_depth_limit(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "a.py").write_text("a = 1\n")
    (lab / "sub").mkdir()
    (lab / "sub" / "b.py").write_text("b = 1\n")
    (lab / "outside").symlink_to(tmp_path)  # a link to a folder: not entered
    (lab / "secret.py").symlink_to(tmp_path / "elsewhere.py")
    (tmp_path / "elsewhere.py").write_text("solutions = True\n")
    deep_folder(lab / "sub", 1200, bottom="bottom.py")
    try:
        _check_the_walk(tmp_path, lab)
    finally:  # pytest's own clean-up of old temporary folders recurses: it would fail on it
        grader._remove(lab)


def _check_the_walk(tmp_path, lab):
    found = list(grader.walk_submission(lab))
    regular = {parts for parts, link, is_file, deep in found if is_file}
    assert regular == {("a.py",), ("sub", "b.py")}
    assert {parts for parts, link, _, _ in found if link} == {("outside",), ("secret.py",)}
    (deep,) = [parts for parts, _, _, too_deep in found if too_deep]
    assert deep[:1] == ("sub",) and len(deep) == DEPTH_LIMIT + 1
    work = tmp_path / "work"
    work.mkdir()
    ignored = grader._copy_student_files(lab, work)
    assert sorted(p.name for p in work.rglob("*")) == ["a.py", "b.py", "sub"]
    assert "outside (a symbolic link)" in ignored and "secret.py (a symbolic link)" in ignored
    assert any(name.endswith(f"(more than {DEPTH_LIMIT} folders deep)") for name in ignored)


def test_a_lab_manifest_or_notebook_behind_a_link_is_not_read(tmp_path):
    instructor = write_lab("opd", tmp_path / "instructor", format="notebook")[0]
    student = write_lab("opd", tmp_path / "student")[0]
    (student / "opd.ipynb").symlink_to(os.path.relpath(instructor / "opd.ipynb", student))
    assert grader._notebook_modules(student, grader.LABS["opd"]) == {}  # not read
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "lab.json").symlink_to(student / "lab.json")
    with pytest.raises(ValueError, match="is not a lab folder \\(a symbolic link\\)"):
        grader._lab_of(linked)
    (student / "lab.json").write_text(json.dumps({"lab": ["opd"]}))
    with pytest.raises(ValueError, match="names an unknown lab"):
        grader._lab_of(student)


def test_a_batch_reports_every_lab_whatever_one_does_to_the_grader(tmp_path, monkeypatch,
                                                                   capsys):
    """A linked lab folder is reported, not graded as the one it points to; a lab whose grade
    raises (here a stand-in MemoryError with a lone surrogate and an escape sequence in its
    message) is that lab's error; the others are graded, and the JSON report holds them all,
    written whole over a link that stood where it goes."""
    labs_folder = tmp_path / "labs"
    for name in ("a-honest", "c-crashes"):
        write_lab("opd", labs_folder / name)
    (labs_folder / "b-link").symlink_to(labs_folder / "a-honest")
    real = grader.grade

    def grade(folder, **options):
        if folder.name == "c-crashes":
            raise MemoryError("a cell too large to parse \ud800\x1b[2J")
        return dict(lab="opd", tasks={}, score=0, total=0, files={}, format="files",
                    trusted=False, seconds=0.0, graded=folder.name)

    monkeypatch.setattr(cli, "grade", grade)
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: None)
    report = tmp_path / "report.json"
    target = tmp_path / "elsewhere.json"
    target.write_text("the instructor's file")
    report.symlink_to(target)
    assert cli.main(["grade", str(labs_folder), "--json", str(report)]) == 0
    assert target.read_text() == "the instructor's file" and not report.is_symlink()
    honest, link, crashed = json.loads(report.read_text())["labs"]
    assert honest["graded"] == "a-honest" and "graded" not in link
    assert "symbolic link" in link["error"]
    assert crashed["error"].startswith("not graded: the grader failed on it (MemoryError")
    assert "\\ud800\\x1b[2J" in crashed["error"]
    out = capsys.readouterr().out
    out.encode("utf-8")
    assert "\x1b" not in out and out.count("score:") == 1
    assert real is grader.grade
