"""The experiment's figures: accuracy and reverse KL against student samples, with bands.

matplotlib is imported inside [opd_literate.experiment.plots.write_plots][] (through
``opd_literate._figures``, the project's one figure style), so that a run without plots, and the
tests, never load it.
"""

from __future__ import annotations

import pathlib

from .._figures import new_figure, svg_bytes
from .stats import bootstrap_interval

__all__ = ["write_plots", "write_mismatch_plot"]


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


def write_mismatch_plot(results, path):
    """The training study under the mismatch
    ([opd_literate.experiment.mismatch_training][]), one column a method: the trainer's greedy
    accuracy with each sampler and no correction (top), with ``int4`` and each of verl's presets
    (second row), with ``int4`` and each other correction (third: the conditions whose name
    has no ``decoupled_``, the OPD reward's bug among them), each the mean over seeds with its
    95% bootstrap band, and the mean over seeds of the per-token KL between sampler and trainer
    over training (bottom). SVG or PNG by the suffix of ``path``; returns ``path``.
    """
    path = pathlib.Path(path)
    if path.suffix not in (".png", ".svg"):
        raise ValueError(f"path must end in .png or .svg, got {str(path)!r}")
    methods = results["methods"]
    fig, axes = new_figure(4, len(methods), height=14.0, sharex=True)
    config = results["config"]
    levels = [f"{level} none" for level in config["levels"]]
    worst = f"{config['correction_level']} none"
    names = list(dict.fromkeys(n for runs in methods.values() for n in runs["conditions"]))
    # one colour a condition in every panel: the reference grey, the levels, then the rest
    palette = ["C0", "C2", "C3", "C1", "C4", "C5", "C6", "C8", "C9", "#b8860b", "#000080",
               "#8b0000", "C7"]
    colors = {levels[0]: "0.35"}
    for name in names:
        colors.setdefault(name, palette[(len(colors) - 1) % len(palette)])
    for column, (method, runs) in enumerate(methods.items()):
        x = [n / 1000 for n in runs["samples"]]
        others = [n for n in runs["conditions"] if n not in levels]
        verl = [levels[0], worst] + [n for n in others if "decoupled_" in n]
        peers = [levels[0], worst] + [n for n in others if "decoupled_" not in n]
        # the corrections' long names: one column, where the curves leave room
        small = dict(loc="best", ncol=1, framealpha=0.85)
        for row, shown, where in ((0, levels, dict(loc="lower right", ncol=2)),
                                  (1, verl, small), (2, peers, small)):
            ax = axes[row][column]
            for name in dict.fromkeys(shown):
                mean, low, high = _band(runs[name]["accuracy"])
                ax.plot(x, mean, color=colors[name], label=_short(name))
                ax.fill_between(x, low, high, color=colors[name], alpha=0.15, linewidth=0)
            ax.set_ylabel("greedy accuracy")
            ax.legend(**where, handlelength=1.2, columnspacing=0.8)
        axes[0][column].set_title(f"{method}, no correction")
        axes[1][column].set_title(f"{method}, {worst.split()[0]}: verl's")
        axes[2][column].set_title(f"{method}, {worst.split()[0]}: others'")
        ax = axes[3][column]
        for name in [*levels[1:], *[n for n in runs["conditions"] if "geo_rs" in n]]:
            curves = [seed[1:] for seed in runs[name]["mismatch_kl"]]  # None at step 0
            ax.plot(x[1:], [sum(c) / len(c) for c in zip(*curves)], color=colors[name],
                    label=_short(name))
        ax.set(yscale="log", ylabel="KL(sampler || trainer)", xlabel="samples (thousands)",
               title=f"{method}, the mismatch")
        ax.legend(loc="center right", handlelength=1.2)
    fig.tight_layout()
    if path.suffix == ".svg":
        path.write_bytes(svg_bytes(fig))
    else:
        fig.savefig(path, dpi=110, facecolor="white", metadata={"Software": None})
        _close(fig)
    return path


def _short(name):
    """A condition's legend: its sampler, or the correction's name without verl's prefix."""
    sampler, _, rest = name.partition(" ")
    if rest == "none":
        return sampler
    return rest.replace("decoupled_", "").replace("none, sampler reward", "sampler reward")


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)
