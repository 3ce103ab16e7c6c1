r"""Handouts: a lab written to a folder, in any of its formats (``opd-handout``).

[write_lab][opd_literate.course.handouts.write_lab] writes what
[render_handout][opd_literate.course.handouts.render_handout] renders: the student's folder
([labs.render_lab][opd_literate.course.labs.render_lab], as Python files or as a notebook),
Gradescope's autograder zip beside it
([gradescope.autograder_files][opd_literate.course.gradescope.autograder_files]), or an
nbgrader course folder. The folder gets a ``.opd-handout`` marker
([MARKER][opd_literate.course.labs.MARKER]) that lists the files written and their SHA-256;
``force`` replaces only such a folder, deletes only those files (refusing if one was changed
since) and keeps every other file.

This is the top of ``course/``: it imports what a lab is (``labs``) and the platforms' formats
(``gradescope``), and nothing of the course imports it but the command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

from .gradescope import autograder_files, zip_bytes
from .labs import LABS, MARKER, STUDENT_FORMATS, Lab, render_lab, render_notebook

__all__ = ["FORMATS", "render_handout", "write_lab"]

FORMATS = (*STUDENT_FORMATS, "gradescope", "nbgrader")
"""The ways to write a lab: Python files; the student module as a Jupyter notebook; a
Gradescope autograder zip beside the student's folder; an nbgrader course folder."""



def sha256_of(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written_files(out_dir: pathlib.Path) -> dict:
    """The files the marker of ``out_dir`` lists, ``{relative path: sha256}``; ValueError when
    the folder has no marker or it is not one this tool writes."""
    marker = out_dir / MARKER
    refuse = (f"OUTDIR {str(out_dir)!r} was not written by opd-handout (no valid {MARKER} "
              "marker); --force replaces only a folder this tool wrote")
    if marker.is_symlink() or not marker.is_file():
        raise ValueError(refuse)
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        assert manifest["tool"] == "opd-handout" and isinstance(files, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ValueError(refuse) from None
    for name in files:
        relative = pathlib.PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(refuse)
    return files


def _replaceable(out_dir: pathlib.Path) -> dict:
    """What ``--force`` may delete in ``out_dir``: the files its marker lists, when every one of
    them is still as this tool wrote it (or gone). Raises ValueError, deleting nothing,
    otherwise: a changed file holds someone else's work."""
    if out_dir.is_symlink():
        raise ValueError(f"OUTDIR {str(out_dir)!r} is a symbolic link (to "
                         f"{os.readlink(out_dir)!r}); --force replaces only a real folder")
    files = _written_files(out_dir)
    for name, digest in sorted(files.items()):
        path = out_dir / name
        above = [p for p in pathlib.PurePosixPath(name).parents if p.parts]
        if any((out_dir / p).is_symlink() for p in above):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: a folder above {name} is a symbolic "
                             "link; --force replaces only real folders")
        if path.is_symlink() or (path.exists() and (not path.is_file()
                                                     or sha256_of(path) != digest)):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: {name} was changed since opd-handout "
                             "wrote it; move it away first (--force deletes only unchanged "
                             "files it wrote)")
    return files


def _remove(out_dir: pathlib.Path, files: dict) -> None:
    """Delete ``files`` and the marker, then the folders they leave empty (nothing else)."""
    for name in sorted(files):
        (out_dir / name).unlink(missing_ok=True)
    (out_dir / MARKER).unlink()
    folders = {p for name in files for p in pathlib.PurePosixPath(name).parents if p.parts}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        path = out_dir / folder
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def write_lab(lab_name: str, out_dir, force: bool = False,
              format: str = "files") -> list[pathlib.Path]:
    """Write the lab folder(s) for ``lab_name`` (a name of ``LABS``, or "all") under ``out_dir``.

    ``all`` writes one sub-folder per lab. ``out_dir`` gets a
    [MARKER][opd_literate.course.labs.MARKER] file listing every file written, with its SHA-256.
    An existing non-empty ``out_dir`` is refused unless ``force``. ``force`` replaces only a real
    folder (not a symbolic link) that holds this marker, and deletes only the files the marker
    lists; it refuses, before deleting anything, when one of them was changed since, or when a file
    it would write exists and is not one of them. Every other file stays. ``format="notebook"``
    writes each lab's student module as a Jupyter notebook ``<lab>.ipynb`` instead (see
    [opd_literate.course.labs.render_notebook][]); ``"gradescope"`` writes, per lab, the
    student's folder as ``student/`` and the autograder as ``autograder.zip``
    ([opd_literate.course.gradescope.autograder_files][]); ``"nbgrader"`` writes one nbgrader
    course folder, ``source/<lab>/`` for each lab (the notebook with its solutions in nbgrader's
    form) and ``nbgrader_config.py``. Returns the lab folders written (for nbgrader, the course
    folder).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose from {', '.join(FORMATS)}")
    if lab_name != "all" and lab_name not in LABS:
        raise ValueError(f"unknown lab {lab_name!r}; choose from {', '.join([*LABS, 'all'])}")
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUTDIR {str(out_dir)!r} exists and is not a folder")
    names = list(LABS) if lab_name == "all" else [lab_name]
    # nbgrader: one course folder (source/<lab>/ for each lab), not one folder a lab.
    per_lab = lab_name == "all" and format != "nbgrader"
    files = {(f"{name}/" if per_lab else "") + relative: text
             for name in names for relative, text in render_handout(LABS[name], format).items()}
    replaceable = {}
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ValueError(f"OUTDIR {str(out_dir)!r} exists and is not empty; "
                             "use --force to replace a folder this tool wrote")
        replaceable = _replaceable(out_dir)
    for relative in files:  # a file that --force keeps must not be overwritten either
        above = [p for p in pathlib.PurePosixPath(relative).parents if p.parts]
        taken = relative not in replaceable and os.path.lexists(out_dir / relative)
        if taken or any((out_dir / p).is_symlink() or (out_dir / p).is_file() for p in above):
            raise ValueError(f"OUTDIR {str(out_dir)!r}: {relative} (or a folder above it) "
                             "exists and was not written by opd-handout; move it away first")
    if replaceable:
        _remove(out_dir, replaceable)
    files = {relative: text if isinstance(text, bytes) else text.encode()
             for relative, text in files.items()}
    digests = {relative: hashlib.sha256(data).hexdigest()
               for relative, data in sorted(files.items())}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for relative, text in files.items():
            path = out_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text)
        (out_dir / MARKER).write_bytes(json.dumps({"tool": "opd-handout", "lab": lab_name,
                                                  "files": digests}, indent=1).encode() + b"\n")
    except OSError as error:
        raise ValueError(f"cannot write OUTDIR {str(out_dir)!r}: "
                         f"{error.strerror or error}") from error
    return [out_dir / name for name in names] if per_lab else [out_dir]



_NBGRADER_CONFIG = '''"""nbgrader's configuration of this course folder (written by opd-handout).

From this folder: nbgrader generate_assignment LAB (LAB: a folder of source/), then
nbgrader autograde LAB once the submissions are in submitted/<student>/LAB/.
"""

c = get_config()  # noqa: F821 (nbgrader's configuration API provides it)
c.CourseDirectory.root = "."
# Seconds a cell may run at autograde (nbgrader's default is 30): a check cell imports torch
# and runs a task's tests, which can take longer on a loaded machine.
c.Execute.timeout = 300
'''


def render_handout(lab: Lab, format: str = "files") -> dict[str, str | bytes]:
    """The files ``write_lab`` writes for one lab, ``{relative path: text or bytes}``.

    ``"files"`` and ``"notebook"``: the student's folder
    ([labs.render_lab][opd_literate.course.labs.render_lab]). ``"gradescope"``: that folder as
    ``student/`` (its README says how the autograder grades) and ``autograder.zip``.
    ``"nbgrader"``: ``source/<lab>/``, the notebook folder with the solutions in nbgrader's
    form, and ``nbgrader_config.py``.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose from {', '.join(FORMATS)}")
    if format in STUDENT_FORMATS:
        return render_lab(lab, format)
    if format == "gradescope":
        files = render_lab(lab, "files")
        modules = " or ".join(f"`{m}.py`" for m in lab.student_modules)
        files["README.md"] = files["README.md"].replace(
            "Check your work (from", f"Hand in {modules} on Gradescope (or `{lab.name}.ipynb`, "
            "a notebook of the lab);\nits autograder grades it as described at the end, with "
            "more tests than this\nfolder holds (their results are shown after the due "
            "date).\n\nCheck your work (from", 1)
        files = {f"student/{name}": text for name, text in files.items()}
        files["autograder.zip"] = zip_bytes(autograder_files(lab))
        return files
    files = {f"source/{lab.name}/{name}": text
             for name, text in render_lab(lab, "notebook").items()}
    files[f"source/{lab.name}/{lab.name}.ipynb"] = json.dumps(
        render_notebook(lab, solutions=True), indent=1) + "\n"
    files["nbgrader_config.py"] = _NBGRADER_CONFIG
    return files
