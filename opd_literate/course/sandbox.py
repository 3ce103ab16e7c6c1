r"""An operating-system sandbox for untrusted code: bubblewrap, resource limits, capped output.

[run][opd_literate.course.sandbox.run] executes a command (typically ``sys.executable`` and a
runner script) inside ``bwrap`` (bubblewrap), with the caller's ``workdir`` mounted read-write
at ``/sandbox`` as the only writable place that outlives the run, and returns what it printed
and how it ended as a [Result][opd_literate.course.sandbox.Result]. The command sees

* read-only: ``/usr`` (and ``/bin``, ``/lib*`` as on the host), the Python installation
  (``sys.base_prefix``, ``sys.prefix`` and the exec prefixes: a virtual environment and the
  Python it was made from) and the folders holding numpy and torch
  ([python_roots][opd_literate.course.sandbox.python_roots]), wherever they are (under
  ``/tmp`` too: they are mounted over the fresh ``/tmp``), with this
  library masked wherever it could be found there (the package folder, its ``.dist-info``, the
  editable-install finder and ``.pth`` files that name it, in this interpreter's site folders
  and in every site folder at the usual places under ``/usr`` and each of those folders: a
  copy in the base Python's site-packages too); a minimal ``/etc`` (the dynamic
  linker's cache and configuration, ``/etc/alternatives``, the time zone, and a synthetic
  ``passwd``, ``group`` and ``hosts``); and the symbolic links on the interpreter's path as
  written (``sys.executable``) that none of these holds, made as they are;
* fresh: ``/proc`` of its own PID namespace, mounted read-only (as root the kernel's settings
  under ``/proc/sys`` would otherwise be writable), a minimal ``/dev``, and on ``/tmp`` and
  ``/dev/shm`` a ``tmpfs`` each of ``file_bytes`` (everything else is read-only, bwrap's own
  root included);
* nothing else: not the repository, not the instructor's files, not ``$HOME``, no network
  (its own network namespace has only a loopback), its own IPC and UTS namespaces, no
  capabilities, and (bubblewrap 0.8 or later) no further user namespaces. A Python
  installation whose folder would show what must stay hidden (a home folder, ``/home``,
  ``/root``, ``/run``, the temporary folder, the repository, the working folder or a folder
  the caller names in ``hidden``) is refused, checked again for each run.

Resource limits are set by ``setrlimit`` in the sandboxed process before it executes the
command: address space, file size, CPU seconds, no core files, and the number of processes
(see [process_limit][opd_literate.course.sandbox.process_limit] for what bounds it where).
A wall-clock limit kills the sandbox's PID namespace, and with it every process started in it;
the sandbox also ends, whatever is still running in it, when the command exits. Standard
output and standard error are each kept up to ``output_bytes``; the rest is read and
discarded, so the caller's memory stays bounded. The launcher that reports the command's wait
status is not dumpable, so the command cannot open its pipe through ``/proc``; a status that
is no wait status all the same is no crash but the result's ``fault``.

Where ``bwrap`` is missing or cannot create its namespaces,
[unavailable_reason][opd_literate.course.sandbox.unavailable_reason] says why, and ``run``
raises [SandboxUnavailable][opd_literate.course.sandbox.SandboxUnavailable] unless it is told
``trusted=True``: then the command runs as a plain process in a session of its own, with the
same resource limits and a scrubbed environment, and the result says it was not sandboxed.
Where ``bwrap`` runs but this sandbox could not be set up (a folder that could not be
mounted), the reason quotes bwrap's error and the refusal offers no trusted mode: that is a
fault to report, which running unsandboxed would hide. Nor is it offered where bwrap could
not be started for a moment (too many open files or processes): that reason says to try
again, and is not remembered.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import glob
import json
import math
import os
import pathlib
import platform
import re
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import uuid

__all__ = ["SANDBOX_DIR", "SandboxUnavailable", "Limits", "Result", "unavailable_reason",
           "refusal_message", "python_roots", "process_limit", "run_user_problem", "run"]

SANDBOX_DIR = "/sandbox"
"""Where ``workdir`` is mounted inside the sandbox, and the command's working directory."""

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]  # the opd_literate folder
_LIBRARY_NAMES = ("opd_literate", "opd-literate")
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_BINDS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
              "/etc/localtime")
_CGROUP_PREFIX = "opd-sandbox"
# After the command ends, how long its output pipes may stay open before the rest is dropped
# (only a process that left the sandbox's control can hold them: see the trusted mode).
_DRAIN_SECONDS = 1.0

# Runs before the command, with the standard library only (``python -I -S``): joins the run's
# cgroups, sets the resource limits, becomes the run's own user where it is given one (the
# trusted mode as root), then runs the command. With a status descriptor it stays
# as the command's parent and writes the command's wait status there, so that a command killed
# by a signal is told from one that exited with status 128 + N.
_LAUNCHER = r"""
import json, os, resource, sys
config = json.loads(sys.argv[1])
command = sys.argv[2:]
for path in config["cgroup_procs"]:
    with open(path, "w") as procs:
        procs.write(str(os.getpid()))
for name, (soft, hard) in config["rlimits"].items():
    which = getattr(resource, name)
    allowed = resource.getrlimit(which)[1]
    if allowed != resource.RLIM_INFINITY:
        soft, hard = min(soft, allowed), min(hard, allowed)
    resource.setrlimit(which, (soft, hard))
if config.get("user") is not None:
    # Groups first, the user last: once the user is no longer root, neither can change.
    uid, gid = config["user"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgroups():
        os._exit(126)
def execute():
    try:
        os.execv(command[0], command)
    except OSError as error:
        print(f"sandbox: cannot run {command[0]!r}: {error}", file=sys.stderr)
        os._exit(127)
status_fd = config["status_fd"]
if status_fd is not None:
    # Not dumpable before the fork, so that the command (the same user) can neither open this
    # process's descriptors through /proc/PID/fd nor ptrace it to write a status of its own;
    # the command's exec makes it dumpable again. Where that fails, no status is written (the
    # return code is then bwrap's, a signal N reading as 128 + N).
    PR_SET_DUMPABLE = 4
    try:
        import ctypes
        protected = ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        protected = False
    if not protected:
        os.close(status_fd)
        status_fd = None
if status_fd is None:
    execute()
pid = os.fork()
if pid == 0:
    os.close(status_fd)
    execute()
_, status = os.waitpid(pid, 0)
os.write(status_fd, str(status).encode())
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


# The trusted mode as root runs the command as a user of the run's own: an id from this range
# that no account names and no process holds (``_run_user``).
_RUN_USERS = range(0x70000000, 0x70000000 + 0x10000)


class SandboxUnavailable(RuntimeError):
    """The operating-system sandbox cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Limits:
    r"""Resource limits of one run, sized for a lab's tests.

    Every limit holds for each process of the sandbox (``setrlimit`` is per process), except
    ``processes`` (all of them together, see
    [process_limit][opd_literate.course.sandbox.process_limit]), ``memory_total_bytes`` (all
    of them together, where asked for), ``wall_seconds`` (the whole run) and ``output_bytes``
    (each of standard output and standard error).
    """

    wall_seconds: float = 60.0
    """Wall-clock seconds before the whole sandbox is killed (the result is ``timed_out``)."""
    cpu_seconds: int = 60
    """CPU seconds per process (``RLIMIT_CPU``): past it the kernel sends ``SIGXCPU``."""
    memory_bytes: int = 4 * 2**30
    """Address space per process (``RLIMIT_AS``): an allocation past it fails (``MemoryError``)."""
    file_bytes: int = 64 * 2**20
    """Largest file a process may write (``RLIMIT_FSIZE``); also the size of ``/tmp`` and of
    ``/dev/shm``."""
    processes: int = 64
    """Processes and threads at once, all of the sandbox's together: on a machine with many
    cores, pass ``OMP_NUM_THREADS`` (and ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``) in
    ``env``, or numpy's and torch's thread pools may not start."""
    output_bytes: int = 1 * 2**20
    """Bytes kept of standard output, and of standard error; the rest is discarded."""
    memory_total_bytes: int | None = None
    """Memory of all the run's processes together, or None (not bounded): their pages and what
    they write to its ``/tmp`` and ``/dev/shm``, swap included, by a memory cgroup of the run's
    own (``memory.max`` and ``memory.swap.max`` in cgroup v2, ``memory.limit_in_bytes`` and
    ``memory.memsw.limit_in_bytes`` in v1); past it the kernel kills one of them (``SIGKILL``).
    Where it is set and this process cannot make such a cgroup,
    [run][opd_literate.course.sandbox.run] raises ``SandboxUnavailable``."""

    def __post_init__(self):
        wall = self.wall_seconds
        if isinstance(wall, bool) or not isinstance(wall, (int, float)):
            raise TypeError(f"Limits.wall_seconds must be a number, got {type(wall).__name__}")
        if not (math.isfinite(wall) and wall > 0):
            raise ValueError(f"Limits.wall_seconds must be finite and positive, got {wall!r}")
        for field in ("cpu_seconds", "memory_bytes", "file_bytes", "processes", "output_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Limits.{field} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"Limits.{field} must be positive, got {value}")
        total = self.memory_total_bytes
        if total is not None:
            if isinstance(total, bool) or not isinstance(total, int):
                raise TypeError("Limits.memory_total_bytes must be an int or None, got "
                                f"{type(total).__name__}")
            if total < 2**20:
                raise ValueError("Limits.memory_total_bytes must be at least 1 MiB (2**20), "
                                 f"got {total}")


@dataclasses.dataclass(frozen=True)
class Result:
    """How a sandboxed command ended, and what it printed.

    ``returncode`` follows ``subprocess``: negative ``-N`` when the command was killed by
    signal ``N`` (``-9`` when the wall clock ran out, ``-24`` ``SIGXCPU`` past the CPU limit).
    """

    returncode: int
    """The command's exit status, or minus the signal that killed it."""
    stdout: bytes
    """Standard output, at most ``Limits.output_bytes`` of it."""
    stderr: bytes
    """Standard error, at most ``Limits.output_bytes`` of it."""
    timed_out: bool
    """Whether the wall-clock limit ran out and the sandbox was killed."""
    truncated: bool
    """Whether standard output or standard error was longer than ``Limits.output_bytes``."""
    sandboxed: bool = True
    """False when the command ran with ``trusted=True``: a plain process, no OS isolation."""
    notes: tuple[str, ...] = ()
    """Guarantees that did not hold for this run, in words (empty when all of them held)."""
    fault: str | None = None
    """What went wrong in the sandbox's own machinery, in words, or None: a wait status that
    its launcher cannot have written (something else reached the launcher's pipe). The
    ``returncode`` is then bwrap's, and nothing the run wrote is to be trusted."""


def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The long options this ``bwrap`` knows (``--disable-userns`` is new in 0.8.0)."""
    completed = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10,
                               check=False)
    return frozenset(word for word in (completed.stdout + completed.stderr).split()
                     if word.startswith("--"))


def unavailable_reason() -> str | None:
    """Why the sandbox cannot run here, or None when ``bwrap`` works.

    Checked by starting a sandbox like ``run``'s (the answer is remembered per ``bwrap``
    executable, so the check costs one start, tens of milliseconds, per process). Where that
    fails, smaller sandboxes tell the cause apart: a machine that cannot create the namespaces
    (no user namespaces: the kernel settings that forbid them are named where they do), one
    that refuses only ``--disable-userns`` (a container such as Incus or LXD), or a sandbox
    whose folders could not be mounted here, a fault to report rather than a machine to work
    around (see [refusal_message][opd_literate.course.sandbox.refusal_message]). bwrap's own
    error is quoted either way. A bwrap that could not be started at all (too many open files
    or processes) or a probe that took more than 30 s is a passing failure: the reason says
    to try again, offers no trusted mode, and is not remembered.

    Returns
    -------
    str or None
        None when ``run`` can sandbox; otherwise the reason, in words, with what to do.
    """
    bwrap = _bwrap_path()
    if bwrap is None:
        return ("bubblewrap (bwrap) is not installed or not on PATH; install it "
                "(Debian and Ubuntu: apt-get install bubblewrap)")
    bwrap = os.path.realpath(bwrap)
    if bwrap in _PROBED:
        return _PROBED[bwrap]
    reason = _probe(bwrap)
    if not isinstance(reason, _Transient):
        _PROBED[bwrap] = reason
    return reason


_PROBED: dict[str, str | None] = {}  # unavailable_reason's answers, by bwrap executable


class _SetupFailure(str):
    """A reason that is no missing feature of the machine: bwrap runs, this sandbox did not."""


class _Transient(_SetupFailure):
    """A reason that may not hold a moment later (bwrap could not be started): not remembered,
    and no reason to run unsandboxed."""


class _Refused(Exception):
    """This run's sandbox cannot be set up without breaking a guarantee; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = _SetupFailure(reason)


def refusal_message(reason: str, refusal: str, fallback: str) -> str:
    """The message of a refusal to run without the sandbox, on one line.

    Parameters
    ----------
    reason : str
        What [unavailable_reason][opd_literate.course.sandbox.unavailable_reason] said.
    refusal : str
        What is refused, in words (``"cannot sandbox untrusted code"``).
    fallback : str
        How to run unsandboxed (the trusted mode), offered only where the machine cannot run
        bubblewrap: never where the sandbox's own set-up failed, which running unsandboxed
        would only hide, nor where bwrap could not be started for a moment.

    Returns
    -------
    str
        ``"<refusal>: <reason>; <fallback>"``, or without the fallback.
    """
    message = f"{refusal}: {reason}"
    return message if isinstance(reason, _SetupFailure) else f"{message}; {fallback}"


def _one_line(stderr: bytes, returncode: int) -> str:
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    text = "; ".join(line for line in lines if line) or f"exit status {returncode}"
    return text if len(text) <= 500 else text[:497] + "..."


def _passing(what: str, error: BaseException) -> _Transient:
    return _Transient(
        f"{what} ({error}): a passing failure of the machine (too many open files or "
        "processes, too little memory, or a probe that took more than 30 s), not a missing "
        "feature; try again")


def _start(command: list[str], fds: tuple[int, ...] | list[int] = ()) -> str | None:
    """Run a probe sandbox: None when it succeeds, else bwrap's error on one line (a
    ``_Transient`` one where bwrap could not be started or did not finish)."""
    try:
        completed = subprocess.run(command, capture_output=True, timeout=30, check=False,
                                   pass_fds=fds, env=_base_env({}, []), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return _passing("bwrap could not be started", error)
    return None if completed.returncode == 0 else _one_line(completed.stderr,
                                                            completed.returncode)


def _probe(bwrap: str) -> str | None:
    roots = python_roots()
    problem = _root_problem(roots)
    if problem is not None:
        return _SetupFailure(problem)
    try:
        _bwrap_options(bwrap)
    except (OSError, subprocess.TimeoutExpired) as error:
        return _passing("bwrap could not be started", error)
    python = [sys.executable, "-I", "-S", "-c", "pass"]
    with tempfile.TemporaryDirectory(prefix="opd-sandbox-probe-") as workdir:
        try:
            command, fds, _ = _bwrap_command(bwrap, python, pathlib.Path(workdir), Limits(),
                                             status_fd=None)
        except _Refused as refused:
            return refused.reason
        except OSError as error:
            return _passing("bwrap could not be prepared", error)
        try:
            error = _start(command, fds)
        finally:
            for fd in fds:
                os.close(fd)
    if error is None or isinstance(error, _Transient):
        return error
    # The same namespaces over the machine's own files: if they work, the mounts failed.
    over_the_machine = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--",
                        *python]
    namespaces = _namespace_command(bwrap)
    machine_error = _start([*namespaces, *over_the_machine])
    if machine_error is None:
        return _SetupFailure(
            f"bwrap runs here, but could not mount this sandbox's folders ({error}; the "
            f"Python installation's folders: {', '.join(repr(str(r)) for r in roots)}): a fault of "
            "the sandbox's set-up for this Python, not a machine without namespaces; "
            "please report it with this message")
    if isinstance(machine_error, _Transient):
        return machine_error
    if "--disable-userns" in namespaces:
        # Once more without it: a container (Incus, LXD) may refuse only this option.
        allowed = _start([option for option in namespaces if option != "--disable-userns"]
                         + over_the_machine)
        if isinstance(allowed, _Transient):
            return allowed
        if allowed is None:
            return (f"bwrap creates the sandbox's namespaces here, but fails with "
                    f"--disable-userns ({error}), its option that keeps the sandbox from "
                    "creating user namespaces of its own: the machine does not let bwrap set "
                    "user.max_user_namespaces for it, as some containers do not (Incus or "
                    "LXD, say)")
    user_error = _start([bwrap, "--unshare-user", "--ro-bind", "/", "/", "--", *python])
    if isinstance(user_error, _Transient):
        return user_error
    if user_error is None:
        return (f"bwrap cannot create the sandbox's namespaces here ({error}), though it can "
                "create a user namespace: a container or security policy forbids a PID, "
                "network, IPC or UTS namespace, or mounting /proc")
    switches = _user_namespace_switches()
    if switches:
        return (f"bwrap cannot create a user namespace here ({user_error}): user namespaces "
                f"are disabled ({', '.join(switches)})")
    return (f"bwrap cannot create a user namespace here ({user_error}), though no kernel "
            "setting disables them (user.max_user_namespaces, "
            "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns): "
            "a container or security policy (seccomp, AppArmor, SELinux) forbids them")


def _user_namespace_switches(proc_sys: pathlib.Path = pathlib.Path("/proc/sys")) -> list[str]:
    """The kernel settings (read under ``proc_sys``) that disable user namespaces for this
    user, in words."""
    disabling = [("user/max_user_namespaces", "0", True),
                 ("kernel/unprivileged_userns_clone", "0", False),
                 ("kernel/apparmor_restrict_unprivileged_userns", "1", False)]
    found = []
    for name, value, for_root_too in disabling:
        if not for_root_too and os.getuid() == 0:
            continue  # these restrict unprivileged users only
        try:
            read = (proc_sys / name).read_text().strip()
        except OSError:
            continue
        if read == value:
            found.append(f"sysctl {name.replace('/', '.')} = {read}")
    return found


def _unavailable_message(reason: str) -> str:
    return refusal_message(reason, "cannot sandbox untrusted code",
                           "run where bubblewrap works, or pass trusted=True (--trusted) to run "
                           "the code as a plain process, only for code you trust")


# ---------------------------------------------------------------------------------------------
# What is visible inside: the read-only roots and the library masked in them.


def _is_under(path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether ``path`` is ``root`` or inside it, by path components (never string prefixes:
    ``/work/main-venv`` is not inside ``/work/main``)."""
    return path == root or root in path.parents


def python_roots() -> list[pathlib.Path]:
    """The folders of the Python installation that ``run`` shows, read-only, to the command.

    They are the outermost of the interpreter's prefixes (``sys.prefix``, ``sys.base_prefix``,
    ``sys.exec_prefix``, ``sys.base_exec_prefix``: a virtual environment and the Python it was
    made from) and of the site folders that hold numpy and torch, resolved; a folder inside
    another is shown with it, and ``/`` never is (it would show the whole machine). Where a
    folder lies (``/tmp``, a path with spaces, beside the repository) does not matter; where
    one would cover a place the sandbox makes its own (``/tmp``, ``/dev``, ``/proc``, ``/etc``,
    ``/sandbox``), or hold one it keeps hidden (a home folder, ``/home``, ``/root``, ``/run``,
    the temporary folder, the repository),
    [unavailable_reason][opd_literate.course.sandbox.unavailable_reason] says so, and ``run``
    refuses (it checks again for each run, with its working folder and ``hidden`` folders).

    Returns
    -------
    list of pathlib.Path
        The folders, sorted; those under ``/usr`` are shown with ``/usr``.
    """
    roots = {pathlib.Path(prefix).resolve() for prefix in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    for name in ("numpy", "torch"):
        folder = _site_dir_of(name)
        if folder is not None:
            roots.add(folder)
    roots.discard(pathlib.Path("/"))
    kept = [root for root in roots if not any(other != root and _is_under(root, other)
                                              for other in roots)]
    return sorted(kept)


def _site_dir_of(name: str) -> pathlib.Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isabs(spec.origin):
        return None
    # origin is <site>/numpy/__init__.py: the site folder holds the package.
    return pathlib.Path(spec.origin).resolve().parents[1]


# The sandbox's own places: a root that is one of them or holds one would cover what the
# sandbox mounts there (its fresh /tmp, minimal /dev and /etc, own /proc, the workdir).
_OWN_PLACES = ("/tmp", "/dev", "/dev/shm", "/proc", "/etc", SANDBOX_DIR)


def _private_places(hidden=()) -> list[tuple[str, pathlib.Path]]:
    """What no shown folder may hold, in words, with its path: the users' homes, ``/run``
    (its sockets can be connected to through a read-only mount), the temporary folder (other
    runs' folders), this library's repository, and ``hidden`` (``(words, path)`` pairs)."""
    places = [("the home folder", os.path.expanduser("~")),
              ("the users' home folders", "/home"), ("root's home folder", "/root"),
              ("the machine's run-time files and sockets", "/run"),
              ("the temporary folder, with other runs' folders", tempfile.gettempdir())]
    repository = _repository()
    if repository is not None:
        places.append(("this library's repository", repository))
    places += list(hidden)
    return [(what, pathlib.Path(place).resolve()) for what, place in places
            if os.path.isabs(place)]


def _root_problem(roots: list[pathlib.Path], hidden=()) -> str | None:
    """Why a read-only root cannot be shown without breaking a guarantee, or None.

    ``hidden``: more ``(words, path)`` pairs that nothing shown may hold (see
    ``_private_places``); ``/usr`` and the system folders are checked against them too."""
    for root in roots:
        covered = [place for place in _OWN_PLACES if _is_under(pathlib.Path(place), root)]
        if covered:
            return (f"the Python installation's folder {str(root)!r} would cover the "
                    f"sandbox's own {covered[0]} (and show what the machine holds there); "
                    "use a Python or virtual environment installed in a folder of its own")
        inside = [place for place in ("/proc", "/dev", SANDBOX_DIR)
                  if _is_under(root, pathlib.Path(place))
                  and not _is_under(root, pathlib.Path("/dev/shm"))]
        if inside:
            return (f"the Python installation's folder {str(root)!r} lies in {inside[0]}, "
                    "which the sandbox replaces with its own; use a Python or virtual "
                    "environment installed elsewhere")
        if _is_extra_site(root) and os.pathsep in str(root):
            return (f"the site folder {str(root)!r} (numpy's or torch's) holds "
                    f"{os.pathsep!r}, so it cannot be named on the sandbox's PYTHONPATH; "
                    "install numpy and torch in a folder whose path has none")
    places = _private_places(hidden)
    for tree in _shown_trees(roots):
        held = [(what, place) for what, place in places if _is_under(place, tree)]
        if held:
            what, place = held[0]
            folder = ("the Python installation's folder" if tree in roots
                      else "the system folder")
            return (f"{folder} {str(tree)!r} holds {what} ({str(place)!r}), which the sandbox "
                    "would show; use a Python or virtual environment installed in a folder "
                    "of its own, apart from homes, /run, the temporary folder and the folders "
                    "being graded")
    return None


def _links_on_the_way(path: str) -> list[tuple[pathlib.Path, str]]:
    """The symbolic links that resolving ``path`` goes through, in order, as (where the link
    is, what it holds); OSError (ELOOP) past 40 of them, as the kernel."""
    links, hops = [], 0
    pending, current = list(pathlib.PurePosixPath(path).parts[1:]), pathlib.Path("/")
    while pending:
        part = pending.pop(0)
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        if not candidate.is_symlink():
            current = candidate
            continue
        hops += 1
        if hops > 40:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        target = os.readlink(candidate)
        links.append((candidate, target))
        if target.startswith("/"):
            current = pathlib.Path("/")
        pending[:0] = [p for p in pathlib.PurePosixPath(target).parts if p != "/"]
    return links


def _links_to_make(roots: list[pathlib.Path], programs) -> list[tuple[pathlib.Path, str]]:
    """The symbolic links on the way to each of ``programs`` (``(words, path)`` pairs) that
    the sandbox would not show, to be made there as they are here: (where, what it holds).

    A link inside a shown folder is there already; one in ``/proc``, ``/dev`` or
    ``/sandbox``, which the sandbox replaces, cannot be, and is refused (``_Refused``)."""
    shown = [*_shown_trees(roots), *(pathlib.Path(name) for name in _ETC_BINDS
                                     if os.path.exists(name) and not os.path.islink(name))]
    remade = {pathlib.Path(name) for name in (*_SYSTEM_DIRS, *_ETC_BINDS) if os.path.islink(name)}
    wanted = {}
    for what, program in programs:
        try:
            links = _links_on_the_way(program)
        except OSError as error:
            raise _Refused(f"{what} goes through a loop of symbolic links ({program!r}: "
                           f"{error.strerror})") from None
        for location, target in links:
            if location in remade or any(_is_under(location, tree) for tree in shown):
                continue
            replaced = [place for place in ("/proc", "/dev", SANDBOX_DIR)
                        if _is_under(location, pathlib.Path(place))
                        and not _is_under(location, pathlib.Path("/dev/shm"))]
            if replaced:
                raise _Refused(
                    f"{what} goes through a symbolic link ({str(location)!r} -> {target!r}) in "
                    f"{replaced[0]}, which the sandbox replaces with its own; run it by its "
                    f"real path, {os.path.realpath(program)!r}")
            wanted[location] = target
    return sorted(wanted.items())


def _mentions(text: str, place: pathlib.Path) -> bool:
    """Whether ``text`` names ``place`` or a path inside it (not ``place-venv`` beside it)."""
    return re.search(re.escape(str(place)) + r"(?![\w.-])", text) is not None


def _pth_names_the_library(pth: pathlib.Path, places: set[pathlib.Path]) -> bool:
    """Whether a ``.pth`` file could make this library importable: a path line (resolved
    against the ``.pth``'s folder, as ``site`` does) that is one of ``places`` or a folder
    holding ``opd_literate``, or an ``import`` line (run at start-up) that mentions the
    library's name or one of ``places``."""
    try:
        text = pth.read_text(errors="replace")
    except OSError:
        return False  # what cannot be read here cannot be read inside either (same user)
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(("import ", "import\t")):
            if any(name in line.lower() for name in _LIBRARY_NAMES) or any(
                    _mentions(line, place) for place in places):
                return True
            continue
        try:
            folder = (pth.parent / line.rstrip()).resolve()
        except (OSError, RuntimeError, ValueError):
            continue
        if folder in places or (folder / "opd_literate").exists():
            return True
    return False


# Where an installation keeps its site folders, below its prefix: lib/pythonX.Y (lib64 on
# Fedora, Debian's lib/python3/dist-packages), /usr/local's own, and the environments that a
# conda or pyenv-virtualenv installation holds under envs/.
_SITE_PATTERNS = tuple(f"{env}{local}lib*/python*/{kind}" for env in ("", "envs/*/")
                       for local in ("", "local/") for kind in ("site-packages", "dist-packages"))


def _repository() -> pathlib.Path | None:
    """The checkout this library is imported from, or None where it is installed."""
    repository = _PACKAGE_DIR.parent
    if (repository / "pyproject.toml").is_file() or (repository / ".git").exists():
        return repository
    return None


def _shown_trees(roots: list[pathlib.Path]) -> list[pathlib.Path]:
    """Every folder of the machine the sandbox shows read-only: ``/usr``, the system folders
    that are no links (``/lib`` on a system without the merged ``/usr``), and ``roots``."""
    system = [pathlib.Path(name) for name in _SYSTEM_DIRS
              if os.path.isdir(name) and not os.path.islink(name)]
    return [pathlib.Path("/usr"), *system, *roots]


def _library_masks(roots: list[pathlib.Path]) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Folders and files of this library that the sandbox would show: (folders, files).

    Looked for in this interpreter's site folders and in every site folder at the usual places
    of everything shown (``_SITE_PATTERNS`` under ``/usr`` and each root): a copy in the base
    Python's site-packages or in ``/usr/lib/python3/dist-packages`` is as readable as ours."""
    repository = _repository()
    candidates = {_PACKAGE_DIR} | ({repository} if repository else set())
    trees = _shown_trees(roots)
    site_dirs = {pathlib.Path(entry) for entry in sys.path if entry}
    site_dirs.update(pathlib.Path(entry) for entry in site.getsitepackages())
    site_dirs.add(pathlib.Path(site.getusersitepackages()))
    site_dirs.update(folder for folder in map(_site_dir_of, ("numpy", "torch")) if folder)
    site_dirs.update(roots)  # a root may itself be a site folder (numpy's, say)
    for tree in trees:
        for pattern in _SITE_PATTERNS:
            site_dirs.update(map(pathlib.Path, glob.glob(f"{glob.escape(str(tree))}/{pattern}")))
    places = {_PACKAGE_DIR, _PACKAGE_DIR.parent}
    for folder in site_dirs:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            lowered = entry.name.lower().replace("-", "_")
            if lowered.startswith("opd_literate") or (
                    lowered.startswith("__editable__") and "opd_literate" in lowered):
                candidates.add(entry)
            elif entry.suffix == ".pth" and entry.is_file() and _pth_names_the_library(
                    entry, places):
                candidates.add(entry)
    visible = {path.resolve() for path in candidates
               if any(_is_under(path.resolve(), tree) for tree in trees)}
    folders = sorted(path for path in visible if path.is_dir())
    files = sorted(path for path in visible if not path.is_dir())
    return folders, files


def _etc_files(uid: int, gid: int) -> dict[str, bytes]:
    users = "root:x:0:0:root:/tmp:/usr/sbin/nologin\n"
    groups = "root:x:0:\n"
    if uid != 0:
        users += f"sandbox:x:{uid}:{gid}:sandbox:/tmp:/usr/sbin/nologin\n"
    if gid != 0:
        groups += f"sandbox:x:{gid}:\n"
    return {"/etc/passwd": users.encode(), "/etc/group": groups.encode(),
            "/etc/hosts": b"127.0.0.1 localhost\n::1 localhost\n"}


def _data_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bwrap's ``--ro-bind-data`` reads a file from it)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)  # a few hundred bytes: within any pipe's buffer
    finally:
        os.close(write_end)
    return read_end


def _namespace_command(bwrap: str) -> list[str]:
    """``bwrap`` and the options that make the sandbox's namespaces, session and capabilities."""
    command = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
               "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--hostname", "sandbox"]
    if "--disable-userns" in _bwrap_options(bwrap):
        command.append("--disable-userns")
    return command


def _bwrap_command(bwrap: str, argv: list[str], workdir: pathlib.Path, limits: Limits,
                   status_fd: int | None, info_fd: int | None = None,
                   hidden: tuple[pathlib.Path, ...] = (),
                   ) -> tuple[list[str], list[int], list[pathlib.Path]]:
    """The ``bwrap`` command line, the descriptors it reads, and the read-only roots; raises
    ``_Refused`` where this run's roots would break a guarantee."""
    options = _bwrap_options(bwrap)

    def sized(size: int) -> list[str]:
        return ["--size", str(size)] if "--size" in options else []

    roots = python_roots()
    # Checked for each run, not only by unavailable_reason's remembered probe: the roots may
    # have changed since, and the working folder and the hidden folders are this run's.
    problem = _root_problem(roots, [("the working folder, with the folders beside it", workdir),
                                    *(("a folder the caller hides", path) for path in hidden)])
    if problem is not None:
        raise _Refused(problem)
    links = _links_to_make(roots, [("the interpreter's path", sys.executable),
                                   ("the program's path", argv[0])])
    mask_folders, mask_files = _library_masks(roots)
    command = _namespace_command(bwrap)
    if info_fd is not None:
        command += ["--info-fd", str(info_fd)]
    command += ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        if os.path.islink(name):
            command += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            command += ["--ro-bind", name, name]
    for name in _ETC_BINDS:
        if os.path.lexists(name):
            if os.path.islink(name):
                command += ["--symlink", os.readlink(name), name]
            else:
                command += ["--ro-bind", name, name]
    fds = []
    for name, data in _etc_files(os.getuid(), os.getgid()).items():
        fds.append(_data_fd(data))
        command += ["--ro-bind-data", str(fds[-1]), name]
    # /proc read-only as a whole: bwrap covers /proc/sys only where it finds the folder
    # writable, and as root its files are writable though the folder is not (the kernel's
    # settings, kernel.core_pattern among them: a way to run code as root outside). Other
    # machines have other writable files there (/proc/pressure here, /proc/scsi elsewhere).
    command += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev",
                *sized(limits.file_bytes), "--tmpfs", "/dev/shm",
                *sized(limits.file_bytes), "--tmpfs", "/tmp"]
    # Then the roots, and the masks inside them in path order so that a mask covers what it
    # hides: after the fresh /tmp and /dev/shm, which would otherwise hide a root made there
    # (a virtual environment under /tmp). bwrap makes their mount points in those tmpfs.
    # The links on the interpreter's way that nothing shown holds are made as they are here.
    mounts = [(root, "root") for root in roots if not _is_under(root, pathlib.Path("/usr"))]
    mounts += [(folder, "folder") for folder in mask_folders]
    mounts += [(file, "file") for file in mask_files]
    mounts += [(location, "link") for location, _ in links]
    targets = dict(links)
    for path, kind in sorted(mounts, key=lambda mount: mount[0].parts):
        if kind == "root":
            command += ["--ro-bind", str(path), str(path)]
        elif kind == "folder":
            command += [*sized(4096), "--tmpfs", str(path)]
        elif kind == "file":
            command += ["--ro-bind", "/dev/null", str(path)]
        else:
            command += ["--symlink", targets[path], str(path)]
    command += ["--bind", str(workdir), SANDBOX_DIR, "--chdir", SANDBOX_DIR]
    # bwrap's root and /dev are tmpfs of the size of the machine's memory, writable: read-only
    # once the mount points exist, so that only /tmp, /dev/shm and /sandbox can be written.
    for folder in (*mask_folders, pathlib.Path("/dev"), pathlib.Path("/")):
        command += ["--remount-ro", str(folder)]
    launcher = {"cgroup_procs": [], "rlimits": _rlimits(limits, inside_user_namespace=True),
                "status_fd": status_fd, "user": None}
    command += ["--", sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(launcher), *argv]
    return command, fds, roots


# ---------------------------------------------------------------------------------------------
# Resource limits, and what bounds the number of processes.


def _kernel_counts_processes_per_user_namespace() -> bool:
    """Linux 5.14 and later count ``RLIMIT_NPROC`` per user namespace (ucounts)."""
    release = platform.release().split("-")[0].split(".")
    try:
        major, minor = int(release[0]), int(release[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= (5, 14)


def _proc_status(pid) -> dict[str, str] | None:
    """The fields of ``/proc/PID/status`` (``{"Uid": "0 0 0 0", "State": "S (sleeping)", ...}``),
    or None for a process that has ended or cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return None


def _proc_statuses():
    """``(pid, fields)`` for every process on the machine whose status can be read."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _proc_status(entry.name)
            if fields is not None:
                yield int(entry.name), fields


def _uids(fields: dict[str, str]) -> list[int]:
    """A status's user ids: real, effective, saved and file system ([] where unreadable)."""
    try:
        return [int(field) for field in fields["Uid"].split()]
    except (KeyError, ValueError):
        return []


def _tasks_of_user(uid: int) -> int:
    """Processes and threads the real user ``uid`` runs now, machine-wide (from ``/proc``)."""
    count = 0
    for _, fields in _proc_statuses():
        if _uids(fields)[:1] == [uid]:
            try:
                count += int(fields["Threads"])
            except (KeyError, ValueError):
                continue
    return count


def _rlimits(limits: Limits, inside_user_namespace: bool,
             uid: int | None = None) -> dict[str, tuple[int, int]]:
    """The ``setrlimit`` (soft, hard) values, by ``resource`` name, for a command that runs as
    ``uid`` (default: this process's user)."""
    uid = os.getuid() if uid is None else uid
    rlimits = {"RLIMIT_AS": (limits.memory_bytes,) * 2, "RLIMIT_FSIZE": (limits.file_bytes,) * 2,
               # SIGXCPU at the soft limit; SIGKILL a second later, if it was caught or ignored.
               "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
               "RLIMIT_CORE": (0, 0)}
    if uid != 0:
        # RLIMIT_NPROC counts the processes of the real user: in the sandbox's own user
        # namespace only its own (Linux 5.14+), elsewhere every process of the user, which
        # the limit must then leave room for.
        processes = limits.processes
        if not (inside_user_namespace and _kernel_counts_processes_per_user_namespace()):
            processes += _tasks_of_user(uid)
        rlimits["RLIMIT_NPROC"] = (processes, processes)
    return rlimits


def _cgroup_parents(controller: str) -> list[pathlib.Path]:
    """The cgroups of this process in which it may create a child that ``controller``
    (``"pids"``, ``"memory"``) governs: cgroup v2 where the controller is enabled for children,
    or v1's hierarchy of that controller."""
    try:
        with open("/proc/self/cgroup") as own:
            memberships = [line.rstrip("\n").split(":", 2) for line in own]
        with open("/proc/self/mounts") as mounts:
            mounted = [line.split() for line in mounts]
    except OSError:
        return []
    candidates = []
    for _, controllers, path in memberships:
        for fields in mounted:
            mount_point, kind, mount_options = fields[1], fields[2], fields[3].split(",")
            if controllers == "" and kind == "cgroup2":
                folder = pathlib.Path(mount_point + path)
                try:
                    available = (folder / "cgroup.subtree_control").read_text().split()
                except OSError:
                    continue
                if controller in available:
                    candidates.append(folder)
            elif kind == "cgroup" and controller in controllers.split(",") \
                    and controller in mount_options:
                candidates.append(pathlib.Path(mount_point + path))
    return [folder for folder in candidates if os.access(folder, os.W_OK)]


def _pids_cgroup_parent() -> pathlib.Path | None:
    """A pids cgroup (v2, or v1's pids hierarchy) in which this process may create a child."""
    parents = _cgroup_parents("pids")
    return parents[0] if parents else None


def _memory_cgroup_parent() -> pathlib.Path | None:
    """A memory cgroup (v2, or v1's memory hierarchy) in which this process may create a
    child."""
    parents = _cgroup_parents("memory")
    return parents[0] if parents else None


class _Cgroup:
    """The run's own cgroups, one a hierarchy (one in all for cgroup v2): ``pids.max`` bounds
    every process started in them, and the memory limit, where asked for, their memory."""

    def __init__(self, pids_parent: pathlib.Path | None, processes: int,
                 memory_parent: pathlib.Path | None = None, memory_bytes: int | None = None):
        name = f"{_CGROUP_PREFIX}-{uuid.uuid4().hex[:12]}"
        self.folders = []
        try:
            parents = [parent for parent in (pids_parent, memory_parent) if parent is not None]
            for parent in dict.fromkeys(parents):  # v2: one folder for both
                (parent / name).mkdir()
                self.folders.append(parent / name)
            if pids_parent is not None:
                (pids_parent / name / "pids.max").write_text(str(processes))
            if memory_parent is not None:
                self._limit_memory(memory_parent / name, memory_bytes)
        except OSError:
            self.remove()
            raise
        self.procs = [folder / "cgroup.procs" for folder in self.folders]

    @staticmethod
    def _limit_memory(folder: pathlib.Path, memory_bytes: int):
        if (folder / "memory.max").exists():  # v2; swap is a limit of its own there
            (folder / "memory.max").write_text(str(memory_bytes))
            if (folder / "memory.swap.max").exists():
                (folder / "memory.swap.max").write_text("0")
        else:  # v1: memory and swap together may not exceed the same number
            (folder / "memory.limit_in_bytes").write_text(str(memory_bytes))
            if (folder / "memory.memsw.limit_in_bytes").exists():
                (folder / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))

    def _pids(self) -> set[int]:
        pids = set()
        for folder in self.folders:
            try:
                pids.update(int(pid) for pid in (folder / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return pids

    def kill_all(self):
        """SIGKILL whatever is left in them, until they are empty (a process may be forking)."""
        for _ in range(100):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self):
        self.kill_all()
        for folder in self.folders:
            for _ in range(100):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last processes are still being reaped


def _remove_stale_cgroups(parent: pathlib.Path):
    """Remove the empty cgroups of runs whose grader was killed before it could (``SIGKILL``).

    A live run joins its cgroup milliseconds after making it, and a cgroup holding processes
    cannot be removed (``EBUSY``), so an empty one older than a minute is a leftover."""
    now = time.time()
    for folder in parent.glob(f"{_CGROUP_PREFIX}-*"):
        try:
            if now - folder.stat().st_mtime > 60:
                folder.rmdir()
        except OSError:
            continue


def _open_cgroup(limits: Limits) -> _Cgroup | None:
    """The run's cgroups: a pids cgroup where one can be made (else None, and the process count
    is bounded otherwise or not at all), with the memory cgroup that ``memory_total_bytes``
    asks for; SandboxUnavailable where that one cannot be made."""
    pids_parent = _pids_cgroup_parent()
    memory_parent = None
    if limits.memory_total_bytes is not None:
        memory_parent = _memory_cgroup_parent()
        if memory_parent is None:
            raise SandboxUnavailable(
                f"cannot bound the run's total memory (Limits.memory_total_bytes="
                f"{limits.memory_total_bytes}): this process may create no memory cgroup here "
                "(run as root, or in a cgroup v2 subtree delegated to this user with the memory "
                "controller enabled), or run without the total bound")
    if pids_parent is None and memory_parent is None:
        return None
    for parent in {pids_parent, memory_parent} - {None}:
        _remove_stale_cgroups(parent)
    try:
        return _Cgroup(pids_parent, limits.processes, memory_parent,
                       limits.memory_total_bytes)
    except OSError as error:
        if memory_parent is not None:
            raise SandboxUnavailable(f"cannot bound the run's total memory: making its cgroup "
                                     f"under {memory_parent} failed ({error})") from None
        return None


def process_limit(trusted: bool = False) -> str:
    """What bounds the number of processes of a run here, in words.

    In order of preference: a pids cgroup of its own (where this process may create one: as
    root, or in a delegated cgroup); else ``RLIMIT_NPROC`` in the sandbox's own user namespace
    (a user other than root, Linux 5.14 or later: the limit counts the sandbox's processes
    only); else, in the trusted mode as root, ``RLIMIT_NPROC`` of the run's own user (whose
    only processes are the run's); else ``RLIMIT_NPROC`` over all the user's processes, raised
    by the number the user runs when the run starts. A sandboxed run as root without a pids
    cgroup has nothing that bounds it (the kernel does not apply ``RLIMIT_NPROC`` to root, the
    sandbox's user inside), though every process still dies with the sandbox.

    Parameters
    ----------
    trusted : bool
        Describe a ``trusted=True`` run (no user namespace) instead of a sandboxed one.

    Returns
    -------
    str
        The mechanism; it starts with ``"none"`` when nothing bounds the count.
    """
    parent = _pids_cgroup_parent()
    if parent is not None:
        return f"pids cgroup (pids.max under {parent})"
    if os.getuid() == 0 and trusted and run_user_problem() is None:
        return "RLIMIT_NPROC of the run's own unprivileged user"
    if os.getuid() == 0:
        return "none: running as root, without a pids cgroup this process may create"
    if not trusted and _kernel_counts_processes_per_user_namespace():
        return "RLIMIT_NPROC in the sandbox's own user namespace"
    return "RLIMIT_NPROC over all the user's processes, raised by those running at the start"


# ---------------------------------------------------------------------------------------------
# Running: the environment, the output caps, the wall clock.


def _base_env(env: dict[str, str], extra_paths: list[str]) -> dict[str, str]:
    """A scrubbed environment: minimal PATH, HOME, LANG, TMPDIR, then the caller's ``env``."""
    base = {"PATH": f"{os.path.join(sys.prefix, 'bin')}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    if extra_paths:
        base["PYTHONPATH"] = os.pathsep.join(extra_paths)
    base.update(env)
    return base


def _check_arguments(argv, workdir, limits, env) -> tuple[list[str], pathlib.Path, dict]:
    if not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"argv must be a list of str, got {argv!r}")
    if not argv:
        raise ValueError("argv must not be empty: argv[0] is the program to run")
    if any("\0" in a for a in argv):
        raise ValueError(f"argv must not contain NUL characters, got {argv!r}")
    if not isinstance(workdir, (str, os.PathLike)):
        raise TypeError(f"workdir must be a path, got {type(workdir).__name__}")
    workdir = pathlib.Path(workdir).resolve()
    if not workdir.is_dir():
        raise ValueError(f"workdir must be an existing folder, got {str(workdir)!r}")
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0])
    if program is None:
        raise ValueError(f"argv[0] {argv[0]!r} is not a program on PATH")
    return [os.path.abspath(program), *argv[1:]], workdir, env


def _check_hidden(hidden) -> tuple[pathlib.Path, ...]:
    if not (isinstance(hidden, (list, tuple))
            and all(isinstance(path, (str, os.PathLike)) for path in hidden)):
        raise TypeError(f"hidden must be a list of paths, got {hidden!r}")
    return tuple(pathlib.Path(path).resolve() for path in hidden)


def _visible_inside(program: str, roots: list[pathlib.Path]) -> bool:
    real = pathlib.Path(program).resolve()
    visible = [pathlib.Path("/usr"), *roots,
               *(pathlib.Path(d) for d in _SYSTEM_DIRS if not os.path.islink(d))]
    return any(_is_under(real, root) for root in visible)


def run(argv: list[str], workdir: pathlib.Path, *, limits: Limits = Limits(),
        trusted: bool = False, env: dict | None = None, hidden: list | tuple = ()) -> Result:
    r"""Run ``argv`` in the sandbox, with ``workdir`` as its only lasting writable folder.

    Parameters
    ----------
    argv : list of str
        The command; ``argv[0]`` is the program (an absolute path, or a name found on PATH),
        which must be visible inside: typically ``sys.executable``, with a script the caller
        put in ``workdir`` (a path relative to it, since the command runs in it).
    workdir : pathlib.Path
        An existing folder, mounted read-write at ``/sandbox`` (the working directory). With
        ``trusted=True`` the command runs in it where it is.
    limits : Limits
        The resource limits.
    trusted : bool
        Run without the sandbox, as a plain process in its own session with the same resource
        limits and scrubbed environment, only for code that is trusted: nothing stops it from
        reading or writing any file the user may, using the network, or leaving a process that
        put itself in a new session behind (unless a pids cgroup is available, which is
        emptied). As root, the command runs as a user of the run's own (an id no account names
        and no process holds, no supplementary groups), to whom ``workdir`` is given: it reads
        and writes only what every user may (and ``workdir``), cannot signal or trace this
        process; every process of that user is killed when the run ends, and what it left at
        the top of ``/tmp``, ``/var/tmp`` and ``/dev/shm`` is removed; where that user
        could not run this interpreter, it runs as root, and a note says why
        ([run_user_problem][opd_literate.course.sandbox.run_user_problem]).
    env : dict of str to str, optional
        Variables for the command, over a minimal ``PATH``, ``HOME`` and ``TMPDIR`` (``/tmp``)
        and ``LANG``; nothing of the caller's environment is passed.
    hidden : list of paths, optional
        Folders the command must not see (the folder being graded, whose files the caller
        copied into ``workdir``): ``run`` refuses, as for the home folder, the temporary
        folder or ``workdir`` itself, where a folder it shows read-only would hold one.

    Returns
    -------
    Result
        The exit status, the capped output, and whether it timed out or was truncated.

    Raises
    ------
    SandboxUnavailable
        Without ``trusted``, where ``bwrap`` is missing or cannot create its namespaces
        (see [unavailable_reason][opd_literate.course.sandbox.unavailable_reason]), or where
        a folder it would show holds one it must not (a home, ``/run``, the temporary folder,
        ``workdir``, a ``hidden`` folder), or the interpreter's path goes through a symbolic
        link in a place the sandbox replaces (``/proc``, ``/dev``).
    TypeError, ValueError
        A malformed ``argv``, ``workdir``, ``limits``, ``env`` or ``hidden``, or an
        ``argv[0]`` that would not be visible inside the sandbox.

    Examples
    --------
    >>> import sys, tempfile, pathlib
    >>> from opd_literate.course import sandbox
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     result = sandbox.run([sys.executable, "-c", "print(6 * 7)"], pathlib.Path(folder),
    ...                          trusted=sandbox.unavailable_reason() is not None)
    >>> result.returncode, result.stdout, result.timed_out
    (0, b'42\n', False)
    """
    argv, workdir, env = _check_arguments(argv, workdir, limits, env)
    hidden = _check_hidden(hidden)
    notes, user = [], None
    if trusted:
        notes.append("trusted: a plain process, no filesystem, network or PID isolation")
        problem = run_user_problem()
        if problem is None:
            user = _run_user()
            notes.append(f"trusted as root: run as a user of its own (id {user}, no groups), "
                         "who reads what every user may read")
        elif os.getuid() == 0:
            notes.append(f"trusted as root, and run as root: {problem}")
        rlimits = _rlimits(limits, inside_user_namespace=False, uid=user)
        command_prefix, fds, roots, status_read, info_read = None, [], [], None, None
    else:
        bwrap = _bwrap_path()
        reason = unavailable_reason()
        if reason is not None:
            raise SandboxUnavailable(_unavailable_message(reason))
        rlimits = None
        status_read, status_write = os.pipe()
        info_read, info_write = os.pipe()
        try:
            command_prefix, fds, roots = _bwrap_command(
                os.path.realpath(bwrap), argv, workdir, limits, status_fd=status_write,
                info_fd=info_write, hidden=hidden)
        except BaseException as error:
            for fd in (status_read, status_write, info_read, info_write):
                os.close(fd)
            if isinstance(error, _Refused):
                raise SandboxUnavailable(_unavailable_message(error.reason)) from None
            raise
        fds += [status_write, info_write]
        if not _visible_inside(argv[0], roots):
            for fd in (*fds, status_read, info_read):
                os.close(fd)
            raise ValueError(f"argv[0] {argv[0]!r} is not visible inside the sandbox (read-only "
                             f"roots: /usr, {', '.join(map(str, roots))})")
    cgroup = _open_cgroup(limits)
    if cgroup is None and os.getuid() == 0:
        notes.append("process count not bounded: running as root (the kernel does not apply "
                     "RLIMIT_NPROC to root) without a pids cgroup this process may create")
    launcher = {"cgroup_procs": [str(procs) for procs in cgroup.procs] if cgroup else [],
                "rlimits": rlimits or {}, "status_fd": None,
                "user": [user, user] if user is not None else None}
    launcher_argv = [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(launcher)]
    if trusted:
        command = [*launcher_argv, *argv]
        extra_paths = []
    else:
        # The outer launcher only joins the cgroup (the limits are set inside the sandbox).
        command = [*launcher_argv, *command_prefix] if cgroup else command_prefix
        extra_paths = [str(root) for root in roots if _is_extra_site(root)]
    try:
        if user is not None:
            _give(workdir, user)
        return _supervise(command, workdir, limits, fds, status_read, info_read, cgroup,
                          _base_env(env, extra_paths), sandboxed=not trusted,
                          notes=tuple(notes))
    finally:
        for fd in (*fds, status_read, info_read):
            if fd is not None:
                os.close(fd)
        if user is not None:
            _kill_user(user)
            _remove_files_of(user, keep=workdir)
        if cgroup is not None:
            cgroup.remove()


# ---------------------------------------------------------------------------------------------
# The trusted mode as root: a user of the run's own.


def _process_uids() -> set[int]:
    """Every user id (real, effective, saved, file system) a process on the machine holds."""
    return {uid for _, fields in _proc_statuses() for uid in _uids(fields)}


_USED_RUN_USERS: set[int] = set()  # ids this process gave a run: never given twice


def _run_user() -> int:
    """An id in ``_RUN_USERS`` that no account or group names, no process holds and this process
    never gave before, from a random start (two graders at once start apart)."""
    import grp
    import pwd
    import secrets

    held = _process_uids() | _USED_RUN_USERS
    first = secrets.randbelow(len(_RUN_USERS))
    for step in range(len(_RUN_USERS)):
        uid = _RUN_USERS[(first + step) % len(_RUN_USERS)]
        if uid in held:
            continue
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            _USED_RUN_USERS.add(uid)
            return uid
    raise SandboxUnavailable(f"no free user id for the trusted mode in {_RUN_USERS}")


def run_user_problem() -> str | None:
    """Why a ``trusted=True`` run cannot run its command as a user of its own here, or None.

    As root it can, where a user without privileges may run this interpreter (every folder on
    its path, and its standard library, readable by every user); otherwise the command runs as
    this process's user, and reads and writes what that user may. A caller that must keep
    files from the command (the Gradescope harness: the reference solutions) refuses the
    trusted mode where this is not None."""
    if os.getuid() != 0:
        return "not running as root: the command runs as this user"
    return _unprivileged_python_problem()


@functools.cache
def _unprivileged_python_problem() -> str | None:
    """Why a user without privileges cannot run this interpreter, or None (checked once a
    process, as root)."""
    uid = _run_user()
    launcher = {"cgroup_procs": [], "rlimits": {}, "status_fd": None, "user": [uid, uid]}
    try:
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(launcher),
                                sys.executable, "-I", "-c", "import json, os, resource"],
                               cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot check the trusted mode's unprivileged user: {error}"
    finally:
        _kill_user(uid)
    if probe.returncode != 0:
        said = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return (f"a user without privileges cannot run {sys.executable} (exit "
                f"{probe.returncode}: {said[0][:200]}); a Python environment where every user "
                "may read it (not under /root or another folder of mode 0700) lets the trusted "
                "mode run the command as a user of its own")
    return None


def _give(workdir: pathlib.Path, uid: int):
    """``workdir`` and everything in it to ``uid`` (user and group), no link followed."""
    os.lchown(workdir, uid, uid)
    for folder, names, files in os.walk(workdir):  # os.walk does not enter linked folders
        for name in names + files:
            os.lchown(os.path.join(folder, name), uid, uid)


def _processes_of(uid: int) -> dict[int, str]:
    """The processes that hold ``uid`` (real, effective, saved or file system), with their state
    letter (``T`` stopped, ``Z`` a zombie, ...), from ``/proc``."""
    return {pid: (fields.get("State", "").split() or ["?"])[0]
            for pid, fields in _proc_statuses() if uid in _uids(fields)}


def _kill_user(uid: int, rounds: int = 10_000):
    """Kill every process of ``uid``, from this (root) process, however they fork.

    A process of that user may fork and exit over and over, and kill what the user runs (a
    ``kill(-1)`` sent as that user would reach the sender too). So each round stops
    (``SIGSTOP``, which cannot be caught) every one still running: a stopped process creates
    none. Once a round finds all of them stopped or ended, they are killed, and the rounds go on
    until none is left."""
    for _ in range(rounds):
        found = _processes_of(uid)
        if not found:
            return
        running = [pid for pid, state in found.items() if state not in ("T", "t", "Z", "X")]
        for pid in running or found:
            _signal_if_of(pid, uid, signal.SIGSTOP if running else signal.SIGKILL)
        if not running:
            time.sleep(0.001)  # the killed are being reaped; zombies stay until their parent
            if all(state in ("Z", "X") for state in _processes_of(uid).values()):
                return


def _signal_if_of(pid: int, uid: int, number: int):
    """Send ``number`` to ``pid`` if it is still a process of ``uid``: through a pidfd, opened
    before the check, so that a PID reused by another process in between is never signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # Linux before 5.3: the PID, checked just before
        pidfd = None
    try:
        fields = _proc_status(pid)
        if fields is None or uid not in _uids(fields):
            return
        if pidfd is None:
            os.kill(pid, number)
        else:
            signal.pidfd_send_signal(pidfd, number)
    except ProcessLookupError:
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


# What a run's own user may leave where every user may write: removed after the run.
_SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")


def _remove_files_of(uid: int, keep: pathlib.Path):
    """Remove what ``uid`` made at the top of ``_SHARED_FOLDERS`` (files and folders it owns,
    but ``keep``, the run's working folder, given to it): no later run sees it, and ``/dev/shm``
    keeps none of its memory. Its processes have ended, so nothing moves while this runs; a link
    is removed, never followed."""
    kept = os.stat(keep)
    for shared in _SHARED_FOLDERS:
        try:
            entries = list(os.scandir(shared))
        except OSError:
            continue
        for entry in entries:
            try:
                status = entry.stat(follow_symlinks=False)
                if status.st_uid != uid or (status.st_dev, status.st_ino) == (kept.st_dev,
                                                                              kept.st_ino):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)  # fd-based: no link followed
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def _is_extra_site(root: pathlib.Path) -> bool:
    """A read-only root outside the interpreter's prefixes: a site folder the sandboxed
    interpreter must be told about (a user site, or a folder on the caller's PYTHONPATH)."""
    prefixes = [pathlib.Path(prefix).resolve() for prefix in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)]
    return not any(_is_under(root, prefix) for prefix in prefixes)


class _CappedStream:
    """Bytes read from a pipe, kept up to a cap; the rest is read and dropped."""

    def __init__(self, cap: int):
        self.cap, self.chunks, self.kept, self.truncated = cap, [], 0, False

    def feed(self, data: bytes):
        room = self.cap - self.kept
        if len(data) > room:
            self.truncated = True
            data = data[:room]
        if data:
            self.chunks.append(data)
            self.kept += len(data)

    def value(self) -> bytes:
        return b"".join(self.chunks)


def _supervise(command, workdir, limits, fds, status_read, info_read, cgroup, env, sandboxed,
               notes):
    deadline = time.monotonic() + limits.wall_seconds
    process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=fds,
                               start_new_session=True)
    # The child holds its own copies: the pipes reach end of file when it closes them.
    while fds:
        os.close(fds.pop())
    out, err = _CappedStream(limits.output_bytes), _CappedStream(limits.output_bytes)
    sinks = {process.stdout.fileno(): out.feed, process.stderr.fileno(): err.feed}
    status, first = bytearray(), _FirstProcess()
    if status_read is not None:
        sinks[status_read] = functools.partial(_append_capped, status)
    if info_read is not None:
        sinks[info_read] = first.feed
    selector = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    timed_out, ended_at = False, None
    try:
        while selector.get_map():
            now = time.monotonic()
            if ended_at is None and _has_exited(process):
                ended_at = now
            if ended_at is not None:
                # Only a process that left the session (trusted mode) keeps a pipe open now.
                limit = min(deadline, ended_at + _DRAIN_SECONDS)
            else:
                limit = deadline
            if now >= limit:
                if ended_at is not None or timed_out:
                    break
                timed_out = True
                _kill(process, first, cgroup)
                deadline = now + _DRAIN_SECONDS
                continue
            for key, _ in selector.select(timeout=limit - now):
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if data:
                    sinks[key.fd](data)
                else:
                    selector.unregister(key.fd)
    finally:
        selector.close()
        # Before the leader is reaped, its process group cannot be another's.
        _kill(process, first, cgroup)
        process.wait()
        process.stdout.close()
        process.stderr.close()
        first.close()
    returncode, fault = process.returncode, None
    code = _exit_code(bytes(status)) if status else None
    if code is not None:
        returncode = code
    elif timed_out:
        returncode = -signal.SIGKILL
    if status and code is None:
        fault = (f"the launcher's wait status is garbled ({bytes(status)[:40]!r}): something "
                 "other than the launcher wrote to its pipe")
    return Result(returncode=returncode, stdout=out.value(), stderr=err.value(),
                  timed_out=timed_out, truncated=out.truncated or err.truncated,
                  sandboxed=sandboxed, notes=notes, fault=fault)


def _exit_code(status: bytes) -> int | None:
    """The return code of the wait status the launcher wrote (decimal digits of a 16-bit
    number), or None for anything else: never an exception, whatever reached the pipe."""
    if not (len(status) <= 5 and status.isdigit() and int(status) <= 0xFFFF):
        return None
    try:
        return os.waitstatus_to_exitcode(int(status))
    except (ValueError, OverflowError):  # a stopped or continued process, or no status at all
        return None


def _append_capped(buffer: bytearray, data: bytes, cap: int = 4096):
    buffer += data[:max(cap - len(buffer), 0)]


def _has_exited(process: subprocess.Popen) -> bool:
    """Whether the process has ended, without reaping it (``WNOWAIT``)."""
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class _FirstProcess:
    """The sandbox's first process, from ``bwrap --info-fd``, held by a pidfd once known (a
    pidfd names that process even after its PID is reused, so a late kill cannot miss)."""

    def __init__(self):
        self.info, self.pidfd, self.pid = bytearray(), None, None

    def feed(self, data: bytes):
        _append_capped(self.info, data)
        if self.pid is not None:
            return
        try:
            pid = json.loads(bytes(self.info).decode())["child-pid"]
        except (ValueError, KeyError, TypeError):
            return  # not all of it yet
        if not isinstance(pid, int) or pid <= 1:
            return
        self.pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None  # Linux before 5.3: kill by PID while bwrap runs (see _kill)

    def kill(self) -> bool:
        """SIGKILL it; whether a signal was sent."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.pid is not None:
                os.kill(self.pid, signal.SIGKILL)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _kill(process: subprocess.Popen, first: _FirstProcess, cgroup: _Cgroup | None):
    """SIGKILL what is left of the run: the sandbox's first process, the session, the cgroup.

    The sandbox's first process is killed first: the kernel then kills every process of its
    PID namespace, and ``bwrap`` exits only once it has reaped it, so that when ``bwrap`` has
    been waited for, nothing of the sandbox runs. The session (``bwrap`` itself, or the trusted
    command and its children) is killed next; this runs before ``bwrap`` is reaped, so that its
    process group cannot be another's."""
    if process.returncode is not None:
        return
    # Without a pidfd, the PID is only safe to use while bwrap, its parent, has not exited.
    if (first.pidfd is not None or not _has_exited(process)) and first.kill():
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if cgroup is not None:
        cgroup.kill_all()
