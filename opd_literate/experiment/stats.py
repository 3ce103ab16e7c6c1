r"""The study's statistics: percentile-bootstrap intervals over seeds, the headline, the ratios.

Pure functions of a ``results.json`` dictionary (as [opd_literate.experiment.run.run_experiment][]
returns it, or as read back from the file): nothing here trains, prints or plots, so the docs
build computes its tables from the committed results with these same functions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BOOTSTRAP", "bootstrap_interval", "headline", "ratios", "format_headline",
           "first_index"]


BOOTSTRAP = 10_000
"""Resamples of the percentile bootstrap over seeds."""


def bootstrap_interval(values, level=0.95, resamples=BOOTSTRAP, seed=0):
    r"""Percentile bootstrap interval of the mean of ``values`` (one per seed).

    Draws ``resamples`` samples of the seeds with replacement, computes the mean of each, and
    returns the $(1 - \text{level})/2$ and $(1 + \text{level})/2$ quantiles of those means.
    With few seeds the interval is narrow-biased (it cannot reach beyond the observed values).

    Examples
    --------
    >>> bootstrap_interval([2.0, 2.0, 2.0])
    (2.0, 2.0)
    >>> low, high = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> 1.0 <= low < 3.0 < high <= 5.0
    True
    """
    means = _resampled_means(values, np.random.default_rng(seed), resamples)
    return _percentile_interval(means, level)


def _resampled_means(values, rng, resamples):
    """The means of ``resamples`` draws of the seeds' values, with replacement: (resamples,)."""
    x = np.asarray(values, dtype=float)
    return x[rng.integers(0, len(x), (resamples, len(x)))].mean(axis=1)


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
    """
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    table = {}

    def stat(values):
        if any(v is None for v in values):
            return None
        low, high = bootstrap_interval(values)
        return dict(mean=sum(values) / len(values), low=low, high=high, per_seed=list(values))

    for method, record in results["methods"].items():
        hits = [first_index(acc, target) for acc in record["accuracy"]]
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


def first_index(accuracy, target):
    """Index of the first evaluation with accuracy >= target, or None."""
    return next((i for i, a in enumerate(accuracy) if a >= target), None)


def ratios(results):
    """Samples to the target of RL and SFT over full-vocabulary OPD's: ``{name: dict}`` with
    ``mean`` (ratio of the means), ``low``, ``high`` (95% percentile bootstrap, seeds of the two
    methods resampled independently) and ``bound``: True when the other method misses the
    target on some seed, and the ratio is then a lower bound, the budget in place of each miss.
    """
    table = headline(results)
    out = {}
    base = table.get("opd_full_vocab")
    if base is None or base["samples"] is None or base["samples"]["mean"] == 0:
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
    and the ratios to full-vocabulary OPD."""
    table = headline(results)
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
        lines.append(f"| {method} | {row['lr']:g} | {row['reached']}/{row['seeds']} "
                     f"| {samples} | {seconds} "
                     f"| {_interval_text(row['final_accuracy'], lambda x: f'{x:.3f}')} "
                     f"| {_interval_text(row['final_reverse_kl'], lambda x: f'{x:.3f}')} |")
    found = ratios(results)
    if found:
        lines.append("")
    for other, r in found.items():
        text = f"{r['mean']:.1f}x [{r['low']:.1f}, {r['high']:.1f}]"
        if r["bound"]:
            text = (f"at least {text} ({r['seeds'] - r['reached']} of {r['seeds']} seeds "
                    "never reach the target; each counted at the budget)")
        lines.append(f"- samples to target, {other} / opd_full_vocab: {text}")
    return "\n".join(lines)
