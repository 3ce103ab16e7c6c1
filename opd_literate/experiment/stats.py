r"""The study's statistics: percentile-bootstrap intervals over seeds, the headline, the ratios.

Pure functions of a ``results.json`` dictionary (as [opd_literate.experiment.run.run_experiment][]
returns it, or as read back from the file): nothing here trains, prints or plots, so the docs
build computes its tables from the committed results with these same functions.
"""

from __future__ import annotations

import math

import numpy as np

from .._numerics import check_finite_number, check_real_array

__all__ = ["BOOTSTRAP", "bootstrap_interval", "headline", "ratios", "format_headline",
           "first_index"]


BOOTSTRAP = 10_000
"""Resamples of the percentile bootstrap over seeds."""


def bootstrap_interval(values, level=0.95, resamples=BOOTSTRAP, seed=0):
    r"""Percentile bootstrap interval of the mean of ``values`` (one per seed).

    Draws ``resamples`` samples of the seeds with replacement, computes the mean of each, and
    returns the $(1 - \text{level})/2$ and $(1 + \text{level})/2$ quantiles of those means.
    With few seeds the interval is narrow-biased: it cannot reach beyond the observed values
    (an endpoint that the rounding of a mean puts an ulp outside them is clipped back to them).

    Parameters
    ----------
    values : sequence of float
        One finite number per seed, at least one.
    level : float
        In (0, 1).
    resamples : int
        At least 1.
    seed : int
        The seed of numpy's generator, >= 0.

    Examples
    --------
    >>> bootstrap_interval([2.0, 2.0, 2.0])
    (2.0, 2.0)
    >>> low, high = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> 1.0 <= low < 3.0 < high <= 5.0
    True
    """
    x = _check_per_seed("values", values)
    level, resamples, seed = _check_bootstrap(level, resamples, seed)
    return _bootstrap_interval(x, level, resamples, seed)


def _bootstrap_interval(x, level=0.95, resamples=BOOTSTRAP, seed=0):
    """bootstrap_interval of a checked float64 array."""
    means = _resampled_means(x, np.random.default_rng(seed), resamples)
    low, high = _percentile_interval(means, level)
    return float(np.clip(low, x.min(), x.max())), float(np.clip(high, x.min(), x.max()))


def _check_per_seed(name, values):
    """One finite number per seed, at least one: a float64 array."""
    return check_real_array(name, values, 1, min_size=1)


def _check_bootstrap(level, resamples, seed):
    level = check_finite_number("level", level, positive=True)
    if not level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    for name, value, low in (("resamples", resamples, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return level, int(resamples), int(seed)


def _resampled_means(values, rng, resamples):
    """The means of ``resamples`` draws of the seeds' values, with replacement: (resamples,)."""
    x = np.asarray(values, dtype=float)
    draws = x[rng.integers(0, len(x), (resamples, len(x)))]
    with np.errstate(over="ignore"):
        means = draws.mean(axis=1)
    if not np.isfinite(means).all():
        # The sum of finite values near float64's largest can overflow where their mean does
        # not: divide by a power of two (exact) before summing, multiply back after.
        exponent = np.frexp(np.abs(x).max())[1]
        means = np.ldexp(np.ldexp(draws, -exponent).mean(axis=1), exponent)
    return means


def _percentile_interval(draws, level):
    alpha = (1 - level) / 2
    return float(np.quantile(draws, alpha)), float(np.quantile(draws, 1 - alpha))


def _ratio_interval(numerator, denominator, level=0.95, resamples=BOOTSTRAP, seed=0):
    """Percentile bootstrap of mean(numerator) / mean(denominator), seeds resampled
    independently for the two methods."""
    rng = np.random.default_rng(seed)
    # The numerator's draws first, then the denominator's, from one generator.
    numerator_means = _resampled_means(numerator, rng, resamples)
    return _percentile_interval(numerator_means / _resampled_means(denominator, rng, resamples),
                                level)


def headline(results):
    """Per method: samples and seconds to first reach ``target_fraction`` of the teacher (on
    the test prompts), final accuracy and reverse KL, each as a mean over seeds with its 95%
    percentile bootstrap interval.

    Returns ``{method: {"lr", "reached" (seeds that reach the target), "seeds", "samples",
    "seconds", "final_accuracy", "final_reverse_kl", "initial_accuracy",
    "initial_reverse_kl"}}``; each statistic is ``{"mean", "low", "high", "per_seed"}``.
    ``samples`` and ``seconds`` are None when some seed never reaches the target; their
    ``per_seed`` lists hold None for those seeds.

    ``results`` is checked first: ``config`` with ``target_fraction`` in (0, 1], positive
    integers ``steps``, ``batch_size`` and ``seeds``; ``teacher_accuracy`` in [0, 1]; each
    method's ``samples`` (one per evaluation, at least one), ``accuracy`` (in [0, 1]),
    ``reverse_kl`` and ``seconds`` (>= 0), one finite number per seed and evaluation, and
    ``lr`` a positive number or absent. Anything else is a ``ValueError`` or ``TypeError``
    naming the entry.
    """
    _check_results(results)
    return _headline(results)


def _headline(results):
    """headline of a checked record."""
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    table = {}

    def stat(values):
        if any(v is None for v in values):
            return None
        low, high = _bootstrap_interval(np.asarray(values, dtype=float))
        return dict(mean=sum(values) / len(values), low=low, high=high, per_seed=list(values))

    for method, record in results["methods"].items():
        hits = [_first_index(acc, target) for acc in record["accuracy"]]
        samples = [None if i is None else record["samples"][i] for i in hits]
        seconds = [None if i is None else record["seconds"][s][i] for s, i in enumerate(hits)]
        row = dict(lr=record.get("lr"), seeds=len(hits),
                   reached=sum(i is not None for i in hits))
        row["samples"], row["seconds"] = stat(samples), stat(seconds)
        row["samples_per_seed"] = samples
        for key, name, index in (("accuracy", "final_accuracy", -1),
                                 ("reverse_kl", "final_reverse_kl", -1),
                                 ("accuracy", "initial_accuracy", 0),
                                 ("reverse_kl", "initial_reverse_kl", 0)):
            row[name] = stat([curve[index] for curve in record[key]])
        table[method] = row
    return table


def _check_results(results):
    """Raise unless ``results`` is a record headline can read (see there)."""
    keys = ("config", "teacher_accuracy", "methods")
    if not isinstance(results, dict) or any(k not in results for k in keys):
        raise ValueError(f"results must be a results.json record (keys {', '.join(keys)}), got "
                         f"{sorted(results) if isinstance(results, dict) else type(results)}")
    config, methods = results["config"], results["methods"]
    if not isinstance(config, dict) or not isinstance(methods, dict):
        raise TypeError("results['config'] and results['methods'] must be dicts")
    for key in ("target_fraction", "steps", "batch_size", "seeds"):
        if key not in config:
            raise ValueError(f"results['config'] must have {key!r}")
    fraction = check_finite_number("config['target_fraction']", config["target_fraction"],
                                   positive=True)
    if fraction > 1:
        raise ValueError(f"config['target_fraction'] must be in (0, 1], got {fraction!r}")
    for key in ("steps", "batch_size", "seeds"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config[{key!r}] must be a positive integer, got {value!r}")
    check_finite_number("teacher_accuracy", results["teacher_accuracy"], low=0.0, high=1.0)
    for method, record in methods.items():
        where = f"methods[{method!r}]"
        missing = [k for k in ("samples", "accuracy", "reverse_kl", "seconds") if k not in record]
        if missing:
            raise ValueError(f"{where} must have {', '.join(map(repr, missing))}")
        samples = check_real_array(f"{where}['samples']", record["samples"], 1, min_size=1)
        shape = None
        for key, low, high in (("accuracy", 0.0, 1.0), ("reverse_kl", -math.inf, math.inf),
                               ("seconds", 0.0, math.inf)):
            curves = check_real_array(f"{where}[{key!r}]", record[key], 2, min_size=1)
            shape = curves.shape if shape is None else shape
            if curves.shape != shape or curves.shape[1] != len(samples):
                raise ValueError(f"{where}[{key!r}] must be (seeds, evaluations) = "
                                 f"{(shape[0], len(samples))}, one value per entry of samples, "
                                 f"got {curves.shape}")
            if (curves < low).any() or (curves > high).any():
                bad = float(curves[(curves < low) | (curves > high)][0])
                raise ValueError(f"{where}[{key!r}] must lie in [{low}, {high}], got {bad!r}")
        if record.get("lr") is not None:
            check_finite_number(f"{where}['lr']", record["lr"], positive=True)


def first_index(accuracy, target):
    """Index of the first evaluation with accuracy >= target, or None.

    ``accuracy`` is a 1-D sequence of finite numbers, ``target`` a finite number (a NaN would
    never reach it, silently).

    Examples
    --------
    >>> first_index([0.1, 0.5, 0.9], 0.5), first_index([0.1], 0.5)
    (1, None)
    """
    accuracy = check_real_array("accuracy", accuracy, 1)
    target = check_finite_number("target", target)
    return _first_index(accuracy, target)


def _first_index(accuracy, target):
    return next((i for i, a in enumerate(accuracy) if a >= target), None)


def ratios(results):
    """Samples to the target of RL and SFT over full-vocabulary OPD's: ``{name: dict}`` with
    ``mean`` (ratio of the means), ``low``, ``high`` (95% percentile bootstrap, seeds of the two
    methods resampled independently) and ``bound``: True when the other method misses the
    target on some seed, and the ratio is then a lower bound, the budget in place of each miss.
    No ratio (``{}``) when full-vocabulary OPD misses the target on some seed, or starts at it
    on one (0 samples): a resample of that seed alone would divide by 0.
    """
    _check_results(results)
    return _ratios(results, _headline(results))


def _ratios(results, table):
    """ratios of a checked record, from its headline table."""
    out = {}
    base = table.get("opd_full_vocab")
    if base is None or base["samples"] is None or min(base["samples"]["per_seed"]) == 0:
        return out  # no ratio to a method that never reaches the target, or starts there
    budget = results["config"]["steps"] * results["config"]["batch_size"]
    for other in ("rl", "sft", "opd_sampled"):
        if other not in table:
            continue
        per_seed = table[other]["samples_per_seed"]
        bound = any(v is None for v in per_seed)
        values = [budget if v is None else v for v in per_seed]
        mean = (sum(values) / len(values)) / base["samples"]["mean"]
        low, high = _ratio_interval(values, base["samples"]["per_seed"])
        out[other] = dict(mean=mean, low=low, high=high, bound=bound,
                          reached=table[other]["reached"], seeds=table[other]["seeds"])
    return out


def _interval_text(stat, fmt):
    return f"{fmt(stat['mean'])} [{fmt(stat['low'])}, {fmt(stat['high'])}]"


def format_headline(results):
    """The summary table as text (Markdown): means over seeds with 95% bootstrap intervals,
    and the ratios to full-vocabulary OPD (``results`` checked as by ``headline``)."""
    _check_results(results)
    table = _headline(results)
    config = results["config"]
    target = config["target_fraction"]
    budget = config["steps"] * config["batch_size"]
    lines = [f"teacher accuracy {results['teacher_accuracy']:.3f} on the test prompts; target "
             f"{target:.0%} of it = {target * results['teacher_accuracy']:.3f}; "
             f"{config['seeds']} seeds per method, budget {budget:,} student samples; mean "
             "[95% percentile bootstrap interval over seeds]", "",
             "| method | lr (chosen on validation) | seeds at target | samples to target "
             "| seconds to target | final acc. | final reverse KL |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, row in table.items():
        if row["samples"] is None:
            samples = seconds = "never" if row["reached"] == 0 else "not every seed"
        else:
            samples = _interval_text(row["samples"], lambda x: f"{x:,.0f}")
            seconds = _interval_text(row["seconds"], lambda x: f"{x:.2f}")
        lr = "-" if row["lr"] is None else f"{row['lr']:g}"
        lines.append(f"| {method} | {lr} | {row['reached']}/{row['seeds']} "
                     f"| {samples} | {seconds} "
                     f"| {_interval_text(row['final_accuracy'], lambda x: f'{x:.3f}')} "
                     f"| {_interval_text(row['final_reverse_kl'], lambda x: f'{x:.3f}')} |")
    found = _ratios(results, table)
    if found:
        lines.append("")
    for other, r in found.items():
        text = f"{r['mean']:.1f}x [{r['low']:.1f}, {r['high']:.1f}]"
        if r["bound"]:
            text = (f"at least {text} ({r['seeds'] - r['reached']} of {r['seeds']} seeds "
                    "never reach the target; each counted at the budget)")
        lines.append(f"- samples to target, {other} / opd_full_vocab: {text}")
    return "\n".join(lines)
