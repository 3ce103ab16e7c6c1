"""The headline statistics (``opd_literate.experiment.stats``).
"""

import math

import pytest

from opd_literate.experiment import stats


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


def _results(**changes):
    """A results record of two methods, two seeds, three evaluations; ``changes`` replace
    entries, a key "method.field" one of a method's."""
    import copy

    results = {"teacher_accuracy": 1.0,
               "config": {"target_fraction": 0.9, "steps": 2, "batch_size": 10, "seeds": 2},
               "methods": {
                   "opd_full_vocab": {"samples": [0, 10, 20],
                                      "accuracy": [[0.1, 0.95, 0.99], [0.1, 0.5, 0.95]],
                                      "reverse_kl": [[1, 0.1, 0.05]] * 2,
                                      "seconds": [[0, 1, 2]] * 2, "lr": 0.003},
                   "rl": {"samples": [0, 10, 20], "accuracy": [[0.1, 0.2, 0.3]] * 2,
                          "reverse_kl": [[1, 1, 1]] * 2, "seconds": [[0, 1, 2]] * 2,
                          "lr": 0.001}}}
    results = copy.deepcopy(results)
    for key, value in changes.items():
        if "." in key:
            method, field = key.split(".")
            results["methods"][method][field] = value
        elif key in results["config"]:
            results["config"][key] = value
        else:
            results[key] = value
    return results


def test_the_interval_never_leaves_the_observed_values():
    """Three seeds of 0.1: each resample's mean is 0.30000000000000004 / 3 = 0.10000000000000002
    in float64, an ulp above every value; the interval is clipped back to (0.1, 0.1)."""
    assert sum([0.1] * 3) / 3 > 0.1
    assert stats.bootstrap_interval([0.1, 0.1, 0.1]) == (0.1, 0.1)


def test_a_zero_sample_seed_of_the_base_gives_no_ratio():
    """Full-vocabulary OPD at the target from the start on one seed: a resample of that seed
    alone would divide by 0 (an inf endpoint), so there is no ratio, as when it never gets
    there."""
    at_start = _results(**{"opd_full_vocab.accuracy": [[0.95, 0.95, 0.99], [0.1, 0.5, 0.95]]})
    assert stats.headline(at_start)["opd_full_vocab"]["samples"]["per_seed"] == [0, 20]
    assert stats.ratios(at_start) == {}
    assert "rl / opd_full_vocab" in stats.format_headline(_results())


def test_a_method_without_a_learning_rate_is_printed_with_a_dash():
    results = _results()
    del results["methods"]["rl"]["lr"]
    assert "| rl | - | 0/2 |" in stats.format_headline(results)


@pytest.mark.parametrize("call, error, message", [
    (lambda: stats.bootstrap_interval([]), ValueError, "values must have at least 1 entries"),
    (lambda: stats.bootstrap_interval([1.0, math.nan]), ValueError,
     "values must be finite, got nan at index 1"),
    (lambda: stats.bootstrap_interval([[1.0, 2.0]]), ValueError,
     r"values must have 1 dimension, got shape \(1, 2\)"),
    (lambda: stats.bootstrap_interval([1.0, None]), TypeError, "values must hold real numbers"),
    (lambda: stats.bootstrap_interval([1.0], level=1.0), ValueError,
     r"level must be in \(0, 1\), got 1.0"),
    (lambda: stats.bootstrap_interval([1.0], level=0), ValueError, "level must be > 0"),
    (lambda: stats.bootstrap_interval([1.0], level=math.nan), ValueError,
     "level must be a finite number"),
    (lambda: stats.bootstrap_interval([1.0], resamples=0), ValueError,
     "resamples must be an integer >= 1, got 0"),
    (lambda: stats.bootstrap_interval([1.0], resamples=True), ValueError,
     "resamples must be an integer >= 1, got True"),
    (lambda: stats.bootstrap_interval([1.0], seed=-1), ValueError,
     "seed must be an integer >= 0, got -1"),
    (lambda: stats.first_index([0.1, math.nan], 0.5), ValueError,
     "accuracy must be finite, got nan at index 1"),
    (lambda: stats.first_index([0.1], math.nan), ValueError, "target must be a finite number"),
    (lambda: stats.headline({}), ValueError, "results must be a results.json record"),
    (lambda: stats.headline(_results(target_fraction=0.0)), ValueError,
     r"config\['target_fraction'\] must be > 0"),
    (lambda: stats.headline(_results(target_fraction=1.5)), ValueError,
     r"config\['target_fraction'\] must be in \(0, 1\], got 1.5"),
    (lambda: stats.headline(_results(steps=0)), ValueError,
     r"config\['steps'\] must be a positive integer, got 0"),
    (lambda: stats.headline(_results(teacher_accuracy=math.nan)), ValueError,
     "teacher_accuracy must be a finite number"),
    (lambda: stats.headline(_results(**{"rl.accuracy": [[0.1, math.nan, 0.3]] * 2})),
     ValueError, r"methods\['rl'\]\['accuracy'\] must be finite, got nan at index \(0, 1\)"),
    (lambda: stats.headline(_results(**{"rl.accuracy": [[0.1, 1.5, 0.3]] * 2})), ValueError,
     r"methods\['rl'\]\['accuracy'\] must lie in \[0.0, 1.0\], got 1.5"),
    (lambda: stats.headline(_results(**{"rl.accuracy": [[0.1, 0.2]] * 2})), ValueError,
     r"methods\['rl'\]\['accuracy'\] must be \(seeds, evaluations\) = \(2, 3\), one value per "
     r"entry of samples, got \(2, 2\)"),
    (lambda: stats.headline(_results(**{"rl.seconds": [[0, 1, 2]]})), ValueError,
     r"methods\['rl'\]\['seconds'\] must be \(seeds, evaluations\) = \(2, 3\)"),
    (lambda: stats.headline(_results(**{"rl.seconds": [[0, -1, 2]] * 2})), ValueError,
     r"methods\['rl'\]\['seconds'\] must lie in \[0.0, inf\], got -1.0"),
    (lambda: stats.headline(_results(**{"rl.accuracy": [[0.1, 0.2], [0.1, 0.2, 0.3]]})),
     ValueError, r"methods\['rl'\]\['accuracy'\] must be a rectangular array"),
    (lambda: stats.headline(_results(**{"rl.lr": 0.0})), ValueError,
     r"methods\['rl'\]\['lr'\] must be > 0"),
    (lambda: stats.ratios({"methods": {}}), ValueError, "results must be a results.json record"),
    (lambda: stats.format_headline(_results(seeds=None)), ValueError,
     r"config\['seeds'\] must be a positive integer, got None"),
])
def test_every_function_names_a_malformed_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_interval_of_values_near_the_largest_float_is_finite_and_inside_them():
    """A resampled sum of values near float64's largest overflows where the mean does not: every
    draw of three values from {1.7e308, -1.7e308} has a mean in [-1.7e308, 1.7e308], and the
    mean of three copies of one value is that value (the power-of-two rescaling is exact)."""
    from opd_literate.experiment.stats import bootstrap_interval

    low, high = bootstrap_interval([1.7e308, -1.7e308, 1.7e308])
    assert -1.7e308 <= low <= high <= 1.7e308
    assert bootstrap_interval([1.7e308, 1.7e308, 1.7e308]) == (1.7e308, 1.7e308)
    low, high = bootstrap_interval([1.7e308, 1.7e308, 1.0])
    assert 1.0 <= low <= high <= 1.7e308
