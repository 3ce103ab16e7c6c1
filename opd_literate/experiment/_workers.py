"""The process pool: workers that train methods side by side, and the signals that stop them.

Process management only, apart from the science (labml keeps its workers in ``rl/game.py``):
[opd_literate.experiment.run.run_experiment][] hands it the
[opd_literate.experiment.train.Prepared][] data and the method names, and gets back each
method's runs as it finishes. Each worker is a fresh interpreter (``spawn``) that imports this
module by name, so importing it runs nothing.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback

import torch

from .train import train_method

__all__ = ["WorkerError", "Terminated", "available_cpus", "progress_bar", "sigterm_as_interrupt",
           "train_in_workers"]


def available_cpus():
    """The CPUs this process may run on: its affinity mask where the platform has one, else
    every CPU. A container's CPU quota (cgroups) is not read: where it is below this count,
    pass ``--workers``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def progress_bar(total, enabled):
    """A tqdm bar of ``total`` steps on stderr, or one that shows nothing."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="training", unit="step", file=sys.stderr)


class WorkerError(RuntimeError):
    """A worker process failed: its method raised (the message holds the worker's traceback),
    or the process died (killed, out of memory, or failed to start) before it answered."""


class _StepCounter:
    """The progress "bar" of worker ``slot``: adds its steps to its own slot of an array the
    parent sums. One writer a slot, so no lock: a worker killed mid-update (the out-of-memory
    killer does not wait) cannot leave a lock held for the parent to wait on for ever.

    It also checks, every step, that the parent is alive: a worker whose parent was killed
    (SIGKILL leaves it no time to stop its workers) exits instead of training on for nobody.
    """

    def __init__(self, steps, slot, parent_pid):
        self.steps, self.slot, self.parent_pid = steps, slot, parent_pid

    def update(self, n):
        if os.getppid() != self.parent_pid:
            os._exit(1)
        self.steps[self.slot] += n


def worker_main(connection, steps, slot, parent_pid, train=train_method):
    """A worker process: receives the ``Prepared`` data (``torch.save`` bytes), then method
    names; sends back ``(method, "ok", runs)`` for each, ``runs = train(method, prepared, bar)``,
    until it receives ``None``. An error is sent back as ``(method, "error", traceback)``. A
    closed pipe means the parent is stopping: return."""
    torch.set_num_threads(1)
    try:
        prepared = torch.load(io.BytesIO(connection.recv_bytes()), weights_only=False)
    except (EOFError, OSError):
        return
    bar = _StepCounter(steps, slot, parent_pid)
    while True:
        try:
            method = connection.recv()
        except (EOFError, OSError):
            return
        if method is None:
            return
        try:
            runs = train(method, prepared, bar)
        except Exception:
            connection.send((method, "error", traceback.format_exc()))
            return
        connection.send((method, "ok", runs))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it takes Ctrl-C's clean-up path."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises ``Terminated`` while held, so
    that ``kill`` stops the workers and keeps what Ctrl-C keeps. Signals can only be handled in
    the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(number, frame):
        raise Terminated  # the same clean-up as Ctrl-C

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if previous is not None:  # None: set from C, cannot be restored
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a worker is started: a child inherits the setting, so a worker
    ignores Ctrl-C from its first instruction and leaves it to the parent, which stops it.
    Held only for the ``start()`` call itself (the parent's Ctrl-C must not be lost)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set in the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed from C, which we cannot restore
            signal.signal(signal.SIGINT, previous)


def train_in_workers(methods, prepared, workers, bar, train=train_method):
    """Yield ``(method, runs)`` as each method finishes, trained by ``workers`` processes.

    ``train(method, prepared, bar)`` trains one method: by default
    [opd_literate.experiment.train.train_method][]; a module-level function, which a spawned
    worker imports by name.

    Each worker is a fresh interpreter (``spawn``: forking a process whose torch thread pools
    have run is unsafe) that receives its own copy of ``prepared`` through its pipe after it has
    started, and trains one method at a time, the next method waiting being sent to the first
    worker free. Nothing the parent does waits on a worker without also watching for its
    death: it waits on the workers' connections and process sentinels together, and a send to
    a dead worker fails at once; a worker that dies is a
    ``WorkerError``. However the generator ends (done, an error, Ctrl-C,
    closed early), its ``finally`` stops every worker that was started.
    """
    context = multiprocessing.get_context("spawn")
    steps = context.RawArray("q", workers)  # steps done, one slot a worker
    # The tensors travel as bytes: pickled directly, torch would hand them over as shared
    # memory through a helper thread, whose teardown on Ctrl-C prints tracebacks.
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    pool, waiting, busy, shown = [], list(methods), {}, 0  # busy: connection -> (process, method)
    completed = False
    try:
        for slot in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, daemon=True,
                                      args=(theirs, steps, slot, os.getpid(), train))
            pool.append((process, ours))
            with _sigint_ignored():
                process.start()
            theirs.close()
        for slot, (process, connection) in enumerate(pool):
            try:
                connection.send_bytes(buffer.getvalue())
            except OSError:  # it died as it started
                raise WorkerError(_died(f"worker process {slot}", process)) from None
        for process, connection in pool[: len(waiting)]:
            _assign(busy, connection, process, waiting.pop(0))
        while busy:
            ready = multiprocessing.connection.wait(
                list(busy) + [process.sentinel for process, _ in busy.values()], timeout=0.2)
            for connection in [c for c in list(busy) if c in ready]:
                process, method = busy.pop(connection)
                try:
                    _, status, runs = connection.recv()
                except (EOFError, OSError):  # it died: the pipe is closed, or reset
                    raise WorkerError(_died(f"the worker process training {method}",
                                            process)) from None
                if status == "error":
                    raise WorkerError(f"training {method} failed in its worker process "
                                      f"(its traceback below)\n{runs}")
                if waiting:
                    _assign(busy, connection, process, waiting.pop(0))
                yield method, runs
            for connection, (process, method) in busy.items():
                if process.sentinel in ready and not connection.poll():
                    raise WorkerError(_died(f"the worker process training {method}", process))
            done = sum(steps)  # every pass, the last one after the last method too
            bar.update(done - shown)
            shown = done
        for _, connection in pool:
            with contextlib.suppress(OSError):  # one that died after its last method
                connection.send(None)  # done: the workers return
        completed = True
    finally:
        # Stopped early (an error, Ctrl-C): terminate first, so that no worker sees its pipe
        # close and prints about it; done: let them return.
        started = [process for process, _ in pool if process.pid is not None]
        for process in started:
            if not completed:
                process.terminate()
        for process in started:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        for _, connection in pool:
            connection.close()


def _assign(busy, connection, process, method):
    """Send ``method`` to an idle worker and mark it busy with it."""
    busy[connection] = (process, method)
    try:
        connection.send(method)
    except OSError:  # it died after its last result: its pipe is closed
        raise WorkerError(_died(f"the worker process training {method}", process)) from None


def _died(who, process):
    process.join(timeout=5)
    return (f"{who} died (exit code {process.exitcode}) before it answered (one that dies as "
            "it starts is often a script that runs the experiment with workers > 1 outside "
            "`if __name__ == \"__main__\":`; each worker imports the script again)")
