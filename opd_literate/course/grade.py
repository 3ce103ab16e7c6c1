r"""The grader: a student's lab folder, graded task by task with the instructor's tests.

[grade][opd_literate.course.grade.grade] copies the student's folder into a temporary sandbox
without its tests, ``conftest.py``, ``pytest.ini``, compiled files or links, puts the
instructor's tests and given modules (rendered from the library by ``course.labs``) in their
place, and starts the grading harness there (``course/_harness.py``, a program of its own that
the grader copies into the sandbox: it runs with the standard library and pytest only, and
never imports this package). It reports each task as passed, not implemented, blocked, failed,
timed out, error, or without tests. See ``docs/instructors.md`` for what the sandbox does and
does not protect.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from .labs import (
    LABS,
    MARKER,
    PACKAGE,
    Lab,
    flatten_imports,
    read_source,
    render_lab,
    sha256_of,
    source_of,
    tasks_of,
)

__all__ = ["GRADE_TIMEOUT", "STATUSES", "HARNESS_PATH", "grade", "format_grade"]

GRADE_TIMEOUT = 60.0
"""Seconds each task's tests may run (``--timeout``); past it the task is *timed out*."""

STATUSES = ("passed", "not implemented", "blocked", "failed", "timed out", "error", "no tests")
"""Every status ``grade`` gives a task (see [opd_literate.course.grade.grade][])."""


HARNESS_PATH = pathlib.Path(__file__).with_name("_harness.py")
"""The grading harness, a program of its own: copied into each sandbox as ``harness.py`` and
run there, it imports the standard library and pytest only (never this package)."""

# What a grading sandbox never receives from the student's folder.
_SKIPPED_NAMES = {"__pycache__", ".pytest_cache", "conftest.py", "pytest.ini", "tox.ini",
                  "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py", MARKER}
_SKIPPED_SUFFIXES = {".so", ".pyd", ".pyc", ".pyo", ".pth", ".dylib", ".dll"}
_COPY_LIMIT = 50 * 2**20  # bytes: a lab is a few hundred kilobytes


def _lab_of(folder: pathlib.Path) -> Lab:
    manifest_path = folder / "lab.json"
    if not manifest_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a lab folder (no lab.json)")
    try:
        name = json.loads(manifest_path.read_text())["lab"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(folder / 'lab.json')!r} is not a lab manifest") from None
    if name not in LABS:
        raise ValueError(f"{str(folder / 'lab.json')!r} names an unknown lab {name!r}")
    return LABS[name]


def _copy_student_files(folder: pathlib.Path, work: pathlib.Path) -> list[str]:
    """Copy the student's own files into ``work``: regular files only, without tests, pytest
    configuration, compiled code or caches. Returns the names left out that could change how
    tests run (a ``conftest.py``, a ``pytest.ini``, compiled code, a link)."""
    ignored, size = [], 0
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        parts = relative.parts
        if parts[0] in ("tests", MARKER) or any(p in ("__pycache__", ".pytest_cache", ".git")
                                                for p in parts):
            continue
        if path.is_symlink():
            ignored.append(f"{relative} (a symbolic link)")
            continue
        if not path.is_file():
            continue
        if path.name in _SKIPPED_NAMES or path.suffix in _SKIPPED_SUFFIXES:
            if path.name not in ("pytest.ini", "conftest.py") or len(parts) > 1:
                ignored.append(str(relative))
            continue
        size += path.stat().st_size
        if size > _COPY_LIMIT:
            raise ValueError(f"{str(folder)!r} holds more than {_COPY_LIMIT >> 20} MiB; "
                             "a lab folder is a few hundred kilobytes")
        target = work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return ignored


def _notebook_modules(folder: pathlib.Path, lab: Lab) -> dict[str, str]:
    """The student modules assembled from the code cells of ``<lab>.ipynb`` that carry the
    ``module:<name>`` tag, in order; {} when the folder holds no notebook."""
    path = folder / f"{lab.name}.ipynb"
    if not path.is_file():
        return {}
    try:
        cells = json.loads(path.read_text())["cells"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(path)!r} is not a Jupyter notebook") from None
    modules = {}
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        for tag in tags:
            if cell.get("cell_type") == "code" and tag.startswith("module:"):
                modules.setdefault(tag.split(":", 1)[1], []).append(source.rstrip("\n"))
    return {name: "\n\n\n".join(parts) + "\n" for name, parts in modules.items()
            if name in lab.student_modules}


def _check_files(folder: pathlib.Path, instructor: dict) -> dict:
    """Each handout file other than the student modules that the folder changed or lacks:
    ``{name: "modified" | "missing"}``. The grade uses the instructor's copy either way."""
    found = {}
    for name, text in instructor.items():
        path = folder / name
        if not path.is_file():
            found[name] = "missing"
        elif sha256_of(path) != hashlib.sha256(text.encode()).hexdigest():
            found[name] = "modified"
    return found


def _scrubbed_environment(sandbox: pathlib.Path) -> dict:
    """The whole environment of the student's process: nothing from the grader's but PATH."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(sandbox / "home"),
            "TMPDIR": str(sandbox / "tmp"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _third_party(files: dict) -> list[str]:
    """The installed packages the lab's code imports (preloaded once by the harness)."""
    import ast

    own = {pathlib.PurePosixPath(name).stem for name in files}
    names = set()
    for name, text in files.items():
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return sorted(names - own - set(sys.stdlib_module_names))


def _run_harness(config: dict, sandbox: pathlib.Path, deadline: float) -> list[dict]:
    """Start the harness in its own process group and read its records; the group is killed
    however this ends (records read, time out, Ctrl-C, SIGTERM turned into SystemExit)."""
    import secrets
    import signal
    import time

    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    stderr_path = sandbox / "harness.stderr"
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-s", str(sandbox / "harness.py")], cwd=sandbox,
            env=_scrubbed_environment(sandbox), stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(write_end,),
            start_new_session=True)
    os.close(write_end)
    records, buffer = [], b""
    try:
        process.stdin.write(json.dumps(dict(config, nonce=nonce, result_fd=write_end)).encode())
        process.stdin.close()
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(read_end, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if not selector.select(timeout=left):
                    continue
                data = os.read(read_end, 1 << 16)
                if not data:
                    break
                buffer += data
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        pass  # the tasks without a record are reported as timed out
    finally:
        os.close(read_end)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the harness and every child it forked
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
    for line in buffer.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.pop("nonce", None) == nonce:
            records.append(record)
    if not records and process.returncode not in (0, None):
        lines = stderr_path.read_text(errors="replace").strip().split("\n")
        raise RuntimeError(f"the grading harness could not start: {lines[-1]}")
    return records


def _task_status(task: int, record) -> dict:
    """The status, counts and failure messages of one task from its harness record."""
    if record is None or "timed_out" in record:
        return dict(status="timed out", tests=0, passed=0,
                    messages=["timed out" if record is None
                              else f"timed out after {record['timed_out']:g} s"])
    if "error" in record:
        return dict(status="error", tests=0, passed=0, messages=[record["error"]])
    results = record["tests"]
    failed = [r for r in results if r["outcome"] == "failed"]
    messages = [f"{r['test']}: {r['message']}" for r in failed] + record["errors"]
    if record["tampered"]:
        messages.append("the student's code replaced " + ", ".join(record["tampered"][:5]))
    own_stub = [r for r in failed if f"NotImplementedError: Task {task}:" in r["message"]]
    other_stub = [r for r in failed if re.search(r"NotImplementedError: Task \d+:",
                                                 r["message"]) and r not in own_stub]
    if record["tampered"] or record["errors"]:
        status = "error"
    elif not results:
        status = "no tests"
    elif not failed:
        status = "passed"
    elif own_stub:
        status = "not implemented"
    elif len(other_stub) == len(failed):
        status = "blocked"
    else:
        status = "failed"
    return dict(status=status, tests=len(results),
                passed=sum(r["outcome"] == "passed" for r in results), messages=messages)


def grade(lab_dir, *, timeout: float = GRADE_TIMEOUT, jobs: int | None = None) -> dict:
    """Grade a lab folder (or a notebook lab) with the instructor's tests, task by task.

    The student's folder is copied into a temporary sandbox without its tests, ``conftest.py``,
    ``pytest.ini``, compiled files or links; the instructor's tests and given modules (rendered
    from the library) replace the student's copies, which are compared by SHA-256 and reported
    as ``modified`` or ``missing``. Each task's tests run in a forked child of a harness process
    started with a scrubbed environment in its own process group; the other tasks' functions
    are replaced by the reference versions in that child only (nothing is written to the
    student's folder). See ``docs/instructors.md`` for what this does and does not protect.

    A task is *passed* when all its tests pass, *not implemented* when one stops on its own
    ``NotImplementedError("Task N: ...")``, *blocked* when its only failures come from another
    task's stub, *timed out* when its tests run past ``timeout`` seconds, *error* when the
    student's code cannot be imported (a syntax error, a missing module: the message names
    file and line) or replaced a testing function, *no tests* when no test is marked with it,
    and *failed* otherwise. Returns ``{"lab", "tasks": {n: {"function", "status", "tests",
    "passed", "messages"}}, "score", "total", "files"}``.
    """
    import shutil
    import time

    folder = pathlib.Path(lab_dir)
    lab = _lab_of(folder)
    instructor = render_lab(lab)
    all_tasks = tasks_of(lab)
    functions = {}
    for number, name, module in all_tasks:
        functions.setdefault(str(number), []).append((module, name))
    notebook = _notebook_modules(folder, lab)
    checked = {name: text for name, text in instructor.items()
               if name.endswith(".py") and pathlib.PurePosixPath(name).stem
               not in lab.student_modules}
    checked.update({name: instructor[name] for name in ("pytest.ini", "conftest.py")})
    start = time.monotonic()
    sandbox = pathlib.Path(tempfile.mkdtemp(prefix="opd-grade-"))
    try:
        work = sandbox / "lab"
        for sub in (work, sandbox / "home", sandbox / "tmp"):
            sub.mkdir()
        ignored = _copy_student_files(folder, work)
        for name, text in notebook.items():
            (work / f"{name}.py").write_text(text)
        for name, text in instructor.items():  # the instructor's tests and given code
            if name.startswith("tests/") or (name.endswith(".py") and name in checked):
                (work / name).parent.mkdir(parents=True, exist_ok=True)
                (work / name).write_text(text)
        for name in ("conftest.py", "pytest.ini"):
            (work / name).unlink(missing_ok=True)
        # The grader's own configuration: the task marker only (no pythonpath, no addopts).
        (sandbox / "pytest.ini").write_text("[pytest]\nmarkers =\n    task(*numbers): the "
                                            "lab tasks a test checks\n")
        shutil.copyfile(HARNESS_PATH, sandbox / "harness.py")
        references = {m: flatten_imports(read_source(source_of(m)))
                      for m in lab.student_modules}
        real = [str(p.resolve()) for p in (work, sandbox / "tmp", sandbox / "home")]
        config = dict(
            work=real[0], write_roots=real, log_dir=str(sandbox),
            secret_roots=[str(PACKAGE.resolve())],
            blocked_modules=["opd_literate"], ini=str(sandbox / "pytest.ini"),
            tests=[f"tests/{pathlib.PurePosixPath(t).name}" for t in lab.tests],
            student_modules=list(lab.student_modules), functions=functions,
            given_modules=list(lab.given_modules),
            tasks=sorted({n for n, _, _ in all_tasks}), references=references,
            preload=_third_party(instructor), timeout=float(timeout),
            jobs=int(jobs or min(2, os.cpu_count() or 1)))
        deadline = start + 30 + len(config["tasks"]) * (timeout + 5)
        records = {r["task"]: r for r in _run_harness(config, sandbox, deadline)}
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)
    tasks = {}
    for number in config["tasks"]:
        names = ", ".join(name for _, name in functions[str(number)])
        tasks[number] = dict(function=names, **_task_status(number, records.get(number)))
    score = sum(t["status"] == "passed" for t in tasks.values())
    files = _check_files(folder, checked)
    files.update({name: "ignored" for name in ignored})
    return dict(lab=lab.name, tasks=tasks, score=score, total=len(tasks), files=files,
                format="notebook" if notebook else "files",
                seconds=round(time.monotonic() - start, 2))


def format_grade(result: dict) -> str:
    """The result of [opd_literate.course.grade.grade][] as a Markdown table, the first line of
    each failure, the files that differ from the handout, and a score line."""
    lines = [f"lab {result['lab']}", "", "| task | function | status | tests passed |",
             "| --- | --- | --- | ---: |"]
    for n, task in result["tasks"].items():
        lines.append(f"| {n} | {task['function']} | {task['status']} | "
                     f"{task['passed']}/{task['tests']} |")
    failures = [(n, m) for n, task in result["tasks"].items()
                if task["status"] not in ("passed", "not implemented") for m in task["messages"]]
    if failures:
        lines += ["", "failures:"] + [f"- Task {n}: {m}" for n, m in failures]
    if result.get("files"):
        lines += ["", "files that differ from the handout (the instructor's copy was used):"]
        lines += [f"- {name}: {state}" for name, state in sorted(result["files"].items())]
    lines += ["", f"score: {result['score']}/{result['total']}"]
    return "\n".join(lines)

