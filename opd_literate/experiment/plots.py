"""The experiment's figures: accuracy and reverse KL against student samples, with bands.

matplotlib is imported inside [opd_literate.experiment.plots.write_plots][] (through
``opd_literate._figures``, the project's one figure style), so that a run without plots, and the
tests, never load it.
"""

from __future__ import annotations

import pathlib

from .._figures import new_figure, svg_bytes
from .stats import bootstrap_interval

__all__ = ["write_plots"]


def _band(curves):
    """Mean and 95% percentile-bootstrap band over seeds at each evaluation point."""
    columns = list(zip(*curves))
    mean = [sum(c) / len(c) for c in columns]
    bands = [bootstrap_interval(c, resamples=2000) for c in columns]
    return mean, [b[0] for b in bands], [b[1] for b in bands]


def write_plots(results, out_dir, prefix="", format="png"):
    """``accuracy.png`` and ``reverse_kl.png`` against student samples: the mean over seeds
    of each method, with its 95% bootstrap band; the target as a dashed line.

    ``format="svg"`` writes the same figures as SVG (the site's form, see ``_figures``).
    Returns the paths written.
    """
    if format not in ("png", "svg"):
        raise ValueError(f"format must be 'png' or 'svg', got {format!r}")
    paths = []
    seeds = results["config"]["seeds"]
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    for key, label, title in (
            ("accuracy", "greedy accuracy (test prompts)", "Greedy accuracy"),
            ("reverse_kl", "reverse KL per token (nats), own samples",
             "Reverse KL to the teacher")):
        fig, ax = new_figure(height=3.8)
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
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = pathlib.Path(out_dir) / f"{prefix}{key}.{format}"
        if format == "svg":
            path.write_bytes(svg_bytes(fig))
        else:
            fig.savefig(path, dpi=110, facecolor="white", metadata={"Software": None})
            _close(fig)
        paths.append(path)
    return paths


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)
