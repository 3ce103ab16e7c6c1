"""How every static figure of the project is drawn: one size, one type scale, vector output.

Infrastructure, not science: the chapters compute their numbers, and the docs build (or the
experiment's command line) hands them to matplotlib through these helpers, so that every figure
of the site has the same look and reads at the size it is shown:

* **Width.** A figure is drawn at the width of the site's text column (``COLUMN_INCHES``), so the
  browser shows it at about its natural size: a 10 pt label stays about 13 px on screen, the body's
  small size, instead of shrinking with a wide figure squeezed into the column.
* **Type.** Ticks and legends at ``SMALL_PT``, labels and titles at ``LABEL_PT``.
* **Vector.** SVG with the text as text, in the reader's sans-serif font (the site loads no web
  fonts), no date and a fixed id salt, so the same figure gives the same bytes and
  ``mkdocs serve`` does not rebuild in a loop.
* **Dark mode.** The background is transparent and the lines are drawn for a light page; the
  site's stylesheet inverts the figure's lightness in the dark palette (``docs/stylesheets``).

matplotlib is imported inside the functions, so that importing the package never loads it.
"""

from __future__ import annotations

import io

__all__ = ["COLUMN_INCHES", "SMALL_PT", "LABEL_PT", "new_figure", "svg_bytes"]

COLUMN_INCHES = 7.0
"""The width of the site's text column at a 1,280 px window (about 690 px), in inches of 96 px
(the CSS inch, which an SVG's ``pt`` units follow)."""

SMALL_PT = 10.0
"""Tick labels and legends, in points: 13.3 px at the natural size."""

LABEL_PT = 11.0
"""Axis labels and titles, in points."""


def _style() -> dict:
    return {
        "font.size": SMALL_PT,
        "axes.labelsize": LABEL_PT,
        "axes.titlesize": LABEL_PT,
        "xtick.labelsize": SMALL_PT,
        "ytick.labelsize": SMALL_PT,
        "legend.fontsize": SMALL_PT,
        "legend.frameon": False,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "figure.facecolor": "none",
        "axes.facecolor": "none",
        "savefig.facecolor": "none",
        "svg.fonttype": "none",
        "svg.hashsalt": "opd-literate",
        "mathtext.fontset": "dejavusans",
        "lines.linewidth": 1.6,
    }


def new_figure(rows: int = 1, columns: int = 1, *, height: float | None = None, **kwargs):
    """``(figure, axes)`` at the column's width, with the project's style.

    ``height`` in inches defaults to 3.4 a row; other keywords go to ``plt.subplots``
    (``sharex``, ``sharey``, ...).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update(_style())
    height = 3.4 * rows if height is None else height
    return plt.subplots(rows, columns, figsize=(COLUMN_INCHES, height), **kwargs)


def svg_bytes(fig) -> bytes:
    """The figure as SVG (deterministic bytes), and the figure closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    # No bbox_inches="tight": the figures are laid out by tight_layout already, and the tight
    # box would draw each figure twice.
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return buffer.getvalue()
