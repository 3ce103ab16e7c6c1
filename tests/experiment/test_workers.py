"""The worker processes (``opd_literate.experiment._workers``): the same numbers for any number of
workers, a dead or failing worker reported at once, Ctrl-C stops them all, results in order.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from opd_literate.experiment import run
from tests.experiment._tiny import TINY


@pytest.mark.slow
def test_same_seed_same_numbers_with_any_number_of_workers(tmp_path, monkeypatch):
    """Twice, in this process and then in two worker processes: the same numbers, in the same
    order (each method's random streams depend on the configuration only)."""
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    config = dataclasses.replace(TINY, steps=4, eval_every=2, eval_prompts=100,
                                 student_pretrain_steps=20)
    first = run.run_experiment(config, ["opd_sampled", "rl"], progress=False)
    ignoring_sigint = []

    def check_the_workers(results):
        # Ctrl-C is the parent's to handle: each worker ignores SIGINT (bit 2 of SigIgn)
        import multiprocessing

        for child in multiprocessing.active_children():
            status = pathlib.Path(f"/proc/{child.pid}/status")
            if status.exists():
                mask = next(int(line.split()[1], 16) for line in status.read_text().splitlines()
                            if line.startswith("SigIgn:"))
                ignoring_sigint.append(bool(mask & (1 << (2 - 1))))

    second = run.run_experiment(config, ["opd_sampled", "rl"], progress=False, workers=2,
                                on_method=check_the_workers)
    if sys.platform.startswith("linux"):
        assert ignoring_sigint and all(ignoring_sigint), ignoring_sigint
    assert second["teacher_cached"] and not first["teacher_cached"]
    assert (first["run"]["workers"], second["run"]["workers"]) == (1, 2)
    assert list(second["methods"]) == list(second["lr_search"]) == ["opd_sampled", "rl"]
    assert first["lr_search"] == second["lr_search"]
    for method in ("opd_sampled", "rl"):
        for key in ("samples", "accuracy", "reverse_kl", "lr"):
            assert first["methods"][method][key] == second["methods"][method][key]
    other = run.run_experiment(dataclasses.replace(config, seed=1), ["opd_sampled"], progress=False)
    assert other["methods"]["opd_sampled"]["reverse_kl"] != \
        first["methods"]["opd_sampled"]["reverse_kl"]


def _in_a_thread(function, timeout=90):
    """``function()`` in a thread, so that a hang fails the test instead of hanging it."""
    import threading

    outcome = {}

    def target():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s: it hangs"
    return outcome


@pytest.mark.slow
def test_a_worker_that_dies_is_reported_and_the_others_stopped(tmp_path, monkeypatch):
    """SIGKILL to a worker (as the out-of-memory killer sends it) after the first method: a
    WorkerError naming the method and the exit code, not a wait for ever; the other worker,
    busy with another method, is terminated (exit code -15), not left to finish."""
    import multiprocessing
    import signal

    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    config = dataclasses.replace(TINY, steps=150, eval_every=50)
    workers = []

    def kill_a_worker(results):
        if not workers:  # the first method done (a second may finish before the death is seen)
            workers.extend(multiprocessing.active_children())
            os.kill(workers[0].pid, signal.SIGKILL)

    outcome = _in_a_thread(lambda: run.run_experiment(config, progress=False, workers=2,
                                                      on_method=kill_a_worker))
    assert isinstance(outcome.get("error"), run.WorkerError), outcome
    assert re.search(r"the worker process training [a-z_]+ died \(exit code -9\) before it "
                     r"answered", str(outcome["error"]))
    assert sorted(w.exitcode for w in workers) == [-15, -9]
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_script_without_a_main_guard_fails_with_the_hint_instead_of_hanging(tmp_path):
    """The classic spawn mistake: each worker imports the script again, runs the experiment
    at import, and dies while starting. The parent must say so, not wait for ever."""
    script = tmp_path / "no_guard.py"
    script.write_text(f"from opd_literate.experiment import run\n"
                      f"from opd_literate.experiment.config import ExperimentConfig\n"
                      f"run.run_experiment({TINY!r}, progress=False, workers=2)\n")
    env = dict(os.environ, OPD_LITERATE_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert re.search(r"opd_literate\.experiment\._workers\.WorkerError: (the )?worker process "
                     r".*died \(exit code 1\)", result.stderr), result.stderr
    assert 'outside `if __name__ == "__main__":`' in result.stderr


@pytest.mark.slow
def test_ctrl_c_in_the_parent_stops_every_worker(tmp_path, monkeypatch):
    """In the process itself (a process exit would stop daemonic workers anyway): Ctrl-C
    after the first method, while the other methods train, leaves no worker running."""
    import multiprocessing

    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    workers = []

    def interrupt(results):
        workers.extend(multiprocessing.active_children())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.run_experiment(dataclasses.replace(TINY, steps=150, eval_every=50), progress=False,
                           workers=2, on_method=interrupt)
    assert len(workers) == 2 and all(w.exitcode is not None for w in workers)
    assert multiprocessing.active_children() == []


def test_results_keep_the_requested_order_whichever_method_finishes_first(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))

    def last_first(methods, prepared, workers, bar):  # the workers, finishing in reverse order
        for method in reversed(methods):
            yield method, run.train_method(method, prepared, bar)

    monkeypatch.setattr(run, "train_in_workers", last_first)
    seen = []
    results = run.run_experiment(TINY, ["opd_sampled", "sft", "rl"], progress=False, workers=2,
                                 on_method=lambda r: seen.append(list(r["methods"])))
    assert seen == [["rl"], ["rl", "sft"], ["rl", "sft", "opd_sampled"]]  # as they finished
    assert list(results["methods"]) == list(results["lr_search"]) == ["opd_sampled", "sft", "rl"]
