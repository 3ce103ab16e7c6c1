"""The sandbox's bounds beyond one process: the total memory of a run (a memory cgroup), and the
trusted mode as root, which runs the command as a user of the run's own.

Each bound is played against the real kernel where this machine allows it (a memory cgroup this
process may create; root and a Python that every user may run) and skipped, with the reason,
where it does not; the refusals are checked on every machine.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

from opd_literate.course import sandbox
from opd_literate.course.sandbox import Limits, SandboxUnavailable

REPO = pathlib.Path(__file__).resolve().parents[2]
_REASON = sandbox.unavailable_reason()
needs_bwrap = pytest.mark.skipif(_REASON is not None, reason=f"no sandbox here: {_REASON}")
needs_memory_cgroup = pytest.mark.skipif(
    sandbox._memory_cgroup_parent() is None,
    reason="this process may create no memory cgroup here")
as_root = pytest.mark.skipif(os.getuid() != 0, reason="the trusted mode's own user: as root only")

# Two processes of 96 MiB each: under the 4 GiB address space a process, over 128 MiB in all.
TWO_PROCESSES = """
import os, sys
size = int(sys.argv[1]) * 2**20
pid = os.fork()
block = bytearray(size)  # bytearray writes every page: the pages are really used
for i in range(0, size, 4096):
    block[i] = 1
if pid:
    _, status = os.waitpid(pid, 0)
    print("both held", os.waitstatus_to_exitcode(status))
else:
    os._exit(0)
"""


@pytest.fixture
def workdir():
    folder = pathlib.Path(tempfile.mkdtemp(prefix="opd-bounds-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _two_processes(workdir, mib):
    (workdir / "two.py").write_text(TWO_PROCESSES)
    return [sys.executable, "two.py", str(mib)]


def test_the_total_is_checked():
    with pytest.raises(TypeError, match="Limits.memory_total_bytes must be an int or None"):
        Limits(memory_total_bytes=1.5 * 2**30)
    with pytest.raises(ValueError, match="at least 1 MiB"):
        Limits(memory_total_bytes=4096)
    assert Limits().memory_total_bytes is None


def test_a_total_bound_where_no_memory_cgroup_can_be_made_is_refused(workdir, monkeypatch):
    """Asked for and impossible here: refused before anything runs, never silently unbounded."""
    monkeypatch.setattr(sandbox, "_memory_cgroup_parent", lambda: None)
    (workdir / "ran").unlink(missing_ok=True)
    with pytest.raises(SandboxUnavailable, match="cannot bound the run's total memory"):
        sandbox.run([sys.executable, "-c", "open('ran', 'w')"], workdir, trusted=True,
                    limits=Limits(memory_total_bytes=2**28))
    assert not (workdir / "ran").exists()


@pytest.mark.slow
@needs_memory_cgroup
@pytest.mark.parametrize("trusted", [False, True])
def test_the_total_bounds_two_processes_together(workdir, trusted):
    """Two processes of 96 MiB: both run under a total of 512 MiB; under 128 MiB the kernel
    kills one of them (each alone is far below its own 4 GiB bound)."""
    if not trusted and _REASON is not None:
        pytest.skip(f"no sandbox here: {_REASON}")
    argv = _two_processes(workdir, 96)
    roomy = sandbox.run(argv, workdir, trusted=trusted,
                        limits=Limits(memory_total_bytes=512 * 2**20))
    assert (roomy.returncode, roomy.stdout) == (0, b"both held 0\n"), roomy.stderr
    tight = sandbox.run(argv, workdir, trusted=trusted,
                        limits=Limits(memory_total_bytes=128 * 2**20))
    assert tight.stdout != b"both held 0\n"
    assert tight.returncode == -9 or b"both held -9" in tight.stdout, tight


@pytest.mark.slow
@needs_memory_cgroup
def test_the_memory_cgroup_holds_the_limit_and_is_removed(workdir, monkeypatch):
    created = []
    original = sandbox._Cgroup._limit_memory

    def recording(folder, memory_bytes):
        original(folder, memory_bytes)
        name = "memory.max" if (folder / "memory.max").exists() else "memory.limit_in_bytes"
        created.append((folder, int((folder / name).read_text())))

    monkeypatch.setattr(sandbox._Cgroup, "_limit_memory", staticmethod(recording))
    result = sandbox.run([sys.executable, "-c", "pass"], workdir, trusted=True,
                         limits=Limits(memory_total_bytes=256 * 2**20))
    assert result.returncode == 0, result.stderr
    [(folder, limit)] = created
    assert limit == 256 * 2**20 and not folder.exists()


# ---------------------------------------------------------------------------------------------
# The trusted mode as root: a user of the run's own.


def test_as_another_user_the_trusted_mode_says_it_runs_as_that_user(monkeypatch):
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 65534)
    assert sandbox.run_user_problem().startswith("not running as root")


@pytest.fixture(scope="module")
def open_python():
    """A Python that every user may run: a virtual environment (no packages) of the system's
    Python in a folder every user may enter, with this checkout on its path."""
    base = shutil.which("python3", path="/usr/bin:/bin")
    if os.getuid() != 0 or base is None:
        pytest.skip("needs root and a system Python under /usr/bin")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="opd-open-python-"))
    folder.chmod(0o755)
    made = subprocess.run([base, "-m", "venv", "--without-pip", str(folder / "venv")],
                          capture_output=True, text=True)
    if made.returncode != 0:
        shutil.rmtree(folder)
        pytest.skip(f"the system Python makes no virtual environment: {made.stderr[-200:]}")
    yield folder / "venv" / "bin" / "python"
    shutil.rmtree(folder)


def _trusted_run(python, workdir, body, limits="Limits()", setup=""):
    """``sandbox.run(trusted=True)`` of ``body``, from a grader running on ``python``; returns
    the result's fields and the run's notes."""
    (workdir / "body.py").write_text(textwrap.dedent(body))
    driver = ("import json, pathlib, sys\nfrom opd_literate.course import sandbox\n"
              "from opd_literate.course.sandbox import Limits\n" + textwrap.dedent(setup) + "\n"
              + textwrap.dedent(f"""
        result = sandbox.run([sys.executable, "body.py"], pathlib.Path({str(workdir)!r}),
                             limits={limits}, trusted=True)
        print(json.dumps(dict(returncode=result.returncode, stdout=result.stdout.decode(),
                              stderr=result.stderr.decode()[-500:], notes=result.notes,
                              problem=sandbox.run_user_problem(),
                              bound=sandbox.process_limit(trusted=True))))
    """))
    ran = subprocess.run([str(python), "-c", driver], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.strip().splitlines()
    return dict(json.loads(lines[-1]), stdout_before=lines[:-1])


@pytest.mark.slow
@as_root
def test_as_root_the_command_runs_as_a_user_of_its_own(open_python, workdir):
    """Its id is no account's, it has no groups, ``workdir`` is its own, and it can neither
    read a folder of mode 0700 (Gradescope's source/ once the harness closed it) nor write a
    root folder of mode 0755 (results/)."""
    private = pathlib.Path(tempfile.mkdtemp(prefix="opd-private-"))
    (private / "reference.py").write_text("SOLUTION = 42\n")
    results = pathlib.Path(tempfile.mkdtemp(prefix="opd-results-"))
    results.chmod(0o755)
    try:
        out = _trusted_run(open_python, workdir, f"""
            import os
            print(os.getuid() == os.getgid(), os.getgroups())
            print(os.getuid() in range({sandbox._RUN_USERS.start}, {sandbox._RUN_USERS.stop}))
            open("mine.txt", "w").write("ok")
            for what, attempt in [("read", lambda: open({str(private / "reference.py")!r})),
                                  ("write", lambda: open({str(results / "r.json")!r}, "w"))]:
                try:
                    attempt()
                    print(what, "allowed")
                except PermissionError:
                    print(what, "refused")
        """)
        assert out["problem"] is None, out
        assert out["stdout"] == "True []\nTrue\nread refused\nwrite refused\n", out
        assert any(note.startswith("trusted as root: run as a user of its own")
                   for note in out["notes"])
        assert (workdir / "mine.txt").read_text() == "ok"
        assert not (results / "r.json").exists()
    finally:
        shutil.rmtree(private)
        shutil.rmtree(results)


@pytest.mark.slow
@as_root
def test_as_root_without_a_cgroup_a_daemon_dies_and_the_count_is_bounded(open_python, workdir):
    """No pids cgroup: a daemon in a session of its own is killed with the run's user, and
    RLIMIT_NPROC of that user (whose only processes are the run's) stops the 17th process."""
    marker = f"opd-daemon-{uuid.uuid4().hex}"
    out = _trusted_run(open_python, workdir, f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 60", {marker!r}])
            os._exit(0)
        os.wait()
        children = []
        try:
            for _ in range(40):
                pid = os.fork()
                if pid == 0:
                    time.sleep(5)
                    os._exit(0)
                children.append(pid)
        except BlockingIOError:
            pass
        print(len(children), flush=True)
        os._exit(0)
    """, limits="Limits(wall_seconds=20.0, processes=16)",
                       setup="sandbox._pids_cgroup_parent = lambda: None")
    assert out["bound"] == "RLIMIT_NPROC of the run's own unprivileged user"
    assert out["returncode"] == 0, out
    # 16 in all: this process, the daemon (its shell, and a sleep if the shell forks one)
    assert 12 <= int(out["stdout"]) <= 14, out
    survivors = [p for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
                 and marker.encode() in _cmdline(p)]
    assert survivors == []


def _cmdline(entry: pathlib.Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@as_root
def test_as_root_with_a_python_no_other_user_may_run_it_runs_as_root_and_says_so(workdir):
    """The interpreter in a folder of mode 0700: the check says why, and the run's note too."""
    private = pathlib.Path(tempfile.mkdtemp(prefix="opd-private-python-"))
    try:
        (private / "python").symlink_to(os.path.realpath(sys.executable))
        problem = subprocess.run(
            [str(private / "python"), "-c",
             "from opd_literate.course import sandbox; print(sandbox.run_user_problem())"],
            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert "a user without privileges cannot run" in problem.stdout, problem
    finally:
        shutil.rmtree(private)


@pytest.mark.slow
@as_root
def test_as_root_a_flea_that_forks_away_and_kills_its_users_processes_dies(open_python,
                                                                           workdir):
    """A hostile review's attack: no pids cgroup, and a process that leaves the run's session,
    then forks and exits over and over (a new PID each generation) while it sends
    ``kill(-1, SIGKILL)`` as the run's user, which would kill a killer that runs as that user.
    Stopped from outside (SIGSTOP, then SIGKILL, from root), none of it survives the run."""
    marker = f"opd-flea-{uuid.uuid4().hex}"
    out = _trusted_run(open_python, workdir, f"""
        import os, signal, sys
        if os.fork():
            os._exit(0)  # the run's own process ends at once
        os.setsid()
        argv = [sys.executable, "-c", "pass", {marker!r}]
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            if os.fork():
                os._exit(0)
    """, limits="Limits(wall_seconds=10.0, processes=16)",
                       setup="sandbox._pids_cgroup_parent = lambda: None")
    assert out["returncode"] == 0, out
    # the flea's command line is the run's: body.py, found by the file it runs in workdir
    survivors = [p for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
                 and str(workdir).encode() in _cwd(p)]
    assert survivors == []


def _cwd(entry: pathlib.Path) -> bytes:
    try:
        return os.fsencode(os.readlink(entry / "cwd"))
    except OSError:
        return b""


@pytest.mark.slow
@as_root
def test_as_root_each_run_has_a_fresh_user_and_its_shared_files_are_removed(open_python,
                                                                            workdir):
    """Two runs of one grader (a Gradescope grade's visible and hidden tests, a batch): two
    users, and what the first left in /tmp and /dev/shm is gone before the second starts."""
    name = f"opd-left-{uuid.uuid4().hex}"
    out = _trusted_run(open_python, workdir, f"""
        import os
        left = [os.path.join(d, {name!r}) for d in ("/tmp", "/dev/shm")]
        print(os.getuid(), [os.path.exists(path) for path in left], flush=True)
        for path in left:
            open(path, "w").write("x" * 4096)
    """, setup=(f"first = sandbox.run([sys.executable, 'body.py'], pathlib.Path({str(workdir)!r}), "
                "trusted=True)\nprint('FIRST', first.stdout.decode().strip())\n"))
    first = next(line for line in out["stdout_before"] if line.startswith("FIRST"))
    first_uid, first_seen = first.split(" ", 2)[1:]
    second_uid, second_seen = out["stdout"].strip().split(" ", 1)
    assert first_seen == second_seen == "[False, False]"
    assert first_uid != second_uid
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/dev/shm/{name}")
