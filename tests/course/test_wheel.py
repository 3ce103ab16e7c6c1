"""From an installed package: the lab tests ship in the wheel as package data, so that a wheel
install (not editable, no checkout) writes labs and grades them."""

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest
import tomllib

from opd_literate.course import labs, sandbox
from opd_literate.course.labs import LABS, PACKAGE, lab_file
from opd_literate.course.markers import strip_solutions

REPO = PACKAGE.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_and_ships_exactly_the_lab_tests():
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    assert set(PYPROJECT["packages"]) == folders | {"opd_literate.course.lab_tests"}
    assert PYPROJECT["package-dir"] == {"opd_literate.course.lab_tests": "tests"}
    shipped = set(PYPROJECT["package-data"]["opd_literate.course.lab_tests"])
    wanted = {str(pathlib.PurePosixPath(t).relative_to("tests"))
              for lab in LABS.values() for t in lab.tests + lab.hidden_tests}
    assert shipped == wanted
    assert not list((REPO / "tests").glob("*.py"))  # tests/ itself: no module would ship


def test_lab_file_prefers_the_installed_copy_then_the_checkout(tmp_path, monkeypatch):
    assert lab_file("tests/opd/test_lab_opd.py") == REPO / "tests" / "opd" / "test_lab_opd.py"
    (tmp_path / "opd").mkdir()
    (tmp_path / "opd" / "test_lab_opd.py").write_text("installed")
    monkeypatch.setattr(labs, "LAB_TESTS", tmp_path)
    assert lab_file("tests/opd/test_lab_opd.py") == tmp_path / "opd" / "test_lab_opd.py"
    monkeypatch.setattr(labs, "REPO", tmp_path / "no-checkout")
    with pytest.raises(FileNotFoundError, match="neither .*package data of a wheel.* nor "
                                                ".*a source checkout"):
        lab_file("tests/mismatch/test_lab_estimators.py")
    for bad in ("opd/test_lab_opd.py", "tests/../setup.py", "tests"):
        with pytest.raises(ValueError, match="expected a path under tests/"):
            lab_file(bad)


def _copy_of_the_project(target):
    """What pyproject.toml builds from: itself, the README, the package and tests/."""
    target.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, target / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in ("opd_literate", "tests"):
        shutil.copytree(REPO / name, target / name, ignore=ignore)


@pytest.mark.slow
def test_the_installed_wheel_writes_solves_and_grades_a_lab(tmp_path):
    """Build the wheel, install it (--no-deps: torch and numpy come from the test environment)
    into a fresh virtual environment, and, from a folder that is no checkout, write the labs,
    solve Task 1 of the OPD lab and grade it, in the sandbox where it runs here (the virtual
    environment is under the temporary folder, /tmp: the sandbox's fresh /tmp must not hide
    it): Task 1 alone passes."""
    source = tmp_path / "project"
    _copy_of_the_project(source)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("opd_literate-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"opd_literate/course/lab_tests/{p}"
            for p in PYPROJECT["package-data"]["opd_literate.course.lab_tests"]} <= names
    assert not any(n.startswith("tests/") or "lab_tests/course" in n for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True,
                             timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    # numpy and torch as this test environment has them, wherever it lives (a virtual
    # environment's base Python may have neither, so --system-site-packages would not do):
    # a .pth file names its site folders, after the wheel's own; not the repository.
    folders = {*map(pathlib.Path, site.getsitepackages()),
               *(sandbox._site_dir_of(name) for name in ("numpy", "torch"))}
    assert REPO.resolve() not in {folder.resolve() for folder in folders}
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True,
                             timeout=60).stdout.strip()
    (pathlib.Path(purelib) / "opd-test-site.pth").write_text(
        "".join(f"{folder}\n" for folder in sorted(folders)))
    shutil.rmtree(source)  # nothing of a checkout is left to read
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "work"
    work.mkdir()

    def run(*args):
        result = subprocess.run([str(python), *args], cwd=work, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    where = run("-c", "import opd_literate; print(opd_literate.__file__)").strip()
    assert pathlib.Path(where).is_relative_to(venv), where  # the wheel, not an editable copy
    assert "wrote" in run("-m", "opd_literate.course", "labs", "--lab", "all")
    opd = work / "labs" / "opd"
    assert (opd / "tests" / "test_lab_opd.py").read_text() == labs.flatten_imports(
        (REPO / "tests" / "opd" / "test_lab_opd.py").read_text())
    text, _ = strip_solutions(labs.source_of("opd").read_text(), keep={1})
    (opd / "opd.py").write_text(labs.flatten_imports(text))
    # Sandboxed wherever the sandbox runs for this test's own Python.
    trusted = sandbox.unavailable_reason() is not None
    report = json.loads(run("-m", "opd_literate.course", "grade", str(opd), "--json", "-",
                            *(["--trusted"] if trusted else [])))["labs"][0]
    assert [t["status"] for t in report["tasks"].values()] == [
        "passed", "not implemented", "not implemented"]
    assert report["score"] == 1 and report["files"] == {} and report["trusted"] is trusted
    run("-m", "opd_literate.course", "gs", "--lab", "opd", "--format", "gradescope")
    with zipfile.ZipFile(work / "gs" / "autograder.zip") as archive:
        assert "opd_literate/course/lab_tests/opd/test_lab_opd_hidden.py" in archive.namelist()
