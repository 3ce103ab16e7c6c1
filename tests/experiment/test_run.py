"""The OPD experiment: a --quick run learns, same seed gives same numbers, the CLI is strict."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from opd_literate.experiment import _cache, cli, run, stats, train
from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.config import DEFAULT, METHODS, QUICK, eval_steps

# A configuration small enough to run the whole pipeline in well under a second: for the tests
# of the CLI's plumbing (results, interruption, the cache), not of learning.
TINY = dataclasses.replace(
    DEFAULT, seeds=2, steps=2, batch_size=8, lrs=(1e-3,), eval_every=1, eval_prompts=16,
    val_prompts=8, teacher_hidden=8, teacher_layers=1, teacher_steps=2, teacher_batch=8,
    student_hidden=8, student_layers=1, student_pretrain_steps=1, student_pretrain_batch=8)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("quick")
    mp = pytest.MonkeyPatch()
    mp.setenv("OPD_LITERATE_CACHE", str(cache_dir))
    try:
        # one process: the worker processes' path has tests of its own (same numbers, Ctrl-C)
        assert cli.main(["--quick", "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    finally:
        mp.undo()
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    """``--quick`` runs the TINY configuration; the teacher cache is a fresh folder."""
    monkeypatch.setattr(cli, "QUICK", TINY)
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.slow
def test_quick_run_writes_results_and_plots(quick_results):
    out, results = quick_results
    assert (out / "accuracy.png").stat().st_size > 1000
    assert (out / "reverse_kl.png").stat().st_size > 1000
    assert not (out / "results.partial.json").exists()  # superseded by results.json
    assert 0.9 <= results["teacher_accuracy"] <= 1.0
    assert set(results["methods"]) == set(METHODS)
    assert results["config"]["seeds"] == QUICK.seeds
    for record in results["methods"].values():
        n = len(record["samples"])
        assert n == len(eval_steps(QUICK))
        assert record["samples"][0] == 0
        for key in ("accuracy", "reverse_kl", "seconds"):  # one curve per seed
            assert len(record[key]) == QUICK.seeds, key
            assert all(len(curve) == n for curve in record[key]), key
        assert all(curve[0] == 0.0 for curve in record["seconds"])
        assert record["samples"][-1] == QUICK.steps * QUICK.batch_size


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.slow
def test_quick_run_opd_students_learn(quick_results):
    """Margins: +0.05 accuracy and -10% reverse KL against the start (means over seeds), for
    both OPD methods; full-vocabulary OPD reaches its target on every seed (the issue asks
    --quick for a headline where it does).

    Measured on this machine: opd_sampled 0.601 -> 0.780 and 0.538 -> 0.330 nats; full-vocab
    0.601 -> 0.910 and 0.538 -> 0.188. The margins leave room for other CPUs' rounding.
    """
    _, results = quick_results
    for method in ("opd_sampled", "opd_full_vocab"):
        record = results["methods"][method]
        accuracy = [_mean([c[i] for c in record["accuracy"]]) for i in (0, -1)]
        kl = [_mean([c[i] for c in record["reverse_kl"]]) for i in (0, -1)]
        assert accuracy[1] >= accuracy[0] + 0.05, method
        assert kl[1] <= 0.9 * kl[0], method
    assert stats.headline(results)["opd_full_vocab"]["reached"] == QUICK.seeds


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


def test_headline_counts_first_evaluation_at_target():
    results = {"teacher_accuracy": 1.0,
               "config": {"target_fraction": 0.9, "steps": 2, "batch_size": 10, "seeds": 1},
               "methods": {
                   "opd_full_vocab": {"samples": [0, 10, 20], "accuracy": [[0.1, 0.95, 0.99]],
                                      "reverse_kl": [[1, 0.1, 0.05]], "seconds": [[0, 1, 2]],
                                      "lr": 0.003},
                   "rl": {"samples": [0, 10, 20], "accuracy": [[0.1, 0.2, 0.3]],
                          "reverse_kl": [[1, 1, 1]], "seconds": [[0, 1, 2]], "lr": 0.001}}}
    table = stats.headline(results)
    assert table["opd_full_vocab"]["samples"]["mean"] == 10 and table["rl"]["samples"] is None
    text = stats.format_headline(results)
    assert "rl / opd_full_vocab: at least 2.0x [2.0, 2.0] (1 of 1 seeds never reach" in text


# ---------------------------------------------------------------------------------------------
# The command line: fails fast, in one line, before any work
# ---------------------------------------------------------------------------------------------
def test_help_states_the_real_defaults(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert stopped.value.code == 0
    steps = re.search(r"--steps STEPS .*?\(default (\d+), with --quick (\d+)\)", text)
    assert (int(steps[1]), int(steps[2])) == (DEFAULT.steps, QUICK.steps)
    seed = re.search(r"--seed SEED random seed \(default (\d+)\)", text)
    assert int(seed[1]) == DEFAULT.seed
    seeds = re.search(r"--seeds SEEDS .*?\(default (\d+), with --quick (\d+)\)", text)
    assert (int(seeds[1]), int(seeds[2])) == (DEFAULT.seeds, QUICK.seeds)


@pytest.mark.slow
def test_the_module_command_refuses_a_repeated_method():
    """``python -m opd_literate.experiment``, as a user types it: rc 2, one line, no traceback."""
    result = subprocess.run([sys.executable, "-m", "opd_literate.experiment", "--methods", "rl,rl",
                             "--out", "/nonexistent-never-written"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("opd-experiment: error: argument --methods: method rl given more "
                             "than once (each method is run once)\n")


@pytest.fixture
def no_training(monkeypatch):
    """Any training at all fails the test: the CLI must refuse before it starts."""
    def fail(*args, **kwargs):
        pytest.fail("the CLI started training before checking its arguments")
    monkeypatch.setattr(cli, "run_experiment", fail)
    monkeypatch.setattr(run, "prepare", fail)


def _bad_out_cases(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["--steps", "-3"], "expected a positive integer, got -3"),
        (["--seeds", "0"], "argument --seeds: expected a positive integer, got 0"),
        (["--workers", "0"], "argument --workers: expected a positive integer, got 0"),
        (["--quick", "--long"], "--quick and --long are two configurations; choose one"),
        (["--methods", "opd_sampled,dpo"], "unknown method 'dpo'"),
        (["--methods", "opd_sampled,rl,opd_sampled"], "method opd_sampled given more than once"),
        (["--out", str(a_file)], f"--out {str(a_file)!r} exists and is not a folder"),
        (["--out", str(a_file / "sub")], f"--out {str(a_file / 'sub')!r} cannot be created: "),
    ]
    if sys.platform.startswith("linux"):  # /proc refuses new entries, even to root
        cases += [(["--out", "/proc/x"], "--out '/proc/x' cannot be created: "),
                  (["--out", "/proc"], "--out '/proc' is not writable: ")]
    return cases


def test_bad_arguments_exit_2_with_one_line_before_any_work(capsys, tmp_path, no_training):
    for args, fragment in _bad_out_cases(tmp_path):
        with pytest.raises(SystemExit) as stopped:
            cli.main(args)
        err = capsys.readouterr().err
        assert stopped.value.code == 2, args
        assert err.count("\n") == 1 and fragment in err, (args, err)


def test_duplicate_methods_are_refused_by_the_library_too(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "prepare", lambda *a: pytest.fail("prepared before checking"))
    with pytest.raises(ValueError, match="distinct names"):
        run.run_experiment(TINY, ["rl", "rl"])
    for workers in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"workers must be a positive integer, got "
                                             f"{re.escape(repr(workers))}"):
            run.run_experiment(TINY, ["rl"], workers=workers)


def test_out_is_created_and_written(tiny_cli, capsys):
    out = tiny_cli / "new" / "nested"
    assert cli.main(["--quick", "--out", str(out), "--no-progress", "--methods", "rl"]) == 0
    assert set(json.loads((out / "results.json").read_text())["methods"]) == {"rl"}
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.png", "results.json",
                                                     "reverse_kl.png"]


# ---------------------------------------------------------------------------------------------
# Ctrl-C: one line saying what was kept, exit code 130
# ---------------------------------------------------------------------------------------------
def test_ctrl_c_keeps_finished_methods_and_exits_130(tiny_cli, monkeypatch, capsys):
    real_train_one = run.train_method

    def train_one(method, *args):
        if method == "sft":  # the third method: the user presses Ctrl-C during it
            raise KeyboardInterrupt
        return real_train_one(method, *args)

    monkeypatch.setattr(run, "train_method", train_one)
    out = tiny_cli / "out"
    # one worker: the methods train in this process, where the patch applies
    assert cli.main(["--quick", "--workers", "1", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("opd-experiment: interrupted; kept: ")
    assert f"teacher cache {run.teacher_cache_path(TINY)}" in err
    partial = out / "results.partial.json"
    assert f"finished methods opd_sampled, opd_full_vocab in {partial}" in err
    kept = json.loads(partial.read_text())
    assert list(kept["methods"]) == ["opd_sampled", "opd_full_vocab"]
    assert not (out / "results.json").exists()


def test_ctrl_c_before_any_method_says_nothing_was_finished(tiny_cli, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_supervised", interrupted)  # during the teacher's training
    assert cli.main(["--quick", "--out", str(tiny_cli / "out"), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err == "opd-experiment: interrupted; kept: no teacher cache; no finished method\n"
    assert not run.teacher_cache_path(TINY).exists()


def _sigint_as_in_a_terminal():
    """In the child, before it starts: SIGINT back to its default. A job that a shell starts in
    the background ignores SIGINT, and its children inherit that; these tests stand for a
    foreground process, which the user's Ctrl-C reaches."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_sigint_in_a_real_process_exits_130_with_one_line(tmp_path):
    """The signal itself, in a child process: it interrupts itself during the second method."""
    code = f"""
import os, signal, sys
from opd_literate.experiment import cli, run
from opd_literate.experiment.config import ExperimentConfig
cli.QUICK = {TINY!r}
real = run.train_method
def train_one(method, *args):
    if method == "opd_full_vocab":
        os.kill(os.getpid(), signal.SIGINT)
    return real(method, *args)
run.train_method = train_one
sys.exit(cli.main(["--quick", "--workers", "1", "--out", {str(tmp_path / "out")!r},
                   "--no-progress"]))
"""
    env = dict(os.environ, OPD_LITERATE_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env, preexec_fn=_sigint_as_in_a_terminal)
    assert result.returncode == 130, result.stderr
    assert result.stderr.count("\n") == 1
    assert "interrupted; kept: teacher cache " in result.stderr
    assert "finished methods opd_sampled in " in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("stop", ["ctrl-c", "kill"])
def test_stopping_the_cli_with_worker_processes_leaves_no_worker(tmp_path, stop):
    """While two worker processes train: Ctrl-C, sent as a terminal sends it, to the process
    group (the workers ignore it: no traceback from them), or ``kill``, SIGTERM to the parent
    alone. The parent stops the workers, keeps the methods finished, and exits 130 or 143 with
    one line."""
    send = ("os.killpg(os.getpgrp(), signal.SIGINT)" if stop == "ctrl-c"
            else "os.kill(os.getpid(), signal.SIGTERM)")
    token = f"opd-literate-test-{os.getpid()}-{id(tmp_path)}"
    # long enough that three methods are still to finish when the first has
    slow = dataclasses.replace(TINY, steps=150, eval_every=50)
    code = f"""
import os, signal, sys
from opd_literate.experiment import cli, run
from opd_literate.experiment.config import ExperimentConfig
cli.QUICK = {slow!r}
real = run.train_in_workers
def train_in_workers(*args):
    for finished in real(*args):
        yield finished
        {send}  # after the first method, the others still running
run.train_in_workers = train_in_workers
sys.exit(cli.main(["--quick", "--workers", "2", "--out", {str(tmp_path / "out")!r},
                   "--no-progress"]))
"""
    env = dict(os.environ, OPD_LITERATE_CACHE=str(tmp_path / "cache"), OPD_TEST_TOKEN=token)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env, preexec_fn=_sigint_as_in_a_terminal,
                            start_new_session=True)
    assert result.returncode == {"ctrl-c": 130, "kill": 143}[stop], result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    what = {"ctrl-c": "interrupted", "kill": r"terminated \(SIGTERM\)"}[stop]
    assert re.search(rf"^opd-experiment: {what}; kept: teacher cache .*; finished methods "
                     r"[a-z_]+ in ", result.stderr), result.stderr
    survivors = []
    for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
        try:
            if token.encode() in environ.read_bytes():
                survivors.append(environ.parent.name)
        except OSError:  # gone, or not ours to read
            pass
    assert survivors == [], f"worker processes outlived the run: {survivors}"


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


@pytest.mark.slow
def test_a_method_that_fails_in_a_worker_exits_1_with_its_traceback(tiny_cli, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(cli, "QUICK", dataclasses.replace(TINY, lrs=("not a number",)))
    code = cli.main(["--quick", "--workers", "2", "--out", str(tiny_cli / "out"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    first, *rest = err.splitlines()
    assert re.fullmatch(r"opd-experiment: error: training [a-z_]+ failed in its worker process "
                        r"\(its traceback below\); kept: teacher cache .*; no finished method",
                        first), first
    assert rest[0] == "  Traceback (most recent call last):" and "BatchedAdam" in err


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


# ---------------------------------------------------------------------------------------------
# The teacher cache: atomic, verified, locked
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def data():
    train_pairs, _ = run._split(TINY)
    return train_pairs, lm.answer_tokens(train_pairs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))


def _leftovers(folder):
    """Files in the cache folder other than the cache files and their locks."""
    return [p.name for p in folder.iterdir() if not p.name.endswith((".pt", ".pt.lock"))]


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_damaged_cache_file_is_reported_in_one_line_and_rebuilt(cache, data, capsys, damage):
    first, loaded = run.train_teacher(TINY, *data)
    assert not loaded
    path = run.teacher_cache_path(TINY)
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":  # the same length, one byte of the weights changed
        flipped = bytearray(blob)
        flipped[len(blob) - 600] ^= 0x40
        path.write_bytes(bytes(flipped))
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint")
    else:
        path.write_bytes(b"")
    capsys.readouterr()
    second, loaded = run.train_teacher(TINY, *data)
    err = capsys.readouterr().err
    assert not loaded and err.count("\n") == 1
    assert err.startswith(f"opd-experiment: warning: teacher cache {path} is unusable (")
    assert _same_weights(first, second)  # retrained to the same weights...
    third, loaded = run.train_teacher(TINY, *data)  # ...and the file is whole again
    assert loaded and capsys.readouterr().err == "" and _same_weights(first, third)
    assert _leftovers(cache) == []


def test_refresh_rewrites_a_corrupt_cache_without_reading_it(cache, data, capsys):
    path = run.teacher_cache_path(TINY)
    cache.mkdir()
    path.write_bytes(b"corrupt")
    _, loaded = run.train_teacher(TINY, *data, cache="refresh")
    assert not loaded and capsys.readouterr().err == ""
    _, loaded = run.train_teacher(TINY, *data)
    assert loaded and capsys.readouterr().err == ""


def test_no_cache_flag_repairs_a_corrupt_cache(tiny_cli, capsys):
    path = run.teacher_cache_path(TINY)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"corrupt")
    args = ["--quick", "--no-cache", "--out", str(tiny_cli / "out"), "--no-progress",
            "--methods", "rl"]
    assert cli.main(args) == 0
    assert capsys.readouterr().err == ""  # not read, so no warning
    assert json.loads((tiny_cli / "out" / "results.json").read_text())["teacher_cached"] is False
    assert _cache.load_verified(path, lm.TinyLM(TINY.teacher_hidden, TINY.teacher_layers)) is None


def test_cache_off_touches_no_file(cache, data):
    _, loaded = run.train_teacher(TINY, *data, cache="off")
    assert not loaded and not cache.exists()
    with pytest.raises(ValueError, match="cache must be one of read, refresh, off"):
        run.train_teacher(TINY, *data, cache=False)


def test_an_interrupted_write_leaves_neither_a_partial_cache_nor_a_temporary(cache, data,
                                                                             monkeypatch):
    def save_half_then_stop(obj, path):
        pathlib.Path(path).write_bytes(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_half_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run.train_teacher(TINY, *data)
    assert not run.teacher_cache_path(TINY).exists() and _leftovers(cache) == []


def test_two_concurrent_runs_train_the_teacher_once(cache, data, monkeypatch):
    """Two threads ask for the same teacher at once: the lock lets one train while the other
    waits, then loads the file. Without it both would find no file and both would train."""
    import threading
    import time

    real_supervised, trainings = run._supervised, []

    def slow_supervised(*args, **kwargs):
        trainings.append(threading.get_ident())
        time.sleep(0.3)  # long enough for the other thread to reach the cache
        return real_supervised(*args, **kwargs)

    monkeypatch.setattr(run, "_supervised", slow_supervised)
    start, outcomes = threading.Barrier(2), []

    def worker():
        start.wait()
        outcomes.append(run.train_teacher(TINY, *data))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(trainings) == 1
    assert sorted(loaded for _, loaded in outcomes) == [False, True]
    assert _same_weights(outcomes[0][0], outcomes[1][0])
    assert _leftovers(cache) == []


def test_every_method_uses_batch_size_samples_and_rl_the_first_prompts_group_times(
        monkeypatch):
    """docs/experiment.md: "RL answers the first 16 of them, 4 times each, so that it too uses
    64 samples a step"; the OPD methods answer every prompt once. Checked at 8 prompts, group
    4: RL must see prompts 0, 0, 0, 0, 1, 1, 1, 1."""
    config = dataclasses.replace(TINY, batch_size=8, group=4)
    pairs = torch.tensor([[10 * i + 1, 2 * i] for i in range(8)])
    seen = []
    real_rollout = lm.rollout

    def rollout(model, prompts, generator=None, greedy=False):
        seen.append(prompts.clone())
        return real_rollout(model, prompts, generator, greedy)

    monkeypatch.setattr(lm, "rollout", rollout)
    torch.manual_seed(0)
    student, teacher = lm.TinyLM(8, 1), lm.TinyLM(8, 1)
    generator = torch.Generator().manual_seed(0)
    for method in METHODS:
        seen.clear()
        _, used = train._method_loss(method, student, teacher, pairs, config, generator)
        assert used == 8, method
        if method == "rl":
            expected = [pairs[0]] * 4 + [pairs[1]] * 4
            assert seen[0].tolist() == lm.make_prompts(torch.stack(expected)).tolist()
        elif method != "sft":
            assert seen[0].tolist() == lm.make_prompts(pairs).tolist()
    # The batched form: each model of an ensemble gets its own batch, treated the same way.
    ensemble = lm.EnsembleLM.from_models([student, lm.TinyLM(8, 1)])
    batched = torch.stack([pairs, pairs.flip(0)])  # (M, B, 2)
    seen.clear()
    _, used = train._method_loss("rl", ensemble, teacher, batched, config, generator)
    firsts = [[pairs[0]] * 4 + [pairs[1]] * 4, [pairs[7]] * 4 + [pairs[6]] * 4]
    assert used == 8 and seen[0].tolist() == lm.make_prompts(
        torch.stack([torch.stack(f) for f in firsts])).tolist()


def test_ctrl_c_while_plotting_names_the_results_file(tiny_cli, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_plots", interrupted)
    out = tiny_cli / "out"
    assert cli.main(["--quick", "--out", str(out), "--no-progress", "--methods", "rl"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.endswith(f"; every method in {out / 'results.json'} (the plots were not "
                        "written)\n")
    assert list(json.loads((out / "results.json").read_text())["methods"]) == ["rl"]


def test_gradient_agreement_flag_writes_the_table_with_its_settings(tiny_cli, monkeypatch):
    import functools

    small = functools.partial(run.gradient_agreement_record, batch_sizes=(4, 8), reference=64,
                              repeats=2)
    monkeypatch.setattr(cli, "gradient_agreement_record", small)
    out = tiny_cli / "ga"
    assert cli.main(["--quick", "--gradient-agreement", "--out", str(out)]) == 0
    record = json.loads((out / "gradient_agreement.json").read_text())
    assert record["config"] == {k: getattr(TINY, k) for k in run.GRADIENT_KEYS}
    assert (record["batch_sizes"], record["reference"], record["repeats"]) == ([4, 8], 64, 2)
    assert sorted(p.name for p in out.iterdir()) == ["gradient_agreement.json"]  # no training
    for method in ("opd_sampled", "opd_full_vocab"):
        cosines = [record["cosine"][method][str(B)] for B in record["batch_sizes"]]
        assert all(-1 <= c <= 1 for c in cosines), method
