"""The OPD experiment: a --quick run learns, same seed gives same numbers, the CLI is strict."""

import json
import subprocess
import sys

import pytest

from opd_literate import run


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("quick")
    mp = pytest.MonkeyPatch()
    mp.setenv("OPD_LITERATE_CACHE", str(cache_dir))
    try:
        assert run.main(["--quick", "--out", str(out), "--no-progress"]) == 0
    finally:
        mp.undo()
    return out, json.loads((out / "results.json").read_text())


def test_quick_run_writes_results_and_plots(quick_results):
    out, results = quick_results
    assert (out / "accuracy.png").stat().st_size > 1000
    assert (out / "reverse_kl.png").stat().st_size > 1000
    assert 0.9 <= results["teacher_accuracy"] <= 1.0
    assert set(results["methods"]) == set(run.METHODS)
    for record in results["methods"].values():
        n = len(record["samples"])
        assert n == run.QUICK["steps"] // run.QUICK["eval_every"] + 1
        assert record["samples"][0] == 0 and record["seconds"][0] == 0.0
        assert all(len(record[k]) == n for k in ("accuracy", "reverse_kl", "seconds"))
        assert record["samples"][-1] == run.QUICK["steps"] * run.QUICK["batch_size"]


def test_quick_run_opd_students_learn(quick_results):
    """Margins: +0.05 accuracy and -10% reverse KL against the start, for both OPD methods.

    Measured on this machine: opd_sampled 0.374 -> 0.472 and 0.748 -> 0.556 nats; full-vocab
    0.374 -> 0.850 and 0.748 -> 0.350. The margins leave room for other CPUs' rounding.
    """
    _, results = quick_results
    for method in ("opd_sampled", "opd_full_vocab"):
        record = results["methods"][method]
        assert record["accuracy"][-1] >= record["accuracy"][0] + 0.05, method
        assert record["reverse_kl"][-1] <= 0.9 * record["reverse_kl"][0], method


def test_same_seed_same_numbers(cache_dir, monkeypatch):
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(cache_dir))
    config = dict(run.QUICK, steps=6, eval_every=3, eval_prompts=100)
    first = run.run_experiment(config, ["opd_sampled", "rl"], progress=False)
    second = run.run_experiment(config, ["opd_sampled", "rl"], progress=False)
    for method in ("opd_sampled", "rl"):
        for key in ("samples", "accuracy", "reverse_kl"):
            assert first["methods"][method][key] == second["methods"][method][key]
    other = run.run_experiment(dict(config, seed=1), ["opd_sampled"], progress=False)
    assert other["methods"]["opd_sampled"]["reverse_kl"] != \
        first["methods"]["opd_sampled"]["reverse_kl"]


def test_headline_counts_first_evaluation_at_target():
    results = {"teacher_accuracy": 1.0, "config": {"target_fraction": 0.9},
               "methods": {
                   "opd_full_vocab": {"samples": [0, 10, 20], "accuracy": [0.1, 0.95, 0.99],
                                      "reverse_kl": [1, 0.1, 0.05], "seconds": [0, 1, 2],
                                      "lr": 0.003},
                   "rl": {"samples": [0, 10, 20], "accuracy": [0.1, 0.2, 0.3],
                          "reverse_kl": [1, 1, 1], "seconds": [0, 1, 2], "lr": 0.001}}}
    table = run.headline(results)
    assert table["opd_full_vocab"]["samples"] == 10 and table["rl"]["samples"] is None
    text = run.format_headline(results)
    assert "never reached (ratio > 2.0x)" in text


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "opd_literate.run", *args],
                          capture_output=True, text=True, timeout=60)


def test_help():
    result = _cli("--help")
    assert result.returncode == 0 and "--quick" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--steps", "-3"], "expected a positive integer, got -3"),
    (["--methods", "opd_sampled,dpo"], "unknown method 'dpo'"),
])
def test_bad_arguments_exit_2_with_one_line(args, fragment):
    result = _cli(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and fragment in result.stderr


def test_out_that_is_a_file(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("x")
    result = _cli("--out", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "is not a folder" in result.stderr
