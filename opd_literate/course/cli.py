r"""Lab handouts and a grader, generated from the library itself (one source for both).

The command line of the course tools (``opd-handout``, ``python -m opd_literate.course``)::

    python -m opd_literate.course OUTDIR --lab opd|mismatch|all [--format FORMAT] [--force]
    python -m opd_literate.course grade LABDIR [--json PATH] [--timeout SECONDS]
                                        [--memory-total GIB] [--trusted]
    python -m opd_literate.course gradescope [ROOT]     # inside Gradescope's autograder

The first writes lab folders ([write_lab][opd_literate.course.handouts.write_lab]) as Python
files, a notebook, a Gradescope autograder zip beside the student's folder, or an nbgrader
course folder (``--format files|notebook|gradescope|nbgrader``); ``OUTDIR``
receives a ``.opd-handout`` marker that lists the files written and their SHA-256, and
``--force`` replaces only such a folder, deletes only those files (refusing if one was changed
since) and keeps every other file. The second grades them
([grade][opd_literate.course.grade.grade]) and prints
[format_grade][opd_literate.course.grade.format_grade]'s report.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from .._files import replace_atomically
from .grade import format_grade, grade, printable
from .gradescope import main as gradescope_main
from .handouts import FORMATS, write_lab
from .labs import GRADE_TIMEOUT, MARKER
from .sandbox import SandboxUnavailable

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _grade_main(argv: list) -> int:
    import signal

    parser = _Parser(prog="opd-handout grade",
                     description="Grade a lab folder with the instructor's tests, task by task.")
    parser.add_argument("lab_dir", help="a folder written by opd-handout (or one holding such "
                                        "folders)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the report as JSON to PATH ('-' for standard output)")
    parser.add_argument("--timeout", type=float, default=GRADE_TIMEOUT,
                        help=f"seconds each task's calls may run (default {GRADE_TIMEOUT:g})")
    parser.add_argument("--memory-total", type=float, metavar="GIB",
                        help="bound the memory of all the student's processes together, in "
                             "GiB, by a memory cgroup (refused where none can be made); "
                             "without it, each process is bounded on its own")
    parser.add_argument("--trusted", action="store_true",
                        help="grade without the sandbox (the student's code then runs "
                             "unisolated, as your user, or as root as a user of its own): only "
                             "for code you trust, on a machine where bubblewrap cannot run")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    memory_total = None
    if args.memory_total is not None:
        if not (args.memory_total >= 1 / 16 and args.memory_total < 2**20):
            parser.error(f"--memory-total must be a number of GiB from 0.0625 (64 MiB), got "
                         f"{args.memory_total:g}")
        memory_total = int(args.memory_total * 2**30)
    folder = pathlib.Path(args.lab_dir)
    # a lab.json that is a link still marks a lab folder: grade() then refuses to read it
    if os.path.lexists(folder / "lab.json"):
        folders, batch = [folder], False
    else:  # a batch: each sub-folder with a lab.json; one that is a link is reported, not read
        try:
            folders = sorted(p for p in folder.iterdir() if os.path.lexists(p / "lab.json")
                             or (p.is_symlink() and p.is_dir()))
        except OSError as error:
            parser.error(f"{printable(args.lab_dir)!r} cannot be read ({error.strerror})")
        batch = True
    if not folders:
        parser.error(f"{printable(args.lab_dir)!r} is not a lab folder (no lab.json)")

    def stop(number, frame):  # SIGTERM: unwind like Ctrl-C, so the sandbox is killed
        raise KeyboardInterrupt(number)

    previous = signal.signal(signal.SIGTERM, stop)
    reports = []
    try:
        for lab_folder in folders:
            shown = printable(str(lab_folder), 300)
            if batch and lab_folder.is_symlink():
                reports.append(dict(folder=shown, error="a symbolic link to a folder: not "
                                                        "graded (it may be another's lab)"))
            else:
                try:
                    result = grade(lab_folder, timeout=args.timeout, trusted=args.trusted,
                                   memory_total=memory_total)
                except SandboxUnavailable as error:  # the machine's, not the submission's
                    parser.error(str(error))
                except (ValueError, RuntimeError) as error:
                    if not batch:
                        parser.error(printable(str(error), 1000))
                    reports.append(dict(folder=shown, error=printable(str(error))))
                except Exception as error:  # anything else one lab causes stays that lab's
                    reports.append(dict(folder=shown, error=f"not graded: the grader failed on "
                                        f"it ({type(error).__name__}: "
                                        f"{printable(str(error), 300)})"))
                else:
                    reports.append(dict(folder=shown, **result))
            if args.json != "-":
                last = reports[-1]
                print(format_grade(last) if "error" not in last else
                      f"lab folder {last['folder']}: {last['error']}", flush=True)
                if batch:
                    print(flush=True)
    except KeyboardInterrupt as interrupt:
        number = interrupt.args[0] if interrupt.args else signal.SIGINT
        print(f"opd-handout grade: stopped by {signal.Signals(number).name}; no process "
              "left running", file=sys.stderr)
        return 128 + int(number)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        text = json.dumps(dict(labs=reports), indent=1) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            try:
                replace_atomically(pathlib.Path(args.json), lambda tmp: tmp.write_text(text))
            except OSError as error:
                print(f"opd-handout grade: cannot write {printable(args.json)!r} "
                      f"({error.strerror})", file=sys.stderr)
                return 1
    return 0


def main(argv=None) -> int:
    """The command line: ``OUTDIR --lab NAME [--force]`` writes, ``grade LABDIR`` grades.

    Bad arguments (an unknown lab, a non-empty OUTDIR without ``--force``, ``--force`` on a
    folder this tool did not write or on a symbolic link, an OUTDIR that cannot be written, a
    folder without ``lab.json``, ``grade`` without a working sandbox and without
    ``--trusted``) exit with code 2 and a one-line message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:
        return _grade_main(argv[1:])
    if argv[:1] == ["gradescope"]:  # what the autograder zip's run_autograder runs
        return gradescope_main(argv[1:])
    parser = _Parser(prog="opd-handout", description=__doc__.split("\n\n")[0],
                     epilog="To grade a folder: opd-handout grade LABDIR")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write the lab into")
    parser.add_argument("--lab", default="all", help="opd, mismatch or all (default all)")
    parser.add_argument("--format", default="files", choices=FORMATS,
                        help="files (default): Python modules; notebook: the student module "
                             "as a Jupyter notebook <lab>.ipynb; gradescope: student/ and "
                             "autograder.zip; nbgrader: source/<lab>/ with the solutions, "
                             "for nbgrader generate_assignment")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty OUTDIR that this tool wrote (it deletes only "
                             f"the unchanged files listed in OUTDIR/{MARKER})")
    args = parser.parse_args(argv)
    try:
        folders = write_lab(args.lab, args.out_dir, force=args.force, format=args.format)
    except (ValueError, OSError) as error:  # bad input, or a folder that cannot be written
        parser.error(str(error))
    for folder in folders:
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
