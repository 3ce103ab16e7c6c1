r"""The grader: a lab folder graded task by task, with a verdict that student code cannot reach.

[grade][opd_literate.course.grade.grade] copies the student's own files into a temporary
folder (without tests, ``conftest.py``, pytest configuration, compiled files or links), puts
the instructor's given modules beside them, and starts the grading runner there inside the
sandbox (``course/sandbox.py``): ``course/_runner.py``, a program that imports the standard
library, numpy and torch only. The runner calls the student's functions on the inputs of the
grading cases (``course/cases.py``) and writes back what came out as plain arrays. This process
reads them back (``allow_pickle=False``), validates them, and judges them against the lab
tests' expectations with the library's reference functions: no reference code and no judge
ever runs where the student's code runs. It reports each task as passed, not implemented,
blocked, failed, timed out, error, or without tests. See ``docs/instructors.md``.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import re
import stat
import sys
import tempfile

from . import sandbox
from .labs import GRADE_TIMEOUT, LABS, MARKER, Lab, notebook_modules, render_lab, tasks_of

__all__ = ["STATUSES", "RUNNER_PATH", "MEMORY_LIMIT", "FILE_LIMIT",
           "DEPTH_LIMIT", "grade", "format_grade", "printable", "runner_states"]


STATUSES = ("passed", "not implemented", "blocked", "failed", "timed out", "error", "no tests")
"""Every status ``grade`` gives a task (see [opd_literate.course.grade.grade][])."""

RUNNER_PATH = pathlib.Path(__file__).with_name("_runner.py")
"""The grading runner, a program of its own: copied into each grading folder as ``runner.py``
and run there in the sandbox; it imports the standard library, numpy and torch only."""

MEMORY_LIMIT = 2 << 30
"""Bytes of address space of the runner and each task's process (``RLIMIT_AS``): torch itself
takes about 0.8 GiB, a lab's inputs and outputs a few dozen MiB."""

FILE_LIMIT = 256 << 20
"""Bytes the runner may write to one file (``RLIMIT_FSIZE``) and the grader reads back of one
task's arrays: the largest of these labs, the estimates of the mismatch lab's Task 3, take
10 MiB."""

# What a grading folder never receives from the student's folder.
_SKIPPED_NAMES = {"__pycache__", ".pytest_cache", "conftest.py", "pytest.ini", "tox.ini",
                  "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py", MARKER}
_SKIPPED_SUFFIXES = {".so", ".pyd", ".pyc", ".pyo", ".pth", ".dylib", ".dll"}
_COPY_LIMIT = 50 * 2**20  # bytes: a lab is a few hundred kilobytes
_RECORD_LIMIT = 16 << 20  # bytes of one task's JSON record
_MESSAGE_LIMIT = 500  # characters of an exception's first line, as the runner truncates it
_MAX_NDIM = 8
_OUTPUT_DTYPES = {  # the dtype a call reports -> the numpy dtype its values must have
    "float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "float32",
    "int64": "int64", "int32": "int32", "bool": "bool", "float": "float64", "int": "int64"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}\Z")
_NOTEBOOK_LIMIT = 8 << 20  # bytes of a lab's notebook (a handout notebook takes ~100 kB)

DEPTH_LIMIT = 32
"""Folders below a lab folder that a grade descends (a lab has two levels); anything deeper is
listed as ignored, and nothing deeper is ever copied or walked recursively."""


def printable(text, limit: int = _MESSAGE_LIMIT) -> str:
    r"""``text`` as a report may show it: one line of visible characters, at most ``limit``.

    Every character that could move the cursor, hide or reorder text on a terminal or a web
    page, or fail to encode is shown escaped, as Python writes it in a string literal: control
    characters (``\r``, ``\n``, ``\t``, the escape that starts a terminal sequence, the C1
    range), format characters (the bidirectional overrides and isolates, zero-width ones), line
    and paragraph separators, lone surrogates and unassigned code points. A report line then
    holds exactly what it says, and a student's message cannot draw over the table or the
    score. Longer text is cut, with ``…`` at its end.

    >>> printable("ok\r\x1b[2Kscore: 3/3\u202e")
    'ok\\r\\x1b[2Kscore: 3/3\\u202e'
    >>> printable("x" * 10, limit=4)
    'xxx…'
    >>> printable("\ud800 Ça va")
    '\\ud800 Ça va'
    """
    import unicodedata

    if not isinstance(text, str):
        text = str(text)
    out, size = [], 0
    for character in text:  # stops once past the limit: a huge message is not escaped whole
        if character == "\\":
            piece = "\\\\"  # doubled, so that an escape shown is never the student's text
        elif unicodedata.category(character) in _HIDDEN_CATEGORIES:
            piece = ascii(character)[1:-1]
        else:
            piece = character
        out.append(piece)
        size += len(piece)
        if size > limit:
            break
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[:max(limit - 1, 0)] + "…"


# Cc controls, Cf format (bidi, zero width), Cs surrogates, Co private use, Cn unassigned,
# Zl/Zp line and paragraph separators: none may reach a report as itself.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _read_regular(folder: pathlib.Path, name: str, limit: int) -> bytes | None:
    """The bytes of ``folder/name`` when it is a regular file, never through a symbolic link
    (neither the file nor ``folder`` itself); None when there is no such regular file. A file
    over ``limit`` bytes is a ValueError."""
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return _read_file(folder_fd, name, limit)
    except _TooLarge as error:
        raise ValueError(f"{printable(str(folder / name))}: {error}") from None
    except _Malformed:
        return None  # a link, a folder, a FIFO: not a file of the lab
    finally:
        os.close(folder_fd)


def _lab_of(folder: pathlib.Path) -> Lab:
    manifest_path = folder / "lab.json"
    data = _read_regular(folder, "lab.json", 1 << 16)
    if data is None:
        reason = "a symbolic link" if manifest_path.is_symlink() else "no lab.json"
        raise ValueError(f"{printable(str(folder))!r} is not a lab folder ({reason})")
    try:
        name = json.loads(data)["lab"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{printable(str(manifest_path))!r} is not a lab manifest") from None
    if not isinstance(name, str) or name not in LABS:
        raise ValueError(f"{printable(str(manifest_path))!r} names an unknown lab "
                         f"{printable(repr(name), 60)}")
    return LABS[name]


def walk_submission(folder: pathlib.Path):
    """``(relative parts, is_link, is_file, too_deep)`` for every entry below ``folder`` other
    than a folder entered (in no particular order: sort them), walked with an explicit stack (a
    folder nested a thousand levels deep is no recursion) and never through a symbolic link;
    below ``DEPTH_LIMIT`` levels a folder is reported as too deep and not entered."""
    stack = [()]
    while stack:
        parts = stack.pop()
        try:
            with os.scandir(folder.joinpath(*parts)) as entries:
                children = list(entries)
        except OSError:
            continue
        for entry in children:
            here = (*parts, entry.name)
            link = entry.is_symlink()
            is_dir = not link and entry.is_dir(follow_symlinks=False)
            if is_dir and len(here) > DEPTH_LIMIT:
                yield here, False, False, True
            elif is_dir:
                stack.append(here)
            else:
                yield here, link, not link and entry.is_file(follow_symlinks=False), False


def _copy_student_files(folder: pathlib.Path, work: pathlib.Path) -> list[str]:
    """Copy the student's own files into ``work``: regular files only, without tests, pytest
    configuration, compiled code or caches, nothing through a link and nothing deeper than
    ``DEPTH_LIMIT``. Returns the names left out that could change how tests run (a
    ``conftest.py``, a ``pytest.ini``, compiled code, a link, a folder too deep), printable."""
    ignored, size = [], 0
    for parts, link, regular, too_deep in sorted(walk_submission(folder)):
        relative = pathlib.PurePosixPath(*parts)
        if parts[0] in ("tests", MARKER) or any(p in ("__pycache__", ".pytest_cache", ".git")
                                                for p in parts):
            continue
        if too_deep:
            ignored.append(f"{printable(str(relative), 200)} (more than {DEPTH_LIMIT} "
                           "folders deep)")
            continue
        if link:
            ignored.append(f"{printable(str(relative), 200)} (a symbolic link)")
            continue
        if not regular:
            continue
        name = parts[-1]
        if name in _SKIPPED_NAMES or pathlib.PurePosixPath(name).suffix in _SKIPPED_SUFFIXES:
            if name not in ("pytest.ini", "conftest.py") or len(parts) > 1:
                ignored.append(printable(str(relative), 200))
            continue
        data = _read_regular(folder.joinpath(*parts[:-1]), name, _COPY_LIMIT - size + 1)
        if data is None:  # replaced meanwhile by something that is not a regular file
            continue
        size += len(data)
        if size > _COPY_LIMIT:
            raise ValueError(f"{printable(str(folder))!r} holds more than {_COPY_LIMIT >> 20} "
                             "MiB; a lab folder is a few hundred kilobytes")
        target = work.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return ignored


def _notebook_modules(folder: pathlib.Path, lab: Lab) -> dict[str, str]:
    """The student modules assembled from ``<lab>.ipynb`` by ``labs.notebook_modules`` (the
    tagged cells whole, and the definitions of the cells a student added); {} when the folder
    holds no notebook."""
    path = folder / f"{lab.name}.ipynb"
    data = _read_regular(folder, path.name, _NOTEBOOK_LIMIT)  # a link is not read: ignored
    if data is None:
        return {}
    try:
        notebook = json.loads(data)
        if not isinstance(notebook.get("cells"), list):
            raise ValueError
    except (ValueError, AttributeError, TypeError, RecursionError):
        raise ValueError(f"{printable(str(path))!r} is not a Jupyter notebook") from None
    try:
        return notebook_modules(notebook, lab)
    except (MemoryError, RecursionError) as error:  # a cell nested past what ast can parse
        raise ValueError(f"{printable(str(path))!r}: a cell cannot be parsed "
                         f"({type(error).__name__})") from None


def _check_files(folder: pathlib.Path, instructor: dict) -> dict:
    """Each handout file other than the student modules that the folder changed or lacks:
    ``{name: "modified" | "missing"}``. The grade uses the instructor's copy either way."""
    found = {}
    for name, text in instructor.items():
        relative = pathlib.PurePosixPath(name)
        try:
            data = _read_regular(folder.joinpath(*relative.parts[:-1]), relative.name,
                                 _COPY_LIMIT)
        except ValueError:
            data = b""  # larger than any handout file: not the instructor's
        if data is None:
            found[name] = "missing"
        elif data != text.encode():
            found[name] = "modified"
    return found


def _environment() -> dict:
    """The variables of the runner, over the sandbox's scrubbed ``PATH``, ``HOME``, ``TMPDIR``
    and ``LANG``: nothing of the grader's environment reaches it."""
    return {"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def _encode(lab_cases, module_of: dict) -> tuple[dict, dict]:
    """The calls of every case as JSON (``{task: {key: call}}``, keys ``"<case>:<call>"``), the
    toys they use, and the input arrays, ``{name: ndarray}``: what the runner receives."""
    from .cases import Array, Tensor, Toy

    arrays, toys, toy_names = {}, {}, {}

    def argument(value):
        if isinstance(value, Tensor):
            name = f"input{len(arrays)}"
            arrays[name] = value.values
            return {"tensor": name, "dtype": value.dtype, "requires_grad": value.requires_grad}
        if isinstance(value, Array):
            name = f"input{len(arrays)}"
            arrays[name] = value.values
            return {"array": name}
        if isinstance(value, Toy):
            if id(value.toy) not in toy_names:
                name = toy_names[id(value.toy)] = f"toy{len(toys)}"
                toys[name] = {"arrays": {}, "scalars": {}}
                for key, item in value.toy.items():
                    if hasattr(item, "shape") and getattr(item, "ndim", 0) > 0:
                        arrays[f"{name}.{key}"] = item
                        toys[name]["arrays"][key] = f"{name}.{key}"
                    else:
                        toys[name]["scalars"][key] = item.item() if hasattr(item, "item") else item
            return {"toy": toy_names[id(value.toy)]}
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": repr(value)}
        return value

    calls = {}
    for index, case in enumerate(lab_cases):
        for key, call in case.calls.items():
            calls.setdefault(str(case.task), {})[f"{index}:{key}"] = dict(
                module=module_of[call.function], function=call.function,
                args=[argument(a) for a in call.args],
                kwargs={k: argument(v) for k, v in call.kwargs.items()}, backward=call.backward)
    return dict(calls=calls, toys=toys), arrays


class _Malformed(ValueError):
    """What the runner wrote back cannot be a call's output."""


class _TooLarge(_Malformed):
    """A file over the size limit of what is read of it."""


def _read_file(folder_fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``name`` of the output folder, or None if there is none;
    a link, a folder or a file over ``limit`` bytes is _Malformed (never followed)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise _Malformed(f"{name} cannot be opened ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a folder, a FIFO that would block the grader
            raise _Malformed(f"{name} is not a regular file")
        if info.st_size > limit:
            raise _TooLarge(f"{name} holds {info.st_size} bytes, more than {limit}")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, 1 << 20)):  # it may grow meanwhile
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise _TooLarge(f"{name} holds more than {limit} bytes")
    return b"".join(chunks)


def _read_arrays(data: bytes | None) -> dict:
    """The arrays of a task's ``.npz``: plain numeric arrays only, their total size bounded."""
    import zipfile

    import numpy as np

    if data is None:
        return {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            if sum(info.file_size for info in archive.infolist()) > FILE_LIMIT:
                raise _Malformed(f"the arrays take more than {FILE_LIMIT} bytes")
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except _Malformed:
        raise
    except Exception as error:  # a truncated or forged archive, an object array
        raise _Malformed(f"the arrays cannot be read ({type(error).__name__}: "
                         f"{str(error)[:200]})") from None
    return arrays


def _check_array(array, what: str, dtype: str | None = None, shape=None):
    import numpy as np

    if type(array) is not np.ndarray or array.dtype.kind not in "biuf":
        raise _Malformed(f"{what} is not a numeric array")
    if array.ndim > _MAX_NDIM:
        raise _Malformed(f"{what} has {array.ndim} dimensions")
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise _Malformed(f"{what} holds {array.dtype} values, reported as {dtype}")
    if shape is not None and array.shape != tuple(shape):
        raise _Malformed(f"{what} has shape {array.shape}, its input {tuple(shape)}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise _Malformed(f"{what} holds non-finite values (nan or inf)")


def _output(key: str, call: dict, record, arrays: dict, inputs: dict):
    """The validated output of one call, or the student's exception as ``(type, message)``."""
    from .cases import Output

    if not isinstance(record, dict):
        raise _Malformed("no record of this call")
    if record.get("status") == "raised":
        kind, message = record.get("type"), record.get("message")
        if not (isinstance(kind, str) and _IDENTIFIER.match(kind) and isinstance(message, str)):
            raise _Malformed("an exception record without a type name and a message")
        return kind, printable(message.split("\n")[0])
    if record.get("status") != "ok":
        raise _Malformed(f"status {str(record.get('status'))[:40]!r}")
    dtype = record.get("dtype")
    if dtype not in _OUTPUT_DTYPES:
        raise _Malformed(f"values of an unexpected dtype {str(dtype)[:40]!r}")
    flags = {name: record.get(name, False) for name in ("requires_grad", "grad_fn")}
    if not all(isinstance(flag, bool) for flag in flags.values()):
        raise _Malformed("requires_grad or grad_fn is not a boolean")
    values = arrays.get(f"{key}.value")
    _check_array(values, "the result", _OUTPUT_DTYPES[dtype])
    wanted = {str(n): a for n, a in [*enumerate(call["args"]), *call["kwargs"].items()]
              if isinstance(a, dict) and a.get("requires_grad")}
    reported = record.get("grads")
    if not isinstance(reported, dict) or set(reported) != set(wanted) or not all(
            isinstance(flag, bool) for flag in reported.values()):
        raise _Malformed("the gradient record does not list the inputs that require one")
    grads = {}
    for name, argument in wanted.items():
        if reported[name]:
            grad = arrays.get(f"{key}.grad.{name}")
            source = inputs[argument["tensor"]]
            _check_array(grad, f"the gradient of input {name}",
                         _OUTPUT_DTYPES[argument["dtype"]], source.shape)
            grads[name] = (grad, argument["dtype"])
    return Output(function=call["function"], values=values, dtype=dtype, grads=grads, **flags)


def _read_task(folder_fd: int, task: int, calls: dict, inputs: dict, state) -> dict:
    """One task's outcome from the runner's files: ``{"timed_out": s}``, ``{"error": line}`` or
    ``{"outputs": {key: Output | (type, message) | _Malformed}}``; never raises."""
    try:
        text = _read_file(folder_fd, f"task{task}.json", _RECORD_LIMIT)
        if text is None:
            if isinstance(state, dict) and isinstance(state.get("timed_out"), (int, float)):
                return {"timed_out": float(state["timed_out"])}
            status = state.get("wait_status") if isinstance(state, dict) else None
            return {"error": "the task's process ended without a result"
                             + (f" (wait status {status})" if isinstance(status, int) else "")}
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("calls", {}), dict):
            raise _Malformed("the task's record is not a JSON object of calls")
        if "import_error" in record:
            return {"error": printable(str(record["import_error"]).split("\n")[0])}
        arrays = _read_arrays(_read_file(folder_fd, f"task{task}.npz", FILE_LIMIT))
    except (_Malformed, ValueError, RecursionError) as error:
        return {"error": f"the task's output cannot be read: {printable(str(error), 200)}"}
    outputs = {}
    for key, call in calls.items():
        try:
            outputs[key] = _output(key, call, record["calls"].get(key), arrays, inputs)
        except _Malformed as error:
            outputs[key] = error
    return {"outputs": outputs}


def runner_states(stdout: bytes) -> dict | None:
    """The runner's own account of each task (``{task: {"timed_out" | "wait_status"}}``, or
    ``{"runner_error": line}``), from the last line of its standard output: a channel that no
    student code can write to (each task's process has its output on ``/dev/null`` before it
    imports anything of the student's, and the runner is not dumpable, so ``/proc`` does not
    open its pipe). None when that line is not such an account (the runner was killed first)."""
    lines = stdout.decode("utf-8", errors="replace").strip().split("\n")
    try:
        states = json.loads(lines[-1]).get("opd_runner_states")
    except (ValueError, AttributeError, RecursionError):
        return None
    return states if isinstance(states, dict) else None


def _read_outcomes(out: pathlib.Path, tasks_numbers: list, spec: dict, arrays: dict,
                   result, timeout: float) -> dict:
    """Each task's outcome (``_read_task``) from the runner's output folder ``out`` and its
    account on standard output (``runner_states``); a folder that student code replaced (by a
    link, a file) makes every task an error."""
    states = runner_states(result.stdout)
    if states is not None and "runner_error" in states:
        line = printable(str(states["runner_error"]), 200)
        return {task: {"error": f"the grading runner failed: {line}"} for task in tasks_numbers}
    try:
        folder_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return {task: {"error": "the task's output cannot be read: the output folder was "
                                "replaced (by a link or a file)"} for task in tasks_numbers}
    try:
        outcomes = {}
        for task in tasks_numbers:
            state = (states or {}).get(str(task))
            if state is None and result.timed_out:
                state = {"timed_out": timeout}
            outcomes[task] = _read_task(folder_fd, task, spec["calls"].get(str(task), {}),
                                        arrays, state)
    finally:
        os.close(folder_fd)
    if states is None and not result.timed_out:  # the runner ended before its account
        for outcome in outcomes.values():
            if "error" in outcome:
                outcome["error"] += (f"; the grading runner ended without its account "
                                     f"(exit status {result.returncode})")
    return outcomes


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).split("\n") if line.strip()] or [""]
    return lines[0][:_MESSAGE_LIMIT]


_STUB = re.compile(r"Task (\d+):")


def _judge_case(case, index: int, outputs: dict) -> dict:
    """``{"name", "passed", "message", "stub"}`` for one case: its calls' outputs, judged. A
    call that raised fails the case with the exception's first line (``stub``: the task whose
    ``NotImplementedError("Task N: ...")`` it was), unless the call ``raises``: its judge then
    gets a ``Raised``; a malformed output fails it too, and so does a judge that cannot run on
    the values that came back."""
    from .cases import Raised

    own = {}
    for key, call in case.calls.items():
        output = outputs[f"{index}:{key}"]
        if call.raises:  # the judge asks what happened: an exception, or none
            output = Raised(*output) if isinstance(output, tuple) else Raised(raised=False)
        if isinstance(output, _Malformed):
            return dict(name=case.name, passed=False, stub=None,
                        message=f"{case.name}: {call.function} gave a malformed output: "
                                f"{printable(str(output))}")
        if isinstance(output, tuple):
            kind, message = output
            stub = _STUB.match(message) if kind == "NotImplementedError" else None
            return dict(name=case.name, passed=False, stub=stub and int(stub.group(1)),
                        message=f"{case.name}: {kind}: {message}")
        own[key] = output
    try:
        case.judge(own)
    except AssertionError as error:
        text = printable(_first_line(error))
        return dict(name=case.name, passed=False, stub=None,
                    message=f"{case.name}: AssertionError" + (f": {text}" if text else ""))
    except Exception as error:  # values the judge cannot even compare (a wrong shape, say)
        return dict(name=case.name, passed=False, stub=None,
                    message=f"{case.name}: {type(error).__name__}: "
                            f"{printable(_first_line(error))}")
    return dict(name=case.name, passed=True, stub=None, message="")


def _task_status(task: int, task_cases: list, outcome: dict) -> dict:
    """The status, counts, failure messages and per-case entries of one task."""
    if "timed_out" in outcome:
        return dict(status="timed out", tests=0, passed=0, cases=[],
                    messages=[f"timed out after {outcome['timed_out']:g} s"])
    if "error" in outcome:
        return dict(status="error", tests=0, passed=0, cases=[], messages=[outcome["error"]])
    judged = [_judge_case(case, index, outcome["outputs"]) for index, case in task_cases]
    failed = [c for c in judged if not c["passed"]]
    if not judged:
        status = "no tests"
    elif not failed:
        status = "passed"
    elif any(c["stub"] == task for c in failed):
        status = "not implemented"
    elif all(c["stub"] not in (None, task) for c in failed):
        status = "blocked"
    else:
        status = "failed"
    return dict(status=status, tests=len(judged), passed=len(judged) - len(failed),
                messages=[c["message"] for c in failed],
                cases=[dict(name=c["name"], passed=c["passed"], message=c["message"])
                       for c in judged])


def _identity(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


def _remove(path: pathlib.Path) -> None:
    """Remove a grading folder whatever the student's code did to it: any permissions, links
    (removed, never followed), a folder nested thousands of levels deep. It walks down and up
    with one open folder at a time (``..`` from the folder it is in), so depth costs neither
    recursion, nor open files, nor a path. Every process of the grade has ended by then; should
    one have survived and moved a folder out from under the walk, the way up no longer leads
    to the folder it came down from (its device and inode are checked at each level), and the
    removal stops there rather than walk out of the grading folder."""
    directory = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(path, directory)
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    names, skipped = [], [set()]  # the way down; per level, what could not be removed
    identities = [_identity(fd)]  # (device, inode) of each folder on the way down
    while True:
        try:
            os.fchmod(fd, 0o700)  # a folder the student made unwritable or unreadable
        except OSError:
            pass
        child = None
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.name in skipped[-1]:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        skipped[-1].add(entry.name)
        except OSError:
            pass
        if child is not None:
            try:
                inner = os.open(child, directory, dir_fd=fd)
            except OSError:
                skipped[-1].add(child)
                continue
            os.close(fd)
            fd = inner
            names.append(child)
            skipped.append(set())
            identities.append(_identity(fd))
            continue
        if not names:
            os.close(fd)
            break
        try:
            parent = os.open("..", directory, dir_fd=fd)
        finally:
            os.close(fd)
        fd = parent
        identities.pop()
        if _identity(fd) != identities[-1]:  # moved away: ".." is no longer the way back
            os.close(fd)
            return
        skipped.pop()
        name = names.pop()
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            skipped[-1].add(name)
    try:
        os.rmdir(path)
    except OSError:
        pass


def grade(lab_dir, *, timeout: float = GRADE_TIMEOUT, jobs: int | None = None,
          trusted: bool = False, memory_total: int | None = None) -> dict:
    """Grade a lab folder (or a notebook lab) task by task, with a verdict computed here.

    The student's own files are copied into a temporary folder, without its tests,
    ``conftest.py``, pytest configuration, compiled files or links, and with the instructor's
    given modules; the student's copies of the handout files are compared by SHA-256 and
    reported as ``modified``, ``missing`` or ``ignored`` in ``files``. The grading runner runs
    there in the sandbox (``course/sandbox.py``: see ``docs/instructors.md`` for what it
    isolates), each task in its own process: it calls the student's functions on the inputs of
    the task's cases ([opd_literate.course.cases][]) and writes back values and gradients as
    plain arrays. This process validates them (dtype, shape, finite, size) and judges them;
    where a lab test checks several tasks, only the graded task's function is the student's
    and the others' part is computed here with the library's reference.

    A task is *passed* when all its cases pass, *not implemented* when one stops on its own
    ``NotImplementedError("Task N: ...")``, *blocked* when its only failures come from another
    task's stub (the student's own code calling it), *timed out* when its calls run past
    ``timeout`` seconds, *error* when the student's code cannot be imported (the message names
    file and line), its process ended without a readable result, or the sandbox itself failed
    (``sandbox.Result.fault``: then no task of the folder is graded, and the next folder is),
    *no tests* when it has no case, and *failed* otherwise (a wrong value, an exception, a
    malformed output). The lab folder itself is hidden from the sandbox (``sandbox.run``'s
    ``hidden``).

    Without a working sandbox it raises ``sandbox.SandboxUnavailable`` (naming why, and
    offering ``trusted`` only where the machine cannot run bubblewrap, not where the sandbox's
    set-up failed) unless ``trusted``: then the runner runs as your user, unisolated (the
    verdict is still computed here; as root, the runner runs as an unprivileged user of its
    own where it can: see ``sandbox.run``). ``memory_total`` bounds the memory of all the
    runner's processes together, in bytes, by a memory cgroup
    (``sandbox.Limits.memory_total_bytes``: refused with ``SandboxUnavailable`` where none can
    be made). Returns ``{"lab", "tasks": {n: {"function", "status",
    "tests", "passed", "messages", "cases": [{"name", "passed", "message"}]}}, "score",
    "total", "files", "format", "trusted", "seconds", "limits"}``; ``limits`` the bounds as
    applied: ``isolated``, ``task_seconds``, ``wall_seconds``, ``memory_bytes_per_process``
    (address space, per process), ``memory_bytes_total`` (``memory_total``: None where nothing
    bounds their sum), ``file_bytes``, ``processes``,
    ``process_bound`` (what enforces it here, ``sandbox.process_limit``: it starts with "none"
    where nothing does) and the sandbox's ``notes`` (guarantees that did not hold).
    """
    import time

    import numpy as np

    from .cases import cases_of

    if not isinstance(trusted, bool):
        raise TypeError(f"trusted must be True or False, got {trusted!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if memory_total is not None and (isinstance(memory_total, bool)
                                     or not isinstance(memory_total, int) or memory_total < 2**26):
        raise ValueError("memory_total must be None or a number of bytes of at least 64 MiB "
                         f"(2**26), got {memory_total!r}")
    folder = pathlib.Path(lab_dir)
    lab = _lab_of(folder)
    if not trusted:
        reason = sandbox.unavailable_reason()
        if reason is not None:  # --trusted is offered only where bwrap cannot run at all
            raise sandbox.SandboxUnavailable(sandbox.refusal_message(
                reason, "cannot grade untrusted work without the sandbox",
                "grade with --trusted (trusted=True) only code you trust, it then runs as your "
                "user"))
    instructor = render_lab(lab)
    all_tasks = tasks_of(lab)
    functions, module_of = {}, {}
    for number, name, module in all_tasks:
        functions.setdefault(number, []).append(name)
        module_of[name] = module
    lab_cases = cases_of(lab)
    notebook = _notebook_modules(folder, lab)
    checked = {name: text for name, text in instructor.items()
               if name.endswith(".py") and pathlib.PurePosixPath(name).stem
               not in lab.student_modules}
    checked.update({name: instructor[name] for name in ("pytest.ini", "conftest.py")})
    start = time.monotonic()
    spec, arrays = _encode(lab_cases, module_of)
    tasks_numbers = sorted(functions)
    jobs = int(jobs or min(2, os.cpu_count() or 1))
    spec.update(tasks=tasks_numbers, student_modules=list(lab.student_modules),
                timeout=float(timeout), jobs=jobs)
    work = pathlib.Path(tempfile.mkdtemp(prefix="opd-grade-"))
    try:
        lab_copy = work / "lab"
        for sub in (lab_copy, work / "out"):
            sub.mkdir()
        ignored = _copy_student_files(folder, lab_copy)
        for name, text in notebook.items():
            (lab_copy / f"{name}.py").write_text(text)
        for module in lab.given_modules:  # the instructor's copies, whatever the student's say
            (lab_copy / f"{module}.py").write_text(instructor[f"{module}.py"])
        (work / "spec.json").write_text(json.dumps(spec, allow_nan=False))
        np.savez(work / "inputs.npz", **arrays)
        (work / "runner.py").write_bytes(RUNNER_PATH.read_bytes())
        rounds = -(-len(tasks_numbers) // jobs)
        wall = 30 + rounds * (timeout + 5)
        limits = sandbox.Limits(wall_seconds=wall, cpu_seconds=math.ceil(wall),
                                memory_bytes=MEMORY_LIMIT, file_bytes=FILE_LIMIT,
                                processes=64,  # processes and threads of the runner, together
                                memory_total_bytes=memory_total)
        # -s: no user site; the runner drops its own folder from sys.path before student code.
        # The student's folder itself is hidden: the sandbox refuses where it would show it.
        result = sandbox.run([sys.executable, "-s", "runner.py"], work, limits=limits,
                             trusted=trusted, env=_environment(), hidden=[folder])
        applied = dict(isolated=not trusted, task_seconds=float(timeout),
                       wall_seconds=float(wall), memory_bytes_per_process=MEMORY_LIMIT,
                       memory_bytes_total=memory_total,
                       file_bytes=FILE_LIMIT, processes=limits.processes,
                       process_bound=sandbox.process_limit(trusted),
                       notes=[printable(note, 300) for note in result.notes])
        if result.fault is not None:  # nothing this run wrote is to be trusted: no grade
            outcomes = {task: {"error": f"not graded: the sandbox failed ({result.fault}); "
                                        "grade this folder again, and report it if it recurs"}
                        for task in tasks_numbers}
        else:
            outcomes = _read_outcomes(work / "out", tasks_numbers, spec, arrays, result,
                                      timeout)
    finally:
        _remove(work)
    tasks = {}
    for number in tasks_numbers:
        task_cases = [(i, c) for i, c in enumerate(lab_cases) if c.task == number]
        tasks[number] = dict(function=", ".join(functions[number]),
                             **_task_status(number, task_cases, outcomes[number]))
    score = sum(t["status"] == "passed" for t in tasks.values())
    files = _check_files(folder, checked)
    files.update({name: "ignored" for name in ignored})
    return dict(lab=lab.name, tasks=tasks, score=score, total=len(tasks), files=files,
                format="notebook" if notebook else "files", trusted=trusted,
                seconds=round(time.monotonic() - start, 2), limits=applied)


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
    if result.get("trusted"):
        lines += ["", "graded with --trusted: the student's code ran without the sandbox"]
    limits = result.get("limits")
    if limits:
        bound = limits["process_bound"]
        total = limits.get("memory_bytes_total")
        total = ("no bound on their sum" if total is None else
                 f"{total / 2**30:.3g} GiB of memory all together, by a memory cgroup")
        lines += ["", f"limits: {limits['task_seconds']:g} s a task, {limits['wall_seconds']:g} s "
                      f"the whole run; {limits['memory_bytes_per_process'] / 2**30:g} GiB of "
                      f"address space a process ({total}); "
                      f"{limits['file_bytes'] >> 20} MiB a file; "
                      + (f"{limits['processes']} processes and threads ({bound})"
                         if not bound.startswith("none") else
                         f"processes not bounded ({bound[6:]})")]
        lines += [f"- {note}" for note in limits["notes"]]
    lines += ["", f"score: {result['score']}/{result['total']}"]
    return "\n".join(lines)

