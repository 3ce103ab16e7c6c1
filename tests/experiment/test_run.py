"""The study (``opd_literate.experiment.run``): a --quick run learns and writes its results; the
library refuses a repeated method.
"""

import json
import re

import pytest

from opd_literate.experiment import cli, run, stats
from opd_literate.experiment.config import METHODS, QUICK, eval_steps
from tests.experiment._tiny import TINY


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


def test_duplicate_methods_are_refused_by_the_library_too(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "prepare", lambda *a: pytest.fail("prepared before checking"))
    with pytest.raises(ValueError, match="distinct names"):
        run.run_experiment(TINY, ["rl", "rl"])
    for workers in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"workers must be a positive integer, got "
                                             f"{re.escape(repr(workers))}"):
            run.run_experiment(TINY, ["rl"], workers=workers)
