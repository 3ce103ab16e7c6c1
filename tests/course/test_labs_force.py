"""``opd-handout --force``: replaces only a folder the tool wrote, never deletes anyone's files."""

import json
import os
import subprocess
import sys

import pytest

from opd_literate.course import cli
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import MARKER


def _tree(folder):
    """Every file under ``folder`` with its bytes (symbolic links not followed)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _refused(capsys, argv, fragment):
    """The CLI exits with code 2 and one line on stderr containing ``fragment``."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert err.count("\n") == 1 and fragment in err, err


@pytest.fixture
def user_folder(tmp_path):
    """A folder of someone's own files, with no handout in it."""
    folder = tmp_path / "work"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "data" / "x.csv").write_text("1,2\n")
    return folder


def test_force_in_the_current_folder_of_user_files_deletes_nothing(user_folder):
    """The reported command, as typed: ``handout . --lab opd --force`` inside a user's folder."""
    before = _tree(user_folder)
    result = subprocess.run([sys.executable, "-m", "opd_literate.course", ".", "--lab", "opd",
                             "--force"], cwd=user_folder, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr == (f"opd-handout: error: OUTDIR '.' was not written by opd-handout "
                             f"(no valid {MARKER} marker); --force replaces only a folder this "
                             "tool wrote\n")
    assert _tree(user_folder) == before


def test_force_replaces_a_handout_in_the_current_folder_and_keeps_other_files(
        tmp_path, monkeypatch, capsys):
    folder = tmp_path / "lab"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert cli.main([".", "--lab", "opd"]) == 0
    written = _tree(folder)
    (folder / "my_answers.txt").write_text("kept")
    (folder / "tests" / "test_mine.py").write_text("def test_mine():\n    pass\n")
    assert cli.main([".", "--lab", "opd", "--force"]) == 0
    after = _tree(folder)
    assert after["my_answers.txt"] == b"kept"
    assert after["tests/test_mine.py"] == b"def test_mine():\n    pass\n"
    assert {k: v for k, v in after.items() if k not in ("my_answers.txt",
                                                        "tests/test_mine.py")} == written
    capsys.readouterr()


def test_force_from_one_lab_to_all_removes_only_the_files_it_wrote(tmp_path):
    folder = tmp_path / "labs"
    write_lab("opd", folder)
    (folder / "notes.txt").write_text("mine")
    write_lab("all", folder, force=True)
    names = set(_tree(folder))
    assert "notes.txt" in names and "opd/opd.py" in names and "mismatch/estimators.py" in names
    assert "opd.py" not in names and "lab.json" not in names  # the single lab's files went
    marker = json.loads((folder / MARKER).read_text())
    assert marker["lab"] == "all" and "notes.txt" not in marker["files"]
    assert set(marker["files"]) == names - {"notes.txt", MARKER}


def test_the_marker_lists_every_file_written_with_its_hash(tmp_path):
    import hashlib

    write_lab("opd", tmp_path / "lab")
    marker = json.loads((tmp_path / "lab" / MARKER).read_text())
    files = _tree(tmp_path / "lab")
    assert set(marker["files"]) == set(files) - {MARKER}
    for name, digest in marker["files"].items():
        assert hashlib.sha256(files[name]).hexdigest() == digest


def test_force_refuses_a_changed_file_and_deletes_nothing(tmp_path, capsys):
    folder = tmp_path / "lab"
    write_lab("opd", folder)
    (folder / "opd.py").write_text((folder / "opd.py").read_text() + "\n# my solution\n")
    before = _tree(folder)
    _refused(capsys, [str(folder), "--lab", "opd", "--force"],
             "opd.py was changed since opd-handout wrote it")
    assert _tree(folder) == before


def test_force_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, capsys):
    folder = tmp_path / "lab"
    write_lab("opd", folder)
    marker = json.loads((folder / MARKER).read_text())
    del marker["files"]["conftest.py"]  # as if someone else had put conftest.py there
    (folder / MARKER).write_text(json.dumps(marker))
    before = _tree(folder)
    _refused(capsys, [str(folder), "--lab", "opd", "--force"],
             "conftest.py (or a folder above it) exists and was not written by opd-handout")
    assert _tree(folder) == before


@pytest.mark.parametrize("marker", [
    "not json", json.dumps({"tool": "something else", "files": {}}),
    json.dumps({"tool": "opd-handout", "files": {"../outside.txt": "0" * 64}}),
    json.dumps({"tool": "opd-handout", "files": {"/etc/hostname": "0" * 64}}),
])
def test_force_refuses_a_marker_it_did_not_write(tmp_path, capsys, marker):
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / MARKER).write_text(marker)
    (tmp_path / "outside.txt").write_text("not yours")
    _refused(capsys, [str(folder), "--lab", "opd", "--force"], "was not written by opd-handout")
    assert (tmp_path / "outside.txt").read_text() == "not yours"


def test_force_on_a_symlinked_folder_is_one_line_not_a_traceback(tmp_path, capsys):
    real = tmp_path / "real"
    write_lab("opd", real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    before = _tree(real)
    _refused(capsys, [str(link), "--lab", "opd", "--force"],
             f"OUTDIR {str(link)!r} is a symbolic link (to {str(real)!r})")
    assert _tree(real) == before and link.is_symlink()


def test_force_refuses_a_symlinked_folder_inside(tmp_path, capsys):
    folder = tmp_path / "labs"
    write_lab("all", folder)
    elsewhere = tmp_path / "elsewhere"
    (folder / "opd").rename(elsewhere)
    (folder / "opd").symlink_to(elsewhere, target_is_directory=True)
    before = _tree(elsewhere)
    _refused(capsys, [str(folder), "--lab", "all", "--force"], "is a symbolic link")
    assert _tree(elsewhere) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_an_outdir_that_cannot_be_created_is_one_line(capsys):
    _refused(capsys, ["/proc/opd-lab", "--lab", "opd"], "cannot write OUTDIR '/proc/opd-lab'")


def test_an_empty_symlinked_folder_is_written_through(tmp_path):
    """Without anything to replace, a link to an empty folder is an ordinary place to write."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link, target_is_directory=True)
    write_lab("opd", link)
    assert (real / "opd.py").exists() and (real / MARKER).exists()
