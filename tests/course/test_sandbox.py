"""The operating-system sandbox against code that attacks it.

Each attack is a small script run through ``sandbox.run``, with a canary it must not reach (a
file outside the working folder, the library's source, a listening socket, a process of the
caller's) and a marker in its command line, so that a process it leaves behind is found in
``/proc`` after ``run`` returns. Tests that need bubblewrap skip where it cannot run (set
``OPD_REQUIRE_SANDBOX=1`` to make them fail instead, as ``.ci/run`` does).
"""

import importlib.util
import json
import math
import os
import pathlib
import shlex
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import uuid

import pytest

from opd_literate.course import sandbox
from opd_literate.course.sandbox import Limits, Result, SandboxUnavailable

REPOSITORY = pathlib.Path(sandbox.__file__).resolve().parents[2]
PACKAGE = REPOSITORY / "opd_literate"

_REASON = sandbox.unavailable_reason()
if _REASON is not None and os.environ.get("OPD_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"OPD_REQUIRE_SANDBOX=1 but the sandbox is unavailable: {_REASON}")
needs_bwrap = pytest.mark.skipif(_REASON is not None, reason=f"no sandbox here: {_REASON}")

_UNPRIVILEGED = 65534  # nobody

# Short limits for the attacks that would otherwise run until the default 60 s.
QUICK = Limits(wall_seconds=5.0, cpu_seconds=5, processes=16)


def _script(workdir: pathlib.Path, body: str, marker: str = "") -> list[str]:
    """The command that runs ``body`` from a file in ``workdir``, ``marker`` in its argv."""
    (workdir / "attack.py").write_text(textwrap.dedent(body))
    return [sys.executable, "attack.py", *([marker] if marker else [])]


def _survivors(marker: str) -> list[int]:
    """Processes on the machine whose command line contains ``marker``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _shell_runs(marker: str) -> bool:
    """Whether a ``/bin/sh`` whose command line holds ``marker`` runs on the machine."""
    for pid in _survivors(marker):
        try:
            if pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/sh\0"):
                return True
        except OSError:
            continue
    return False


@pytest.fixture
def workdir(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


@pytest.fixture
def marker():
    return f"opd-sandbox-marker-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# What the command sees and may write.


@needs_bwrap
def test_workdir_is_the_writable_working_folder(workdir):
    (workdir / "given.txt").write_text("input")
    argv = _script(workdir, """
        import os
        print(os.getcwd(), open("given.txt").read())
        open("answer.txt", "w").write("output")
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"/sandbox input\n"
    assert (workdir / "answer.txt").read_text() == "output"
    assert result.sandboxed and not result.timed_out and not result.truncated


@needs_bwrap
def test_canary_outside_the_workdir_is_never_written(tmp_path, workdir):
    outside = [tmp_path / "canary.txt", REPOSITORY / f"canary-{uuid.uuid4().hex}.txt",
               pathlib.Path(sys.prefix) / "canary.txt"]
    argv = _script(workdir, f"""
        import os
        for path in {[str(p) for p in outside]!r}:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").write("escaped")
                print("wrote inside the sandbox only", path)
            except OSError as error:
                print("refused", path, type(error).__name__)
    """)
    try:
        result = sandbox.run(argv, workdir)
        assert result.returncode == 0, result.stderr
        assert [path for path in outside if path.exists()] == []
        # The sandbox's own /tmp is a fresh tmpfs: the first write succeeded there, not here.
        assert b"wrote inside the sandbox only " + str(outside[0]).encode() in result.stdout
        assert b"refused " + str(outside[2]).encode() + b" OSError" in result.stdout
    finally:
        for path in outside[1:]:
            path.unlink(missing_ok=True)


@needs_bwrap
def test_only_the_workdir_tmp_and_shm_are_writable(workdir):
    places = ["/sandbox", "/tmp", "/dev/shm", "/", "/etc", "/dev", "/usr", "/proc",
              str(pathlib.Path(sys.prefix).resolve()), str(pathlib.Path.home())]
    argv = _script(workdir, f"""
        import os
        for place in {places!r}:
            try:
                open(os.path.join(place, "written.txt"), "w").close()
                print(place, "written")
            except OSError as error:
                print(place, type(error).__name__)
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    outcome = dict(line.rsplit(" ", 1) for line in result.stdout.decode().splitlines())
    assert {place for place, what in outcome.items() if what == "written"} == {
        "/sandbox", "/tmp", "/dev/shm"}
    assert len(outcome) == len(places)


@needs_bwrap
@pytest.mark.slow
def test_dev_holds_only_the_harmless_devices(workdir):
    argv = _script(workdir, """
        import os, stat
        print(sorted(name for name in os.listdir("/dev")
                     if stat.S_ISCHR(os.lstat(f"/dev/{name}").st_mode)))
        print(sorted(name for name in os.listdir("/dev")
                     if stat.S_ISDIR(os.lstat(f"/dev/{name}").st_mode)))
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines() == [
        str(["full", "null", "random", "tty", "urandom", "zero"]), str(["pts", "shm"])]


@needs_bwrap
@pytest.mark.slow
def test_tmp_and_shm_hold_at_most_file_bytes(workdir):
    limits = Limits(file_bytes=2**20)
    argv = _script(workdir, """
        import errno
        for place in ("/tmp", "/dev/shm"):
            written = 0
            try:
                for index in range(8):
                    with open(f"{place}/part{index}", "wb") as part:
                        part.write(b"x" * 2**19)
                    written += 2**19
            except OSError as error:
                print(place, written, errno.errorcode[error.errno])
    """)
    result = sandbox.run(argv, workdir, limits=limits)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"/tmp 1048576 ENOSPC\n/dev/shm 1048576 ENOSPC\n"


@needs_bwrap
def test_the_library_and_the_repository_cannot_be_read(workdir):
    targets = [PACKAGE / "opd.py", PACKAGE / "course" / "grade.py", REPOSITORY / ".git",
               REPOSITORY / "tests", pathlib.Path("/work/main/opd_literate/opd.py"),
               pathlib.Path("/etc/shadow")]
    # What an installation of the library leaves in site-packages (here, the editable one).
    targets += [entry for folder in map(pathlib.Path, site.getsitepackages())
                if folder.is_dir() for entry in folder.iterdir()
                if "opd_literate" in entry.name.replace("-", "_")]
    argv = _script(workdir, f"""
        import os
        for path in {[str(p) for p in targets]!r}:
            try:
                if os.path.isdir(path):
                    print("listed", path, os.listdir(path))
                else:
                    open(path, "rb").read()
                    print("read", path)
            except OSError as error:
                print("refused", path, type(error).__name__)
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert all(line.startswith("refused ") or line.endswith(" []") for line in lines), lines
    assert len(lines) == len(targets)


@needs_bwrap
@pytest.mark.slow
def test_the_callers_home_holds_only_the_way_to_python(workdir):
    home = pathlib.Path.home().resolve()
    roots = sandbox.python_roots()  # what the sandbox binds (checked to be minimal below)
    if any(home == root or root in home.parents for root in roots):
        pytest.skip(f"the home {home} lies in the Python installation {roots}")
    # Python may be installed in the home (pyenv, conda, a virtual environment there): the
    # first folder on the way to each root the sandbox binds appears, nothing else.
    expected = sorted({root.relative_to(home).parts[0] for root in roots if home in root.parents})
    argv = _script(workdir, f"""
        import os
        print(sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else [])
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{expected}\n".encode()


@needs_bwrap
def test_importing_the_library_fails(workdir):
    argv = _script(workdir, """
        import importlib.util, json, os, sys
        print(importlib.util.find_spec("opd_literate"))
        print(json.dumps([f(p) for p in sys.path for f in (os.path.abspath, os.path.realpath)]))
        import opd_literate
    """)
    result = sandbox.run(argv, workdir)
    found, path = result.stdout.decode().splitlines()
    assert found == "None"
    # No entry is the repository or the package, compared by path components: a clone named
    # opd-literate, or a virtual environment inside it, is no way in.
    assert [p for p in json.loads(path) if pathlib.Path(p) in (REPOSITORY, PACKAGE)] == []
    assert result.returncode == 1
    assert b"ModuleNotFoundError: No module named 'opd_literate'" in result.stderr


def test_the_python_roots_are_the_interpreters_folders_and_no_more():
    """What the sandbox binds of the Python installation: the outermost of the prefixes (a
    virtual environment's and its base Python's) and the site folders of numpy and torch."""
    wanted = {pathlib.Path(prefix).resolve() for prefix in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    wanted |= {pathlib.Path(importlib.util.find_spec(name).origin).resolve().parents[1]
               for name in ("numpy", "torch")}
    wanted.discard(pathlib.Path("/"))
    roots = sandbox.python_roots()
    assert set(roots) <= wanted
    assert all(any(folder == root or root in folder.parents for root in roots)
               for folder in wanted)
    assert not [(a, b) for a in roots for b in roots if a in b.parents]  # none inside another


@pytest.mark.parametrize(("root", "problem"), [
    ("/tmp", "would cover the sandbox's own /tmp"), ("/dev", "cover the sandbox's own /dev "),
    ("/dev/shm", "own /dev/shm"), ("/etc", "own /etc"), ("/proc/1/root", "lies in /proc"),
    ("/dev/input", "lies in /dev"), ("/sandbox/venv", "lies in /sandbox"),
    ("/opt/numpy:site", "cannot be named on the sandbox's PYTHONPATH"),
    ("/tmp/a venv", None), ("/dev/shm/venv", None), (f"{REPOSITORY}-venv", None)])
def test_a_root_that_would_cover_the_sandboxs_own_places_is_refused(root, problem):
    """Under /tmp or /dev/shm a root is bound over the fresh tmpfs; one that is or holds a place
    the sandbox makes its own would show the machine's there instead."""
    found = sandbox._root_problem([pathlib.Path(root)])
    assert found is None if problem is None else problem in found, found


def test_a_pth_file_is_masked_when_it_can_import_the_library(tmp_path):
    """A path line that names the checkout or a folder holding the package, or an ``import``
    line that names either or the library: masked. A path beside the checkout that shares its
    name as a prefix (``clone-venv`` beside ``clone``) is not the checkout."""
    clone = tmp_path / "clone"
    (clone / "opd_literate").mkdir(parents=True)
    (tmp_path / "other" / "opd_literate").mkdir(parents=True)
    places = {clone, clone / "opd_literate"}
    lines = {"checkout": f"{clone}\n", "relative": "clone\n", "holder": f"{tmp_path}/other\n",
             "hook": "import opd_literate_hook\n",
             "inside": f"import site; site.addsitedir({str(clone / '.venv')!r})\n",
             "beside": f"{clone}-venv/lib/site-packages\n",
             "beside_hook": f"import site; site.addsitedir({str(clone) + '-venv'!r})\n",
             "plain": "import os\n# opd_literate in a comment\n"}
    for name, line in lines.items():
        (tmp_path / f"{name}.pth").write_text(line)
    masked = {name for name in lines
              if sandbox._pth_names_the_library(tmp_path / f"{name}.pth", places)}
    assert masked == {"checkout", "relative", "holder", "hook", "inside"}


@needs_bwrap
def test_proc_cannot_be_written_the_kernels_settings_above_all(workdir):
    """As root the files of /proc/sys are writable though their folder is not, and bwrap covers
    the folder only where it finds it writable: ``kernel.core_pattern`` would run a program of
    the command's as root outside. Every file of /proc but the processes' own is opened for
    writing (opened only, never written): none opens."""
    argv = _script(workdir, """
        import errno, json, os, stat
        def opens(path):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
                return "opened"
            except OSError as error:
                return errno.errorcode[error.errno]
        print(opens("/proc/sys/kernel/core_pattern"), os.getuid())
        paths = []
        for top in os.listdir("/proc"):
            if not top.isdigit() and top not in ("self", "thread-self"):
                paths.append(f"/proc/{top}")
                for folder, _, files in os.walk(f"/proc/{top}"):
                    paths += [os.path.join(folder, name) for name in files]
        regular = [path for path in paths if os.path.isfile(path) and not os.path.islink(path)]
        print(json.dumps([path for path in regular if opens(path) == "opened"]), len(regular))
    """)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    core_pattern, opened = result.stdout.decode().splitlines()
    # EROFS: /proc is mounted read-only (another user than root may be refused before that).
    assert core_pattern in (["EROFS 0"] if os.getuid() == 0 else
                            [f"EROFS {os.getuid()}", f"EACCES {os.getuid()}"])
    opened, tried = opened.rsplit(" ", 1)
    assert json.loads(opened) == [] and int(tried) > 100  # /proc/sys alone holds hundreds


def _fake_installation(base: pathlib.Path) -> list[pathlib.Path]:
    """Copies of the library in the site folders of a fake Python installation at ``base``
    (a base Python's site-packages, Debian's dist-packages, /usr/local's, Fedora's lib64, a
    pyenv-virtualenv or conda environment): what each leaves, as the sandbox should mask it."""
    left = []
    for site_folder in ("lib/python3.11/site-packages", "lib/python3/dist-packages",
                        "local/lib/python3.12/dist-packages", "lib64/python3.11/site-packages",
                        "envs/other/lib/python3.11/site-packages"):
        folder = base / site_folder
        (folder / "opd_literate" / "course").mkdir(parents=True)
        (folder / "opd_literate" / "course" / "grade.py").write_text("REFERENCE = 'secret'\n")
        (folder / "opd_literate-0.1.0.dist-info").mkdir()
        (folder / "opd_literate-0.1.0.dist-info" / "RECORD").write_text("opd_literate/opd.py\n")
        (folder / "__editable___opd_literate_0_1_0_finder.py").write_text("MAPPING = 'secret'\n")
        (folder / "other.pth").write_text(f"{folder}\n")  # names a folder holding the package
        left += [folder / "opd_literate", folder / "opd_literate-0.1.0.dist-info",
                 folder / "__editable___opd_literate_0_1_0_finder.py", folder / "other.pth"]
    return left


def test_the_library_is_masked_in_every_site_folder_of_what_is_shown(tmp_path):
    """Not only in this interpreter's site folders: the base Python's whole prefix and /usr
    are shown, and a copy installed in any of their site folders is as readable."""
    base = tmp_path / "base"
    left = _fake_installation(base)
    folders, files = sandbox._library_masks([*sandbox.python_roots(), base])
    assert set(left) - set(folders) - set(files) == set()
    assert {path for path in [*folders, *files] if base in path.parents} == set(left)


@needs_bwrap
def test_a_copy_of_the_library_in_the_base_pythons_site_folders_cannot_be_read(
        tmp_path, workdir, monkeypatch):
    """The review's case: a base Python (here a fake one, shown as the base prefix is) with a
    copy of the library in its site-packages, and in the other site folders it may hold."""
    base = tmp_path / "base"
    left = _fake_installation(base)
    real = sandbox.python_roots
    monkeypatch.setattr(sandbox, "python_roots", lambda: sorted([*real(), base]))
    targets = [str(path / "course" / "grade.py") if path.name == "opd_literate" else str(path)
               for path in left]
    argv = _script(workdir, f"""
        import os
        for path in {targets!r}:
            try:
                if os.path.isdir(path):
                    print(path, "lists", os.listdir(path))
                else:
                    print(path, "holds", len(open(path, "rb").read()))
            except OSError as error:
                print(path, "refused", type(error).__name__)
    """)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    outcome = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines())
    assert set(outcome) == set(targets)
    # A masked folder is empty; a masked file is /dev/null on a nodev mount, which no one opens.
    assert {path: what for path, what in outcome.items() if what not in (
        "lists []", "refused FileNotFoundError", "refused PermissionError")} == {}


def test_a_root_that_holds_a_home_run_the_temporary_folder_or_the_repository_is_refused(
        tmp_path, monkeypatch):
    """A Python built with ``--prefix=$HOME`` would show ``~/.ssh`` and every folder beside
    it; ``/run`` holds sockets, which a read-only mount does not stop a connection to; the
    temporary folder holds other runs' folders; the repository the reference; a hidden folder
    (the one being graded) is the caller's to name. A root inside any of them is fine."""
    monkeypatch.setenv("HOME", str(tmp_path / "prefix" / "alice"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch" / "tmp"))
    refused = {tmp_path / "prefix": "holds the home folder",
               pathlib.Path("/home"): "holds the users' home folders",
               pathlib.Path("/root"): "holds root's home folder",
               pathlib.Path("/run"): "holds the machine's run-time files and sockets",
               tmp_path / "scratch": "holds the temporary folder"}
    if (REPOSITORY / "pyproject.toml").is_file():  # a checkout, not an installed library
        # a clone straight under /tmp (or /) is refused first for covering that folder
        problem = sandbox._root_problem([REPOSITORY.parent])
        assert problem is not None, REPOSITORY.parent
        if str(REPOSITORY.parent) not in ("/", "/tmp", "/dev/shm"):
            refused[REPOSITORY.parent] = "holds this library's repository"
    for root, said in refused.items():
        problem = sandbox._root_problem([root])
        assert problem is not None and said in problem, (root, problem)
        assert problem.startswith(f"the Python installation's folder {str(root)!r} ")
    hidden = [("a folder the caller hides", tmp_path / "labs" / "student-b")]
    problem = sandbox._root_problem([tmp_path / "labs"], hidden)
    assert problem is not None and "holds a folder the caller hides" in problem
    for root in (tmp_path / "prefix" / "alice" / ".pyenv" / "versions" / "3.11",
                 tmp_path / "scratch" / "venv", tmp_path / "labs-venv", REPOSITORY / ".venv"):
        assert sandbox._root_problem([root], hidden) is None, root
    # /usr is shown whatever the Python: a hidden folder there is refused too.
    problem = sandbox._root_problem([], [("a folder the caller hides", "/usr/share/labs/b")])
    assert problem is not None and problem.startswith("the system folder '/usr' holds")


@needs_bwrap
def test_a_python_installed_over_the_home_folder_is_refused(tmp_path, workdir, monkeypatch):
    """The review's case, with a fake installation whose prefix holds the home folder (its
    ``.ssh``) and another student's folder: refused, without offering the trusted mode."""
    prefix = tmp_path / "prefix"
    key = prefix / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_text("secret key")
    monkeypatch.setenv("HOME", str(prefix / "home"))
    real = sandbox.python_roots
    monkeypatch.setattr(sandbox, "python_roots", lambda: sorted([*real(), prefix]))
    with pytest.raises(SandboxUnavailable, match="holds the home folder") as refused:
        sandbox.run([sys.executable, "-c", f"print(open({str(key)!r}).read())"], workdir)
    assert "trusted=True" not in str(refused.value)


@needs_bwrap
def test_the_roots_are_checked_again_for_each_run(workdir, monkeypatch):
    """unavailable_reason's answer is remembered; a root that changed since (numpy found in a
    folder that covers /tmp, say) is refused by the run itself."""
    assert sandbox.unavailable_reason() is None
    real = sandbox.python_roots
    monkeypatch.setattr(sandbox, "python_roots", lambda: sorted([*real(), pathlib.Path("/tmp")]))
    with pytest.raises(SandboxUnavailable, match="would cover the sandbox's own /tmp"):
        sandbox.run([sys.executable, "-c", "import os; print(os.listdir('/tmp'))"], workdir)


@pytest.mark.parametrize("hidden", ["/tmp/lab", [1], None])
def test_run_rejects_hidden_that_is_no_list_of_paths(workdir, hidden):
    with pytest.raises(TypeError, match="hidden must be a list of paths"):
        sandbox.run([sys.executable, "-c", "pass"], workdir, hidden=hidden)


@needs_bwrap
@pytest.mark.slow
def test_numpy_and_torch_are_importable(workdir):
    argv = _script(workdir, """
        import numpy, torch
        print(numpy.arange(4).sum(), torch.ones(3).sum().item())
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"6 3.0\n"


@needs_bwrap
@pytest.mark.slow
def test_environment_is_scrubbed(workdir, monkeypatch):
    monkeypatch.setenv("OPD_SECRET_TOKEN", "hunter2")
    argv = _script(workdir, """
        import json, os
        print(json.dumps(dict(os.environ), sort_keys=True))
    """)
    result = sandbox.run(argv, workdir, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    environment = __import__("json").loads(result.stdout)
    assert "OPD_SECRET_TOKEN" not in environment and b"hunter2" not in result.stdout
    assert environment["OMP_NUM_THREADS"] == "1"
    assert environment["HOME"] == "/tmp" and environment["LANG"] == "C.UTF-8"
    # bwrap sets PWD (its --chdir); PYTHONPATH only names site folders outside the Python
    # installation, where numpy or torch was found there.
    assert set(environment) - {"PYTHONPATH"} == {"PATH", "HOME", "TMPDIR", "LANG", "PWD",
                                                  "OMP_NUM_THREADS"}
    prefixes = [pathlib.Path(sys.base_prefix).resolve(), pathlib.Path(sys.prefix).resolve()]
    for folder in environment.get("PYTHONPATH", "").split(os.pathsep) if "PYTHONPATH" in \
            environment else []:
        assert not any(prefix in pathlib.Path(folder).parents for prefix in prefixes)


NAMESPACES = ("user", "pid", "net", "ipc", "uts", "mnt")


@needs_bwrap
@pytest.mark.slow
def test_own_namespaces_and_session_no_capabilities_no_new_user_namespaces(workdir):
    argv = _script(workdir, f"""
        import ctypes, os, socket
        print([os.stat(f"/proc/self/ns/{{name}}").st_ino for name in {NAMESPACES!r}])
        print(socket.gethostname(), os.getsid(0) != os.getpid(), os.getsid(0))
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(int(status["CapEff"], 16), int(status["CapBnd"], 16))
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER = 0x10000000
        print(libc.unshare(CLONE_NEWUSER), ctypes.get_errno() != 0)
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    inodes, host_and_session, capabilities, user_namespace = result.stdout.decode().splitlines()
    ours = [os.stat(f"/proc/self/ns/{name}").st_ino for name in NAMESPACES]
    assert all(a != b for a, b in zip(eval(inodes), ours, strict=True)), (inodes, ours)
    # A session whose leader is inside the PID namespace (bwrap's --new-session): a session
    # led from outside it would read as 0.
    hostname, not_leader, session = host_and_session.split()
    assert (hostname, not_leader) == ("sandbox", "True") and int(session) >= 1
    assert capabilities == "0 0"
    if "--disable-userns" in sandbox._bwrap_options(os.path.realpath(sandbox._bwrap_path())):
        assert user_namespace == "-1 True"


# ---------------------------------------------------------------------------------------------
# Network and processes.


@needs_bwrap
@pytest.mark.slow
def test_the_callers_listening_socket_is_unreachable(workdir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        argv = _script(workdir, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"leak")
                print("connected")
            except OSError as error:
                print("refused", type(error).__name__)
        """)
        result = sandbox.run(argv, workdir, limits=QUICK)
        assert result.returncode == 0, result.stderr
        assert result.stdout == b"refused ConnectionRefusedError\n"
        with pytest.raises(BlockingIOError):
            server.accept()


@needs_bwrap
@pytest.mark.slow
def test_a_process_of_the_caller_cannot_be_signalled(workdir):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        argv = _script(workdir, f"""
            import os, signal
            for attempt in ("kill", "pidfd"):
                try:
                    if attempt == "kill":
                        os.kill({victim.pid}, signal.SIGTERM)
                    else:
                        signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGTERM)
                    print(attempt, "sent")
                except OSError as error:
                    print(attempt, type(error).__name__)
            print(os.path.exists("/proc/{victim.pid}"), sorted(
                int(p) for p in os.listdir("/proc") if p.isdigit()))
        """)
        result = sandbox.run(argv, workdir, limits=QUICK)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.decode().splitlines()
        assert lines[:2] == ["kill ProcessLookupError", "pidfd ProcessLookupError"]
        # Its own PID namespace: bwrap's init, the launcher, the script; nothing of ours.
        assert lines[2] == "False [1, 2, 3]"
        time.sleep(0.1)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@needs_bwrap
def test_the_command_cannot_reach_the_launchers_status_pipe(workdir):
    """The launcher (PID 2) writes the command's wait status to the grader through a pipe. A
    command of the same user could open that pipe through /proc/2/fd and write 40 nines (the
    grader then stopped with OverflowError), or ptrace the launcher to write it; the launcher
    is not dumpable, so it can do neither."""
    argv = _script(workdir, """
        import ctypes, errno, os
        try:
            for fd in os.listdir("/proc/2/fd"):
                if os.readlink(f"/proc/2/fd/{fd}").startswith("pipe:"):
                    with open(f"/proc/2/fd/{fd}", "w") as pipe:
                        pipe.write("9" * 40)
                    print("wrote to", fd)
        except OSError as error:
            print("refused", type(error).__name__)
        libc = ctypes.CDLL(None, use_errno=True)
        PTRACE_ATTACH = 16
        print("ptrace", libc.ptrace(PTRACE_ATTACH, 2, 0, 0), errno.errorcode[ctypes.get_errno()])
    """)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert (result.returncode, result.fault) == (0, None), result.stderr
    assert result.stdout == b"refused PermissionError\nptrace -1 EPERM\n"


@pytest.mark.parametrize("status", [b"9" * 40, b"4991", b"70000", b"12ab", b"-1"])
def test_a_garbled_wait_status_is_a_fault_of_the_run_not_a_crash(workdir, status):
    """Whatever reaches the status pipe (here a stand-in for the launcher writes it: 40 nines,
    a stopped process's status, more than 16 bits, no number), the run ends with bwrap's
    return code and a fault that says so."""
    read, write = os.pipe()
    command = [sys.executable, "-c", f"import os; os.write({write}, {status!r}); os._exit(3)"]
    try:
        result = sandbox._supervise(command, workdir, QUICK, [write], read, None, None,
                                    sandbox._base_env({}, []), sandboxed=True, notes=())
    finally:
        os.close(read)
    assert result.returncode == 3 and result.stderr == b""
    assert result.fault is not None and "wait status is garbled" in result.fault


def test_the_launchers_wait_status_gives_the_return_code():
    assert [sandbox._exit_code(status) for status in (b"0", b"768", b"9", b"137")] == [
        0, 3, -9, -9]


@needs_bwrap
@pytest.mark.slow
def test_a_fork_bomb_is_bounded_and_dies_with_the_run(workdir, marker):
    if sandbox.process_limit().startswith("none"):
        pytest.skip(f"nothing bounds the process count here: {sandbox.process_limit()}")
    argv = _script(workdir, """
        import os, time
        started = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
            except OSError as error:
                print("refused after", started, type(error).__name__)
                break
        print("started", started, flush=True)
    """, marker)
    start = time.monotonic()
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert time.monotonic() - start < QUICK.wall_seconds
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    started = int(lines[-1].split()[1])
    # bwrap's init, the launcher and the script count too.
    assert started <= QUICK.processes - 3
    assert lines[0].startswith("refused after") and lines[0].endswith("BlockingIOError")
    assert _survivors(marker) == []


@needs_bwrap
@pytest.mark.slow
def test_threads_count_against_the_process_limit(workdir):
    if sandbox.process_limit().startswith("none"):
        pytest.skip(f"nothing bounds the process count here: {sandbox.process_limit()}")
    argv = _script(workdir, """
        import threading, time
        started = 0
        try:
            for _ in range(100):
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                started += 1
        except RuntimeError as error:
            print("refused after", started, error)
    """)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    refused, after, started, _ = result.stdout.decode().split(" ", 3)
    # bwrap's init, the launcher and the script's main thread count too (and, in a pids
    # cgroup, bwrap itself).
    assert (refused, after) == ("refused", "after") and int(started) <= QUICK.processes - 3


@needs_bwrap
@pytest.mark.slow
def test_fork_exec_of_a_shell_has_no_effect_outside(tmp_path, workdir, marker):
    canary = tmp_path / "canary.txt"
    argv = _script(workdir, f"""
        import _posixsubprocess, subprocess
        calls = []
        real = _posixsubprocess.fork_exec
        assert subprocess._fork_exec is real  # Popen's route to it (Python 3.11 to 3.13)
        def spy(*arguments):
            calls.append(arguments[0])
            return real(*arguments)
        subprocess._fork_exec = spy
        shell = ("echo escaped > {canary}; echo ran > shell.txt; "
                 "(sleep 30; echo late > {canary}) &")
        subprocess.Popen(["/bin/sh", "-c", shell, "{marker}"]).wait()
        print(len(calls))
    """, marker)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"1\n"  # the shell was started by _posixsubprocess.fork_exec
    assert (workdir / "shell.txt").read_text() == "ran\n"
    assert str(canary).encode() in result.stderr  # the shell could not create it
    assert not canary.exists()
    assert _survivors(marker) == []


@needs_bwrap
@pytest.mark.slow
def test_a_daemon_does_not_outlive_the_run(workdir, marker):
    argv = _script(workdir, """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 30", sys.argv[1]])
            os._exit(0)
        os.wait()
        print("daemonized")
    """, marker)
    result = sandbox.run(argv, workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"daemonized\n"
    assert _survivors(marker) == []


@needs_bwrap
@pytest.mark.slow
def test_an_infinite_loop_times_out_and_everything_is_killed(workdir, marker):
    argv = _script(workdir, """
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 30", sys.argv[1]])
        print("looping", flush=True)
        while True:
            pass
    """, marker)
    limits = Limits(wall_seconds=1.0)
    start = time.monotonic()
    result = sandbox.run(argv, workdir, limits=limits)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert result.stdout == b"looping\n"  # what it printed before the kill is kept
    # The kill and the namespace's teardown take milliseconds; 3 s allows for a loaded machine.
    assert limits.wall_seconds <= elapsed < limits.wall_seconds + 3
    assert _survivors(marker) == []


@needs_bwrap
@pytest.mark.slow
def test_the_sandbox_dies_with_a_grader_killed_by_sigkill(workdir, marker):
    """A grader killed by SIGKILL runs no cleanup: bwrap's --die-with-parent ends the sandbox."""
    argv = _script(workdir, """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 30", sys.argv[1]])
        print("started", flush=True)
        time.sleep(30)
    """, marker)
    grader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(REPOSITORY)!r})
        from opd_literate.course import sandbox
        sandbox.run({argv!r}, pathlib.Path({str(workdir)!r}))
    """)], env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    try:
        # Kill it once the student's shell runs (bwrap's own command line holds the marker too,
        # and SIGKILL during bwrap's setup is another case: see the instructors page).
        deadline = time.monotonic() + 20
        while not _shell_runs(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _shell_runs(marker)
    finally:
        grader.kill()
        grader.wait()
    deadline = time.monotonic() + 5
    while _survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors(marker) == []


@needs_bwrap
@pytest.mark.slow
def test_sleeping_past_the_wall_clock_times_out(workdir):
    argv = _script(workdir, "import time\ntime.sleep(60)\n")
    result = sandbox.run(argv, workdir, limits=Limits(wall_seconds=0.5))
    assert result.timed_out and result.returncode == -signal.SIGKILL


# ---------------------------------------------------------------------------------------------
# Memory, files, CPU, output.


@needs_bwrap
@pytest.mark.slow
def test_allocating_6_gib_fails(workdir):
    assert Limits().memory_bytes < 6 * 2**30
    # np.empty only reserves address space: without the limit it would succeed without
    # touching the machine's memory, so the test cannot hurt a machine where the limit fails.
    argv = _script(workdir, """
        import numpy
        try:
            block = numpy.empty(6 * 2**30, dtype=numpy.uint8)
            print("allocated", block.nbytes)
        except MemoryError:
            print("MemoryError")
    """)
    result = sandbox.run(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"MemoryError\n"


@needs_bwrap
@pytest.mark.slow
def test_printing_400_mib_is_truncated_and_the_caller_stays_small(workdir):
    argv = _script(workdir, """
        import sys
        chunk = b"x" * 2**20
        for _ in range(400):
            sys.stdout.buffer.write(chunk)
        sys.stderr.write("done")
    """)
    limits = Limits(wall_seconds=30.0, output_bytes=2**20)
    tracemalloc.start()
    try:
        result = sandbox.run(argv, workdir, limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.returncode == 0 and result.stderr == b"done"
    assert result.truncated and result.stdout == b"x" * limits.output_bytes
    # What is kept (1 MiB), one read's chunk (64 KiB) and the joined copy: well under 8 MiB.
    assert peak < 8 * 2**20, peak


@needs_bwrap
@pytest.mark.slow
def test_a_file_larger_than_the_limit_cannot_be_written(workdir):
    limits = Limits(file_bytes=2**20)
    argv = _script(workdir, """
        try:
            with open("big.bin", "wb") as big:
                for _ in range(4):
                    big.write(b"x" * 2**20)
                    big.flush()
            print("wrote")
        except OSError as error:
            print("refused", error.errno)
    """)
    result = sandbox.run(argv, workdir, limits=limits)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"refused 27\n"  # EFBIG (Python ignores SIGXFSZ)
    assert (workdir / "big.bin").stat().st_size == limits.file_bytes


@needs_bwrap
@pytest.mark.slow
def test_cpu_seconds_are_limited(workdir):
    argv = _script(workdir, "while True:\n    pass\n")
    result = sandbox.run(argv, workdir, limits=Limits(wall_seconds=30.0, cpu_seconds=1))
    assert not result.timed_out
    assert result.returncode == -signal.SIGXCPU
    # Ignoring SIGXCPU buys one second: then the hard limit's SIGKILL.
    argv = _script(workdir, """
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True:
            pass
    """)
    result = sandbox.run(argv, workdir, limits=Limits(wall_seconds=30.0, cpu_seconds=1))
    assert not result.timed_out
    assert result.returncode == -signal.SIGKILL


@needs_bwrap
@pytest.mark.slow
def test_a_signal_is_told_from_an_exit_status(workdir):
    killed = sandbox.run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], workdir)
    exited = sandbox.run([sys.executable, "-c", "raise SystemExit(137)"], workdir)
    assert (killed.returncode, exited.returncode) == (-9, 137)


@needs_bwrap
@pytest.mark.slow
@pytest.mark.skipif(not sandbox.process_limit().startswith("pids cgroup"),
                    reason="needs a pids cgroup this process may create")
def test_the_runs_cgroup_is_removed_after_it(workdir, monkeypatch):
    created = []
    original = sandbox._Cgroup.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.extend((folder, (folder / "pids.max").read_text().strip())
                       for folder in self.folders)

    monkeypatch.setattr(sandbox._Cgroup, "__init__", recording)
    result = sandbox.run([sys.executable, "-c", "pass"], workdir, limits=QUICK)
    assert result.returncode == 0, result.stderr
    assert [(folder.exists(), limit) for folder, limit in created] == [
        (False, str(QUICK.processes))]


@needs_bwrap
@pytest.mark.slow
@pytest.mark.skipif(not sandbox.process_limit().startswith("pids cgroup"),
                    reason="needs a pids cgroup this process may create")
def test_a_killed_graders_empty_cgroup_is_removed_by_the_next_run(workdir):
    parent = sandbox._pids_cgroup_parent()
    stale, fresh = (parent / f"opd-sandbox-test-{kind}-{uuid.uuid4().hex[:8]}"
                    for kind in ("stale", "fresh"))
    try:
        stale.mkdir()
        fresh.mkdir()
        hour_ago = time.time() - 3600
        os.utime(stale, (hour_ago, hour_ago))
        result = sandbox.run([sys.executable, "-c", "pass"], workdir, limits=QUICK)
        assert result.returncode == 0, result.stderr
        # The fresh one may be a concurrent run's, made but not yet joined: it stays.
        assert (stale.exists(), fresh.exists()) == (False, True)
    finally:
        for folder in (stale, fresh):
            if folder.exists():
                folder.rmdir()


@needs_bwrap
@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="as root only")
def test_as_root_without_a_cgroup_the_notes_say_the_count_is_unbounded(workdir, monkeypatch):
    monkeypatch.setattr(sandbox, "_pids_cgroup_parent", lambda: None)
    assert sandbox.process_limit().startswith("none")
    result = sandbox.run([sys.executable, "-c", "pass"], workdir, limits=QUICK)
    assert result.returncode == 0 and result.sandboxed
    assert [note for note in result.notes if "process count not bounded" in note]


def test_nproc_leaves_room_for_the_users_processes_where_the_kernel_counts_them_all(
        monkeypatch):
    """Before Linux 5.14 (commit 21d1c5e386bc, RLIMIT_NPROC on ucounts), and outside a user
    namespace, RLIMIT_NPROC counts every process of the user: the limit adds them."""
    monkeypatch.setattr(sandbox.os, "getuid", lambda: _UNPRIVILEGED)
    monkeypatch.setattr(sandbox, "_tasks_of_user", lambda uid: 100 if uid == _UNPRIVILEGED else 0)
    monkeypatch.setattr(sandbox, "_kernel_counts_processes_per_user_namespace", lambda: True)
    assert sandbox._rlimits(QUICK, inside_user_namespace=True)["RLIMIT_NPROC"] == (16, 16)
    assert sandbox._rlimits(QUICK, inside_user_namespace=False)["RLIMIT_NPROC"] == (116, 116)
    monkeypatch.setattr(sandbox, "_kernel_counts_processes_per_user_namespace", lambda: False)
    assert sandbox._rlimits(QUICK, inside_user_namespace=True)["RLIMIT_NPROC"] == (116, 116)
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 0)
    assert "RLIMIT_NPROC" not in sandbox._rlimits(QUICK, inside_user_namespace=True)


@pytest.mark.parametrize(("release", "per_namespace"), [
    ("5.13.19-generic", False), ("5.14.0-687.12.1.el9_8", True), ("6.18.44-fc", True),
    ("4.19.0", False), ("unknown", False)])
def test_kernel_release_parsing(monkeypatch, release, per_namespace):
    monkeypatch.setattr(sandbox.platform, "release", lambda: release)
    assert sandbox._kernel_counts_processes_per_user_namespace() is per_namespace


# ---------------------------------------------------------------------------------------------
# Without bubblewrap, and the trusted mode.


def test_without_bwrap_run_refuses_and_trusted_runs(tmp_path, workdir, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    reason = sandbox.unavailable_reason()
    assert reason is not None and "bwrap" in reason
    with pytest.raises(SandboxUnavailable, match="--trusted"):
        sandbox.run([sys.executable, "-c", "print(1)"], workdir)
    result = sandbox.run([sys.executable, "-c", "print(1)"], workdir, trusted=True)
    assert result == Result(returncode=0, stdout=b"1\n", stderr=b"", timed_out=False,
                            truncated=False, sandboxed=False, notes=result.notes)
    assert any(note.startswith("trusted") for note in result.notes)


_MOUNT_ERROR = ("bwrap: Can't remount readonly on /newroot/tmp/a venv/opd_literate-0.1.0.dist-info:"
                " No such file or directory")
_NAMESPACE_ERROR = "bwrap: No permissions to creating new namespace"


@pytest.mark.parametrize(("fails", "switches", "said", "trusted_offered"), [  # None: all fail
    # bwrap works over the machine's own files, not with this sandbox's mounts: a fault of the
    # set-up, to report; running unsandboxed would hide it.
    ("--bind", [], "could not mount this sandbox's folders (" + _MOUNT_ERROR, False),
    ("--unshare-pid", [], "cannot create the sandbox's namespaces here (" + _NAMESPACE_ERROR,
     True),
    (None, ["sysctl user.max_user_namespaces = 0"], "cannot create a user namespace here ("
     + _NAMESPACE_ERROR + "): user namespaces are disabled (sysctl user.max_user_namespaces = 0)",
     True),
    (None, [], "though no kernel setting disables them", True)])
def test_a_failing_bwrap_is_diagnosed_from_smaller_sandboxes(workdir, monkeypatch, fails,
                                                            switches, said, trusted_offered):
    """The probe's sandbox fails; the namespaces alone over the machine's own files, then a user
    namespace alone, tell a failed mount from a machine that forbids namespaces (here a stand-in
    for bwrap fails every command holding the option ``fails``). Only a machine is offered the
    trusted mode, and "disabled" is said only where a kernel setting read says so."""
    def start(command, fds=()):
        if fails is not None and fails not in command:
            return None
        return _MOUNT_ERROR if fails == "--bind" else _NAMESPACE_ERROR

    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: f"/opd-test/bwrap-{uuid.uuid4().hex}")
    monkeypatch.setattr(sandbox, "_bwrap_options", lambda bwrap: frozenset())
    monkeypatch.setattr(sandbox, "_start", start)
    monkeypatch.setattr(sandbox, "_user_namespace_switches", lambda: switches)
    reason = sandbox.unavailable_reason()
    assert said in reason, reason
    assert ("disabled" in reason) == bool(switches)
    with pytest.raises(SandboxUnavailable) as refused:
        sandbox.run([sys.executable, "-c", "pass"], workdir)
    assert str(refused.value).startswith(f"cannot sandbox untrusted code: {reason}")
    assert ("trusted=True" in str(refused.value)) is trusted_offered


def test_the_kernel_settings_that_disable_user_namespaces_are_named(tmp_path, monkeypatch):
    (tmp_path / "user").mkdir()
    (tmp_path / "kernel").mkdir()
    (tmp_path / "user" / "max_user_namespaces").write_text("0\n")
    (tmp_path / "kernel" / "unprivileged_userns_clone").write_text("0\n")
    (tmp_path / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("0\n")
    # The unprivileged_userns_clone switch (Debian's) does not restrict root.
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 0)
    assert sandbox._user_namespace_switches(tmp_path) == ["sysctl user.max_user_namespaces = 0"]
    monkeypatch.setattr(sandbox.os, "getuid", lambda: _UNPRIVILEGED)
    assert sandbox._user_namespace_switches(tmp_path) == [
        "sysctl user.max_user_namespaces = 0", "sysctl kernel.unprivileged_userns_clone = 0"]
    (tmp_path / "user" / "max_user_namespaces").write_text("63000\n")
    (tmp_path / "kernel" / "unprivileged_userns_clone").write_text("1\n")
    assert sandbox._user_namespace_switches(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(24, "Too many open files"),
                                     subprocess.TimeoutExpired(["bwrap"], 30)])
def test_a_bwrap_that_could_not_be_started_is_a_passing_failure(workdir, monkeypatch, failure):
    """Too many open files, or a probe that did not finish: no property of the machine. The
    reason says to try again, offers no trusted mode, and is not remembered: once bwrap
    starts, the same process sandboxes."""
    bwrap = f"/opd-test/bwrap-{uuid.uuid4().hex}"
    real = subprocess.run
    starts, failing = [], [failure]

    def starting(command, **options):
        if command[0] != bwrap:
            return real(command, **options)
        starts.append(command)
        if failing[0] is None:
            return subprocess.CompletedProcess(command, 0, b"", b"")
        raise failing[0]

    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: bwrap)
    monkeypatch.setattr(sandbox, "_bwrap_options", lambda bwrap: frozenset())
    monkeypatch.setattr(sandbox.subprocess, "run", starting)
    reason = sandbox.unavailable_reason()
    assert reason.startswith("bwrap could not be started (") and reason.endswith("try again")
    assert len(starts) == 1  # no diagnosis from sandboxes that cannot start either
    with pytest.raises(SandboxUnavailable) as refused:
        sandbox.run([sys.executable, "-c", "pass"], workdir)
    assert str(refused.value) == f"cannot sandbox untrusted code: {reason}"  # no trusted=True
    failing[0] = None
    assert sandbox.unavailable_reason() is None


def test_a_machine_that_refuses_only_disable_userns_is_told_apart(monkeypatch):
    """In an Incus container bwrap runs, but not with ``--disable-userns``: one more sandbox
    without it says that this is what fails."""
    error = "bwrap: cannot open /proc/sys/user/max_user_namespaces: Permission denied"
    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: f"/opd-test/bwrap-{uuid.uuid4().hex}")
    monkeypatch.setattr(sandbox, "_bwrap_options", lambda bwrap: frozenset({"--disable-userns"}))
    monkeypatch.setattr(sandbox, "_start", lambda command, fds=(): error
                        if "--disable-userns" in command else None)
    reason = sandbox.unavailable_reason()
    assert reason.startswith("bwrap creates the sandbox's namespaces here, but fails with "
                             f"--disable-userns ({error})"), reason
    assert not isinstance(reason, sandbox._SetupFailure)  # the machine's: trusted is offered


@needs_bwrap
def test_a_real_bwrap_that_refuses_only_disable_userns_is_told_apart(tmp_path, monkeypatch):
    """The same with bubblewrap itself behind a stand-in that refuses the option, as bwrap
    does where it cannot set user.max_user_namespaces."""
    if "--disable-userns" not in sandbox._bwrap_options(os.path.realpath(sandbox._bwrap_path())):
        pytest.skip("this bubblewrap has no --disable-userns (it is new in 0.8.0)")
    stand_in = tmp_path / "bwrap"
    stand_in.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for option in "$@"; do
            if [ "$option" = --disable-userns ]; then
                echo "bwrap: cannot open /proc/sys/user/max_user_namespaces: Permission denied" >&2
                exit 1
            fi
        done
        exec {shlex.quote(os.path.realpath(sandbox._bwrap_path()))} "$@"
    """))
    stand_in.chmod(0o755)
    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: str(stand_in))
    reason = sandbox.unavailable_reason()
    assert reason is not None and "but fails with --disable-userns (bwrap: cannot open " \
        "/proc/sys/user/max_user_namespaces: Permission denied)" in reason, reason


@pytest.mark.slow
def test_trusted_applies_the_limits_and_scrubs_the_environment(workdir, monkeypatch):
    monkeypatch.setenv("OPD_SECRET_TOKEN", "hunter2")
    argv = _script(workdir, """
        import mmap, os
        print("OPD_SECRET_TOKEN" in os.environ, os.getcwd())
        try:
            mmap.mmap(-1, 2 * 2**30)
        except OSError as error:
            print("refused", error.errno)
    """)
    result = sandbox.run(argv, workdir, limits=Limits(memory_bytes=2**30), trusted=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"False {workdir}\nrefused 12\n".encode()  # ENOMEM


@pytest.mark.slow
def test_trusted_times_out_and_kills_its_session(workdir, marker):
    argv = _script(workdir, """
        import os, sys, time
        if os.fork() == 0:
            os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 30", sys.argv[1]])
        time.sleep(60)
    """, marker)
    result = sandbox.run(argv, workdir, limits=Limits(wall_seconds=0.5), trusted=True)
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert _survivors(marker) == []


@pytest.mark.slow
@pytest.mark.skipif(not sandbox.process_limit(trusted=True).startswith("pids cgroup"),
                    reason="needs a pids cgroup this process may create")
def test_trusted_kills_a_daemon_through_its_cgroup(workdir, marker):
    argv = _script(workdir, """
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 30", sys.argv[1]])
            os._exit(0)
        os.wait()
    """, marker)
    result = sandbox.run(argv, workdir, limits=QUICK, trusted=True)
    assert result.returncode == 0, result.stderr
    assert _survivors(marker) == []


# ---------------------------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(("field", "value", "error"), [
    ("wall_seconds", math.nan, ValueError), ("wall_seconds", math.inf, ValueError),
    ("wall_seconds", 0.0, ValueError), ("wall_seconds", "60", TypeError),
    ("cpu_seconds", 1.5, TypeError), ("processes", 0, ValueError),
    ("memory_bytes", -1, ValueError), ("output_bytes", True, TypeError),
])
def test_limits_reject_bad_values(field, value, error):
    with pytest.raises(error, match=f"Limits.{field}"):
        Limits(**{field: value})


@pytest.mark.parametrize(("argv", "error", "match"), [
    ("python -c pass", TypeError, "argv must be a list of str"),
    ([], ValueError, "argv must not be empty"),
    ([sys.executable, 1], TypeError, "argv must be a list of str"),
    (["no-such-program-opd"], ValueError, "not a program on PATH"),
])
def test_run_rejects_bad_argv(workdir, argv, error, match):
    with pytest.raises(error, match=match):
        sandbox.run(argv, workdir, trusted=True)


def test_run_rejects_bad_workdir_limits_and_env(tmp_path, workdir):
    with pytest.raises(ValueError, match="workdir must be an existing folder"):
        sandbox.run([sys.executable], tmp_path / "missing", trusted=True)
    with pytest.raises(TypeError, match="limits must be a Limits"):
        sandbox.run([sys.executable], workdir, limits={"wall_seconds": 1}, trusted=True)
    with pytest.raises(TypeError, match="env must be a dict of str to str"):
        sandbox.run([sys.executable], workdir, env={"N": 1}, trusted=True)


@pytest.mark.slow
@pytest.mark.parametrize("trusted", [False, True])
def test_a_program_that_cannot_be_executed_exits_127(workdir, trusted):
    if not trusted and _REASON is not None:
        pytest.skip(f"no sandbox here: {_REASON}")
    # A file of the Python installation (visible inside), but not executable.
    result = sandbox.run([os.__file__], workdir, trusted=trusted)
    assert result.returncode == 127
    assert result.stderr.startswith(b"sandbox: cannot run")
    assert b"Permission denied" in result.stderr


@needs_bwrap
def test_a_program_invisible_inside_is_refused(tmp_path, workdir):
    program = tmp_path / "tool"
    program.write_text("#!/bin/sh\necho hi\n")
    program.chmod(0o755)
    with pytest.raises(ValueError, match="not visible inside the sandbox"):
        sandbox.run([str(program)], workdir)


# ---------------------------------------------------------------------------------------------
# Python anywhere: a virtual environment under /tmp, in a folder with a space in its name.


def _virtual_environment(folder: pathlib.Path, *extra: pathlib.Path) -> pathlib.Path:
    """A virtual environment at ``folder`` made from this interpreter, whose ``.pth`` file
    names this interpreter's site folders and those of numpy and torch (its packages, wherever
    they are installed) and ``extra``; its ``python``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True,
                   timeout=120)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True,
                             timeout=60).stdout.strip()
    folders = [*site.getsitepackages(), *(sandbox._site_dir_of(n) for n in ("numpy", "torch")),
               *extra]
    (pathlib.Path(purelib) / "opd-test-site.pth").write_text("".join(f"{f}\n" for f in folders))
    return python


@pytest.fixture
def venv_under_tmp():
    """A virtual environment under /tmp itself (the fresh /tmp of the sandbox once hid such a
    one), in a folder whose name has a space, which can import this library as installed here
    (the grader's process imports it; the sandbox must still hide it)."""
    base = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="opd-venv-"))
    try:
        yield _virtual_environment(base / "a venv", REPOSITORY), base
    finally:
        shutil.rmtree(base)


@needs_bwrap
def test_the_sandbox_runs_from_a_virtual_environment_under_tmp(venv_under_tmp):
    python, base = venv_under_tmp
    (base / "work").mkdir()
    (base / "work" / "attack.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys, numpy
        print(sys.prefix, importlib.util.find_spec("opd_literate"))
        try:
            open({str(python.parent.parent / "canary.txt")!r}, "w")
        except OSError as error:
            print(type(error).__name__)
    """))
    driver = textwrap.dedent(f"""
        import pathlib, sys
        from opd_literate.course import sandbox
        print(sandbox.unavailable_reason())
        result = sandbox.run([sys.executable, "attack.py"], pathlib.Path({str(base / "work")!r}))
        print(result.returncode, result.stdout.decode(), result.stderr.decode())
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    completed = subprocess.run([str(python), "-c", driver], cwd=base, env=env, timeout=60,
                               capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == (f"None\n0 {python.parent.parent} None\nOSError\n \n")


@needs_bwrap
def test_an_interpreter_reached_through_a_symbolic_link_is_sandboxed(tmp_path):
    """``sys.executable`` as written goes through a link (here to the Python installation's
    folder) that no folder the sandbox shows holds: the link is made there as it is here, and
    nothing else of the folder that holds it appears."""
    if pathlib.Path(sys.prefix) not in pathlib.Path(sys.executable).parents:
        pytest.skip(f"the interpreter {sys.executable} is not in its prefix {sys.prefix}")
    prefix = pathlib.Path(sys.prefix).resolve()
    link = tmp_path / "link"
    link.symlink_to(prefix, target_is_directory=True)
    python = link / pathlib.Path(sys.executable).relative_to(sys.prefix)
    (tmp_path / "work").mkdir()
    driver = textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(REPOSITORY)!r})
        from opd_literate.course import sandbox
        print(sandbox.unavailable_reason())
        command = "import os, sys; print(sys.executable, os.listdir({str(tmp_path)!r}))"
        result = sandbox.run([sys.executable, "-c", command], pathlib.Path({str(tmp_path)!r},
                             "work"))
        print(result.returncode, result.stdout.decode().strip(), result.stderr.decode())
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    completed = subprocess.run([str(python), "-c", driver], env=env, timeout=60,
                               capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == f"None\n0 {python} ['link'] \n"


def test_a_link_in_a_place_the_sandbox_replaces_is_refused_by_name():
    """A link in /proc (or /dev, /sandbox) cannot be made as it is here: refused up front,
    naming it, rather than a failure of bwrap to execute the interpreter."""
    with pytest.raises(sandbox._Refused) as refused:
        sandbox._links_to_make(sandbox.python_roots(),
                               [("the interpreter's path", "/proc/self/exe")])
    assert str(refused.value).startswith(
        "the interpreter's path goes through a symbolic link ('/proc/self' -> ")
    assert "in /proc, which the sandbox replaces with its own" in str(refused.value)


@needs_bwrap
@pytest.mark.slow
def test_a_lab_is_graded_in_the_sandbox_from_a_virtual_environment_under_tmp(venv_under_tmp):
    """The issue's case end to end: from that environment's python, write the OPD lab, solve
    Task 1 and grade it in the sandbox (not trusted): Task 1 alone passes."""
    from opd_literate.course import labs
    from opd_literate.course.markers import strip_solutions

    python, base = venv_under_tmp
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def course(*args):
        completed = subprocess.run([str(python), "-m", "opd_literate.course", *args], cwd=base,
                                   env=env, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stdout + completed.stderr
        return completed.stdout

    course(str(base / "opd"), "--lab", "opd")
    text, _ = strip_solutions(labs.source_of("opd").read_text(), keep={1})
    (base / "opd" / "opd.py").write_text(labs.flatten_imports(text))
    report = json.loads(course("grade", str(base / "opd"), "--json", "-"))["labs"][0]
    assert [t["status"] for t in report["tasks"].values()] == [
        "passed", "not implemented", "not implemented"]
    assert (report["score"], report["trusted"]) == (1, False)


# ---------------------------------------------------------------------------------------------
# The same guarantees for a user other than root (the usual instructor's machine).

_SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None
                    or _SYSTEM_PYTHON is None, reason="needs root, setpriv and /usr/bin/python3")
def test_an_unprivileged_user_gets_the_same_sandbox():
    """Run as ``nobody`` (``setpriv``), with the system's Python (the library's own may sit in
    root's home, which nobody cannot enter): the process count is bounded by ``RLIMIT_NPROC``
    in the sandbox's user namespace there, since no pids cgroup is writable."""
    if any(not os.access(folder, os.R_OK | os.X_OK) or not folder.stat().st_mode & 0o005
           for folder in (REPOSITORY, *REPOSITORY.parents, PACKAGE)):
        pytest.skip("the repository is not readable by other users")
    # pytest's own temporary folders are private to root: nobody could not reach the workdir.
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="opd-sandbox-nobody-"))
    try:
        _run_as_nobody(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _run_as_nobody(tmp_path):
    tmp_path.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, _UNPRIVILEGED, _UNPRIVILEGED)
    canary = tmp_path / "canary.txt"
    (work / "attack.py").write_text(textwrap.dedent(f"""
        import os, time
        started = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
            except OSError:
                break
        try:
            open({str(canary)!r}, "w").write("escaped")
        except OSError as error:
            print("refused", type(error).__name__)
        print(started, os.getuid())
    """))
    driver = textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(REPOSITORY)!r})
        from opd_literate.course import sandbox
        print(sandbox.unavailable_reason())
        print(sandbox.process_limit())
        result = sandbox.run([sys.executable, "attack.py"], pathlib.Path({str(work)!r}),
                             limits=sandbox.Limits(wall_seconds=20.0, processes=16))
        print(result.returncode, result.stdout, result.stderr)
        loop = sandbox.run([sys.executable, "-c", "while True: pass"], pathlib.Path({str(work)!r}),
                           limits=sandbox.Limits(wall_seconds=1.0))
        print(loop.timed_out, loop.returncode)
    """)
    completed = subprocess.run(
        ["setpriv", f"--reuid={_UNPRIVILEGED}", f"--regid={_UNPRIVILEGED}", "--clear-groups",
         _SYSTEM_PYTHON, "-I", "-c", driver], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}, check=False)
    assert completed.returncode == 0, completed.stderr
    reason, mechanism, outcome, loop = completed.stdout.splitlines()
    if reason != "None":
        pytest.skip(f"unprivileged user namespaces are unavailable here: {reason}")
    assert mechanism.startswith(("RLIMIT_NPROC", "pids cgroup"))
    # bwrap's init, the launcher and the script are three of the 16.
    assert outcome == (f"0 b'refused FileNotFoundError\\n{16 - 3} {_UNPRIVILEGED}\\n' b''")
    assert not canary.exists()
    assert loop == "True -9"
