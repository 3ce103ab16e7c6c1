"""Student folders for the grader's tests: a student module with some tasks solved, and a
folder nested deeper than any path can name."""

import os

from opd_literate.course import labs
from opd_literate.course.markers import strip_solutions


def write_student_module(lab_folder, module, stubs=None, keep=(), appended=""):
    """Write the student module with the tasks in ``keep`` solved, the stub of each task in
    ``stubs`` replaced by the given lines (indented as a function body), and ``appended`` (code
    run at import) at its end."""
    text, _ = strip_solutions(labs.source_of(module).read_text(), keep=set(keep))
    text = labs.flatten_imports(text)
    for task, lines in (stubs or {}).items():
        stub = next(line for line in text.split("\n")
                    if f'raise NotImplementedError("Task {task}:' in line)
        indent = stub[:len(stub) - len(stub.lstrip())]
        text = text.replace(stub, "\n".join(indent + line for line in lines))
    (lab_folder / f"{module}.py").write_text(text + appended)


def deep_folder(folder, levels, name="d", bottom=None):
    """Make ``levels`` nested folders called ``name`` below ``folder``, one level at a time
    (the whole path may be longer than a path may be), with a file ``bottom`` (``x = 1``) in
    the deepest one when given."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        if bottom is not None:
            with open(os.open(bottom, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as file:
                file.write("x = 1\n")
    finally:
        os.close(fd)
