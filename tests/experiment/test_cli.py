"""``python -m opd_literate.experiment``: strict arguments, results written as methods finish,
Ctrl-C and SIGTERM keep what finished, one line for every error (``opd_literate.experiment.cli``).
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from opd_literate.experiment import _cache, cli, run
from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.config import DEFAULT, QUICK
from tests.experiment._tiny import TINY


@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    """``--quick`` runs the TINY configuration; the teacher cache is a fresh folder."""
    monkeypatch.setattr(cli, "QUICK", TINY)
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path / "cache"))
    return tmp_path


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
