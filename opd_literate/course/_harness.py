"""The grading harness of ``opd_literate.course.grade``, copied into each sandbox.

The grader starts it in a fresh interpreter with a scrubbed environment, in its own process
group, and writes the configuration to its standard input. It imports pytest and the lab's
libraries once, then grades each task in a forked child: the child installs an audit hook,
imports the student's modules, replaces the other tasks' functions by the reference versions,
runs the instructor's tests of that task, and sends one record through a pipe. This process never
imports the student's code; it kills a child that runs past the time limit and forwards each
record, tagged with the run's nonce, through the pipe the grader opened.
"""

import gc
import importlib
import json
import os
import secrets
import selectors
import signal
import sys
import time
import traceback
import types

# Events a student's code may not raise: new processes, signals, foreign code, memory walks.
FORBIDDEN = {
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "socket.connect", "socket.bind",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
}
# Events that change the file system at the paths in their arguments.
PATH_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
    "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move", "shutil.chown",
}
# No cache, no conftest.py, no plugins but these; no collection of every object after the run
# (slow in a forked child, and the grade does not need it); plain tracebacks (pytest's own
# re-parse each source file, most of a failing task's time; the grade keeps one line).
PYTEST_OPTIONS = ["--no-header", "-p", "no:cacheprovider", "--noconftest", "-p",
                  "no:unraisableexception", "-p", "no:threadexception", "--tb=native"]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _inside(path, roots):
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def make_audit_hook(write_roots, secret_roots, blocked_modules):
    """An audit hook (it cannot be removed) that refuses writes outside ``write_roots``, any
    access under ``secret_roots``, the events of FORBIDDEN and imports of ``blocked_modules``."""

    def resolve(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def refuse(what, path=""):
        raise PermissionError(f"grading sandbox: {what} is not allowed"
                              + (f": {path}" if path else ""))

    def hook(event, args):
        if event in FORBIDDEN:
            refuse(event)
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise ImportError(f"grading sandbox: module {args[0]!r} is not available")
        if event == "open":
            path, _, flags = args
            if isinstance(path, int):
                return
            path = resolve(path)
            if path == os.devnull:
                return
            if _inside(path, secret_roots):
                refuse("reading", path)
            if flags is not None and flags & WRITE_FLAGS and not _inside(path, write_roots):
                refuse("writing outside the lab copy", path)
            if not _inside(path, write_roots) and os.path.isdir(path):
                refuse("opening a folder outside the lab copy", path)
        elif event in PATH_EVENTS:
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") else None
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    path = resolve(arg, dir_fd if isinstance(dir_fd, int) else None)
                    if not _inside(path, write_roots):
                        refuse(f"{event} outside the lab copy", path)
                    break  # the first path argument is checked, then the second below
            for arg in args[1:2] if event in ("os.rename", "os.link", "os.symlink",
                                               "shutil.move", "shutil.copyfile") else ():
                if isinstance(arg, (str, bytes, os.PathLike)):
                    path = resolve(arg)
                    if not _inside(path, write_roots):
                        refuse(f"{event} outside the lab copy", path)

    return hook


def _tripwire(modules):
    """The callables of the modules and classes a student could patch to fake a pass."""
    snapshot = {}
    for name in modules:
        owner = sys.modules.get(name.split(":")[0])
        for part in name.split(":")[1:]:
            owner = getattr(owner, part, None)
        if owner is None:
            continue
        for key, value in list(vars(owner).items()):
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                snapshot[f"{name.replace(':', '.')}.{key}"] = value
    return snapshot


TRIPWIRE = [
    "builtins", "pytest", "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.main",
    "_pytest.outcomes", "_pytest.python_api", "pluggy", "numpy.testing",
    "numpy.testing._private.utils", "torch.testing", "torch.testing._comparison", "numpy",
    "torch", "_pytest.reports:TestReport", "_pytest.python:Function",
    "_pytest.runner:CallInfo", "torch:Tensor",
]


def describe_error(error, work):
    """One line naming the cause of an exception raised while importing the student's code:
    the file and line inside the lab copy where it happened."""
    if isinstance(error, SyntaxError):
        where = os.path.relpath(error.filename, work) if error.filename else "?"
        return f"syntax error in {where}, line {error.lineno}: {error.msg}"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename and _inside(os.path.realpath(f.filename), [work])]
    where = (f" ({os.path.relpath(frames[-1].filename, work)}, line {frames[-1].lineno})"
             if frames else "")
    return f"{type(error).__name__}: {error}{where}"


class Collector:
    """A pytest plugin: keeps the tests of one task, records each outcome and first line."""

    def __init__(self, task):
        self.task, self.results, self.errors = task, [], []

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            tasks = {int(n) for marker in item.iter_markers("task") for n in marker.args}
            (keep if self.task in tasks else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid}: {_first_line(report)}")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            message = _first_line(report) if report.outcome == "failed" else ""
            self.results.append(dict(test=report.nodeid, outcome=report.outcome,
                                     message=message))


def _first_line(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    lines = [line.strip() for line in text.split("\n") if line.strip()] or [""]
    if lines[0].endswith(":") and len(lines) > 1:  # numpy: "AssertionError:" then the cause
        lines[0] += " " + lines[1]
    return lines[0][:500]


def run_task(config, task, pytest):
    """In the forked child: grade one task and return its record."""
    work = config["work"]
    os.chdir(work)
    sys.path.append(work)  # last: the student's files never shadow an installed package
    references = config.pop("reference_modules")
    hook = make_audit_hook(config["write_roots"], config["secret_roots"],
                           set(config["blocked_modules"]))
    sys.addaudithook(hook)
    before = _tripwire(TRIPWIRE)
    students = {}
    for module in config["student_modules"]:
        if not os.path.exists(os.path.join(work, f"{module}.py")):
            return dict(task=task, error=f"the lab folder has no {module}.py", at_import=True)
        try:
            students[module] = importlib.import_module(module)
        except BaseException as error:  # anything the student's module raises at import
            return dict(task=task, error=describe_error(error, work), at_import=True)
    for other, functions in config["functions"].items():  # other tasks: the reference
        if int(other) == task:
            continue
        for module, name in functions:
            setattr(students[module], name, getattr(references[module], name))
    collector = Collector(task)
    code = pytest.main(["-q", *PYTEST_OPTIONS, "-c", config["ini"], "--rootdir", work,
                        *config["tests"]], plugins=[collector])
    after = _tripwire(TRIPWIRE)
    tampered = sorted(k for k, v in before.items() if after.get(k) is not v)
    return dict(task=task, tests=collector.results, errors=collector.errors, exit=int(code),
                tampered=tampered)


def _child(config, task, write_end, pytest, token):
    os.close(config["result_fd"])  # the child never writes to the grader's pipe
    started = time.monotonic()
    log = os.open(os.path.join(config["log_dir"], f"task{task}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        record = run_task(config, task, pytest)
    except BaseException as error:  # the harness itself failed in this child
        record = dict(task=task, error=f"grading harness: {type(error).__name__}: {error}",
                      traceback=traceback.format_exc())
    record["seconds"] = round(time.monotonic() - started, 3)
    record["token"] = token
    os.write(write_end, json.dumps(record).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    config = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce = config.pop("nonce")
    results = os.fdopen(config["result_fd"], "w", buffering=1)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p not in ("", here, os.getcwd())]
    sys.dont_write_bytecode = True
    for name in config["preload"]:  # once here, not once per task
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # reported with its real cause when the student's module imports it
    import pytest

    # A first pytest run imports its plugins; on an empty folder, so no student code is run.
    # Then the given modules (the instructor's copies). Each child starts from this state.
    empty = os.path.join(config["log_dir"], "empty")
    os.mkdir(empty)
    pytest.main(["-q", "--co", *PYTEST_OPTIONS, "-c", config["ini"], "--rootdir", empty, empty])
    sys.path.append(config["work"])
    for name in config["given_modules"]:
        importlib.import_module(name)
    references = {}  # the reference modules, run here once (they never reach the lab copy)
    for module, source in config.pop("references").items():
        reference = types.ModuleType(f"_reference_{module}")
        sys.modules[reference.__name__] = reference  # while it runs (dataclasses look it up)
        exec(compile(source, f"<reference {module}>", "exec"), reference.__dict__)
        references[module] = sys.modules.pop(reference.__name__)
    config["reference_modules"] = references
    sys.path.remove(config["work"])
    gc.freeze()  # a child's collections then skip (and do not copy) the parent's objects

    pending = list(config["tasks"])
    running = {}  # read end -> (pid, task, chunks, deadline)
    selector = selectors.DefaultSelector()
    while pending or running:
        while pending and len(running) < config["jobs"]:
            task = pending.pop(0)
            read_end, write_end = os.pipe()
            token = secrets.token_hex(16)  # a record without it was not written by run_task
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                for fd in running:
                    os.close(fd)
                _child(config, task, write_end, pytest, token)
            os.close(write_end)
            running[read_end] = (pid, task, [], time.monotonic() + config["timeout"], token)
            selector.register(read_end, selectors.EVENT_READ)
        now = time.monotonic()
        wait = max(0.0, min(entry[3] for entry in running.values()) - now)
        for key, _ in selector.select(timeout=wait):
            pid, task, chunks, _, token = running[key.fd]
            data = os.read(key.fd, 1 << 16)
            if data:
                chunks.append(data)
                continue
            selector.unregister(key.fd)
            os.close(key.fd)
            del running[key.fd]
            _, status = os.waitpid(pid, 0)
            try:
                record = json.loads(b"".join(chunks))
                assert isinstance(record, dict) and record.pop("token") == token
            except (ValueError, AssertionError, KeyError):
                record = dict(task=task, error="the test process ended without a valid result "
                                               f"(wait status {status})")
            record["task"] = task
            results.write(json.dumps(dict(record, nonce=nonce)) + "\n")
            while record.get("at_import") and pending:  # the same import fails for every task
                results.write(json.dumps(dict(record, task=pending.pop(0), nonce=nonce)) + "\n")
        now = time.monotonic()
        for fd, (pid, task, _, deadline, _) in list(running.items()):
            if now >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                selector.unregister(fd)
                os.close(fd)
                del running[fd]
                results.write(json.dumps(dict(task=task, timed_out=config["timeout"],
                                              nonce=nonce)) + "\n")
    results.close()


if __name__ == "__main__":
    main()
