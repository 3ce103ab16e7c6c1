"""The experiment's figures: accuracy and reverse KL against student samples, with bands.

matplotlib is imported inside [opd_literate.experiment.plots.write_plots][], so that a run
without plots, and the tests, never load it.
"""

from __future__ import annotations

import pathlib

from .stats import bootstrap_interval

__all__ = ["write_plots"]


def _band(curves):
    """Mean and 95% percentile-bootstrap band over seeds at each evaluation point."""
    columns = list(zip(*curves))
    mean = [sum(c) / len(c) for c in columns]
    bands = [bootstrap_interval(c, resamples=2000) for c in columns]
    return mean, [b[0] for b in bands], [b[1] for b in bands]


def write_plots(results, out_dir, prefix=""):
    """``accuracy.png`` and ``reverse_kl.png`` against student samples: the mean over seeds
    of each method, with its 95% bootstrap band; the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    seeds = results["config"]["seeds"]
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    for key, label, title in (
            ("accuracy", "greedy accuracy (test prompts)", "Greedy accuracy"),
            ("reverse_kl", "reverse KL per token, own samples", "Reverse KL to the teacher")):
        fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
        for method, record in results["methods"].items():
            mean, low, high = _band(record[key])
            line, = ax.plot(record["samples"], mean, marker=".", label=method)
            ax.fill_between(record["samples"], low, high, color=line.get_color(), alpha=0.2)
        if key == "accuracy":
            ax.axhline(target, color="k", ls="--", lw=1,
                       label=f"target ({results['config']['target_fraction']:.0%} of teacher)")
        else:
            ax.set_yscale("log")
        ax.set_xlabel("student samples")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: mean of {seeds} seeds, 95% bootstrap band")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = pathlib.Path(out_dir) / f"{prefix}{key}.png"
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths
