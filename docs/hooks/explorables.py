"""MkDocs hook: the explorable figures, computed by the library and drawn by plotly.js.

Each figure is a plotly figure with a slider; every position of the slider holds the numbers the
library computes for that setting (an exact sum on the toy, or the committed experiment's
curves), so the page shows exactly those numbers and nothing is interpolated in the browser.
The hook writes, into ``docs/generated/``:

* ``plotly.min.js``: the plotly.js bundle that ships inside the ``plotly`` wheel, copied once,
  so that the site works offline (nothing is fetched at view time);
* ``explore_<name>.html``: a ``<div>`` and the script that draws it, which a page includes with
  ``--8<-- "generated/explore_<name>.html"``; each loads the bundle by a path relative to its page
  (every chapter is one folder below the site's root).

``tests/site/test_explorables.py`` moves each slider to three positions in the browser and
compares the plotted numbers with the library's, recomputed in the test.
"""

from __future__ import annotations

import json
import pathlib
from html import escape

import _built  # docs/hooks/_built.py (MkDocs puts a hook's folder on sys.path)
import numpy as np

DOCS = pathlib.Path(__file__).resolve().parents[1]
OUT = DOCS / "generated"
EXPERIMENT = DOCS / "data" / "experiment" / "results.json"

# The mismatch explorer: every estimator of the chapter's catalogue (REGISTRY), at the static
# sweep's mismatches.
MISMATCH_NAMES = ("naive", "token_is", "seq_is", "token_tis", "seq_tis", "token_mis", "seq_mis",
                  "geo_rs", "icepop", "token_clamp", "cispo", "ppo_clip_bypass", "token_veto",
                  "k3_seq_rs", "geo_rs_token_tis", "gspo", "dppo_tv", "dppo_kl",
                  "trl_token_truncate", "trl_token_mask", "trl_sequence_truncate",
                  "trl_sequence_mask", "off_policy_mask", "seq_mask_tis", "kpop", "sapo", "gmpo",
                  "clip_cov", "luspo", "vespo")
MISMATCHES = tuple(float(m) for m in np.round(np.linspace(0.0, 1.5, 16), 3))
MISMATCH_START = MISMATCHES.index(0.3)  # the chapter's default toy
BATCH = 64

# The threshold explorer: truncation at C and masking above C, at a mismatch where they matter.
THRESHOLD_MISMATCH = 1.0
THRESHOLDS = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
THRESHOLD_START = THRESHOLDS.index(2.0)  # the estimators' default
THRESHOLD_NAMES = ("token_tis", "seq_tis", "token_mis", "seq_mis")

# The best-estimator map: for each mismatch and batch size, the estimator of least error.
BEST_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True,
                 "modeBarButtonsToRemove": ["select2d", "lasso2d", "toImage"]}


def mismatch_explorer_data() -> dict:
    """``{mismatch: {"rel_bias": [...], "rel_rmse": [...]}}`` for ``MISMATCH_NAMES`` (in that
    order), exact on ``make_toy(mismatch=...)`` (``mismatch_sweep``, baseline 0, N = 64)."""
    from opd_literate.mismatch.estimators import mismatch_sweep

    sweep = mismatch_sweep(list(MISMATCHES), names=list(MISMATCH_NAMES), N=BATCH)
    return {float(m): {"rel_bias": [r["rel_bias"] for r in rows],
                       "rel_rmse": [r["rel_rmse"] for r in rows]}
            for m, rows in sweep.items()}


def best_estimator_data() -> dict:
    r"""For each mismatch of ``MISMATCHES`` and batch size of ``BEST_BATCHES``, the estimator of
    ``MISMATCH_NAMES`` with the least relative RMSE,
    $\sqrt{\text{bias}^2 + \text{var}/N} / \lVert \nabla J \rVert$, exact on
    ``make_toy(mismatch=...)`` (baseline 0): ``{"best": [[index]], "rel_rmse": [[value]]}``,
    rows the mismatches, columns the batch sizes."""
    from opd_literate.mismatch.estimators import mismatch_sweep
    from opd_literate.mismatch.toy import make_toy

    sweep = mismatch_sweep(list(MISMATCHES), names=list(MISMATCH_NAMES), N=BATCH)
    best, errors = [], []
    for mismatch in MISMATCHES:
        rows = sweep[mismatch]
        norm = float(np.linalg.norm(make_toy(mismatch=mismatch)["true_grad"]))
        row_best, row_error = [], []
        for batch in BEST_BATCHES:
            rmse = [float(np.sqrt(r["bias"] ** 2 + r["var"] / batch)) / norm for r in rows]
            index = int(np.argmin(rmse))
            row_best.append(index)
            row_error.append(rmse[index])
        best.append(row_best)
        errors.append(row_error)
    return {"best": best, "rel_rmse": errors}


# The map's colours, one an estimator that wins somewhere, in the catalogue's order.
BEST_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#e7ba52", "#aec7e8", "#637939",
                "#ad494a", "#a55194", "#000000", "#c7c7c7", "#8c6d31", "#6b6ecf", "#b5cf6b",
                "#cedb9c", "#e7969c", "#843c39", "#5254a3", "#9c9ede", "#fd8d3c", "#31a354",
               "#de9ed6", "#756bb1")  # as many as MISMATCH_NAMES


def best_colours(data: dict) -> list[tuple[str, str]]:
    """``[(estimator, colour)]`` for each estimator that wins a cell of the map, in the
    catalogue's order: the map's colours and its key."""
    winners = sorted({i for row in data["best"] for i in row})
    return [(MISMATCH_NAMES[i], BEST_PALETTE[k % len(BEST_PALETTE)])
            for k, i in enumerate(winners)]


def _best_estimator_figure(data: dict):
    """A map over (batch size, mismatch) of the estimator with the least error, one colour an
    estimator that wins somewhere; hover a cell for its name and error. Its key is HTML under
    it (``best_legend``), which wraps on a phone, where a colour bar of a dozen names would
    take the map's width."""
    import plotly.graph_objects as go

    colours = best_colours(data)
    index = {name: k for k, (name, _) in enumerate(colours)}
    n = len(colours)
    scale = []
    for k, (_, colour) in enumerate(colours):  # one flat band a winner
        scale += [[k / n, colour], [(k + 1) / n, colour]]
    names = [[MISMATCH_NAMES[i] for i in row] for row in data["best"]]
    z = [[index[name] for name in row] for row in names]
    fig = go.Figure(go.Heatmap(
        z=z, x=[str(b) for b in BEST_BATCHES], y=[f"{m:g}" for m in MISMATCHES],
        customdata=[[[name, error] for name, error in zip(nr, er)]
                    for nr, er in zip(names, data["rel_rmse"])],
        zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=1, ygap=1, showscale=False,
        hovertemplate="mismatch %{y}, batch %{x}: %{customdata[0]}, "
                      "relative RMSE %{customdata[1]:.3g}<extra></extra>"))
    fig.update_layout(
        title={"text": "The estimator of least error, by batch size and mismatch (exact)",
               "font": {"size": 15}},
        xaxis_title="batch size N", yaxis_title="mismatch ε", height=470,
        margin={"l": 10, "r": 20, "t": 60, "b": 20},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"size": 13, "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"},
    )
    return fig


def best_legend(entries) -> str:
    """The map's key: a swatch and a name for each estimator that wins somewhere."""
    items = "".join(f'<li><span class="explorable-swatch" style="background:{colour}"></span>'
                    f"<code>{escape(name)}</code></li>" for name, colour in entries)
    return f'<ul class="explorable-key" aria-label="least error">{items}</ul>\n'


def threshold_explorer_data() -> dict:
    """``{C: {"rel_bias": [...], "rel_rmse": [...]}}`` for ``THRESHOLD_NAMES`` at
    ``make_toy(mismatch=THRESHOLD_MISMATCH)``: ``token_tis`` and ``seq_tis`` truncated at
    ``cap=C``, ``token_mis`` and ``seq_mis`` masked outside ``[0, C]``; exact moments."""
    from opd_literate.mismatch import estimators
    from opd_literate.mismatch.toy import estimator_moments, make_toy

    toy = make_toy(mismatch=THRESHOLD_MISMATCH)
    data = {}
    for cap in THRESHOLDS:
        estimates = (estimators.token_tis(toy, cap=cap), estimators.seq_tis(toy, cap=cap),
                     estimators.token_mis(toy, high=cap), estimators.seq_mis(toy, high=cap))
        moments = [estimator_moments(toy, e) for e in estimates]
        data[cap] = {"rel_bias": [m["rel_bias"] for m in moments],
                     "rel_rmse": [m["rel_rmse"](BATCH) for m in moments]}
    return data


def _bars_with_slider(data: dict, names, start: int, slider_label: str, title: str):
    """Two bar charts (relative bias, relative RMSE at N = 64) and one slider over ``data``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.16,
                        subplot_titles=("relative bias", f"rel. RMSE, N = {BATCH}"))
    keys = list(data)
    for i, key in enumerate(keys):
        for column, metric in enumerate(("rel_bias", "rel_rmse"), start=1):
            fig.add_trace(go.Bar(
                x=data[key][metric], y=list(names), orientation="h", visible=i == start,
                name=f"{metric} {key:g}", showlegend=False,
                marker_color="#3f51b5" if metric == "rel_bias" else "#e8710a",
                hovertemplate="%{y}: %{x:.4g}<extra></extra>"), row=1, col=column)
    steps = []
    for i, key in enumerate(keys):
        visible = [j // 2 == i for j in range(2 * len(keys))]
        steps.append({"method": "restyle", "args": [{"visible": visible}], "label": f"{key:g}"})
    fig.update_layout(
        title={"text": title, "font": {"size": 15}},
        sliders=[{"active": start, "steps": steps, "currentvalue": {"prefix": slider_label}}],
        height=max(470, 200 + 20 * len(names)), margin={"l": 10, "r": 20, "t": 70, "b": 20},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"size": 13, "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"},
    )
    fig.update_yaxes(autorange="reversed", gridcolor="rgba(0,0,0,0.12)")
    fig.update_xaxes(gridcolor="rgba(0,0,0,0.12)", zerolinecolor="rgba(0,0,0,0.3)")
    # One scale for every position, so that moving the slider shows growth, not a new axis.
    biases = [x for key in keys for x in data[key]["rel_bias"]]
    errors = [x for key in keys for x in data[key]["rel_rmse"]]
    fig.update_xaxes(range=[0, 1.05 * max(biases)], row=1, col=1)
    fig.update_xaxes(type="log", dtick=1, row=1, col=2,  # powers of ten only: no overlap
                     range=[np.log10(min(errors)) - 0.05, np.log10(max(errors)) + 0.05])
    fig.update_yaxes(showticklabels=False, row=1, col=2)
    return fig


def experiment_explorer_data() -> dict:
    """The committed experiment's accuracy curves: for each method its samples, the mean over
    seeds and each seed's curve (``docs/data/experiment/results.json``)."""
    results = json.loads(EXPERIMENT.read_text())
    methods = {}
    for method, record in results["methods"].items():
        curves = [list(map(float, c)) for c in record["accuracy"]]
        mean = [float(np.mean(column)) for column in zip(*curves)]
        methods[method] = {"samples": list(record["samples"]), "seeds": curves, "mean": mean}
    return {"methods": methods, "seeds": results["config"]["seeds"]}


def _experiment_figure(data: dict):
    """One line per method; the slider picks the mean over seeds or one seed's curve.

    The slider restyles the lines' ``y`` and leaves their visibility alone, so that a method the
    reader hid in the legend stays hidden, and the legend stays, at every position."""
    import plotly.graph_objects as go

    fig = go.Figure()
    positions = ["mean"] + [f"seed {s}" for s in range(data["seeds"])]
    methods = list(data["methods"])
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
    for m, method in enumerate(methods):
        record = data["methods"][method]
        fig.add_trace(go.Scatter(
            x=record["samples"], y=record["mean"], mode="lines+markers", name=method,
            visible=True, line={"color": palette[m % len(palette)]}, marker={"size": 4},
            hovertemplate=f"{method}<br>%{{x}} samples: %{{y:.3f}}<extra></extra>"))
    steps = []
    for p, position in enumerate(positions):
        curves = [data["methods"][method]["mean"] if p == 0
                  else data["methods"][method]["seeds"][p - 1] for method in methods]
        steps.append({"method": "restyle", "args": [{"y": curves}], "label": position})
    fig.update_layout(
        title={"text": "Greedy accuracy on the test prompts: the mean, or one seed",
               "font": {"size": 15}},
        sliders=[{"active": 0, "steps": steps, "currentvalue": {"prefix": "curve: "},
                  "pad": {"t": 55}}],  # below the axis title
        xaxis_title="student samples", yaxis_title="greedy accuracy (test prompts)",
        height=470, margin={"l": 10, "r": 20, "t": 60, "b": 20},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom"},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"size": 13, "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"},
    )
    fig.update_xaxes(gridcolor="rgba(0,0,0,0.12)")
    fig.update_yaxes(gridcolor="rgba(0,0,0,0.12)")
    return fig


# The retokenization explorer (teachers chapter): each cross-tokenizer method's bias against how
# often the teacher splits the student's response differently, over random draws of both models.
RETOKENIZATION_KINDS = ("identical", "teacher_merges", "student_merges", "non_refining")
RETOKENIZATION_GRADIENTS = ("pathwise", "total")
RETOKENIZATION_SEEDS = tuple(range(40))
RETOKENIZATION_SCALE = 1.5
# one figure a gradient, one slider position a pair of tokenizers (eight positions' labels
# would not fit the rail: plotly would show every other one)
RETOKENIZATION_START = RETOKENIZATION_KINDS.index("non_refining")


def retokenization_explorer_data() -> dict:
    """``{(kind, gradient): {"share": [...], "rel_error": {label: [...]}}}`` over
    ``RETOKENIZATION_SEEDS`` (``retokenization_sweep``, T = 3): the relative error of the
    pathwise gradient (``rel_norm``) or of the gradient of the expected loss
    (``total_rel_norm``) of each method of ``TABLE_METHODS``, exact."""
    from opd_literate.teachers.cross_tokenizer import TABLE_METHODS, retokenization_sweep

    data = {}
    for kind in RETOKENIZATION_KINDS:
        rows = retokenization_sweep(kind, RETOKENIZATION_SEEDS, scale=RETOKENIZATION_SCALE)
        for gradient in RETOKENIZATION_GRADIENTS:
            key = "rel_norm" if gradient == "pathwise" else "total_rel_norm"
            data[kind, gradient] = {
                "share": [r["share"] for r in rows],
                "rel_error": {label: [r["bias"][label][key] for r in rows]
                              for label, _, _ in TABLE_METHODS}}
    return data


def _retokenization_figure(data: dict, gradient: str):
    """One set of points per method, for the ``gradient`` of ``RETOKENIZATION_GRADIENTS``; the
    slider picks the pair of tokenizers and restyles the points' ``x`` and ``y`` (the legend,
    and what the reader hid in it, stay)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    start = data[RETOKENIZATION_KINDS[RETOKENIZATION_START], gradient]
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
    methods = list(start["rel_error"])
    for m, method in enumerate(methods):
        fig.add_trace(go.Scatter(
            x=start["share"], y=start["rel_error"][method], mode="markers", name=method,
            visible=True, marker={"color": palette[m % len(palette)], "size": 7, "opacity": 0.8},
            hovertemplate=f"{method}<br>share %{{x:.3f}}: %{{y:.3f}}<extra></extra>"))
    steps = []
    for kind in RETOKENIZATION_KINDS:
        record = data[kind, gradient]
        steps.append({"method": "restyle", "label": kind,
                      "args": [{"x": [record["share"]] * len(methods),
                                "y": [record["rel_error"][m] for m in methods]}]})
    what = {"pathwise": "pathwise gradient (what a trainer gets)",
            "total": "gradient of its expected loss"}[gradient]
    fig.update_layout(
        title={"text": f"Each cross-tokenizer loss's exact error in the {what}, against how "
                       "often the teacher tokenizes the student's response differently, over 40 "
                       "random pairs of models", "font": {"size": 15}},
        sliders=[{"active": RETOKENIZATION_START, "steps": steps,
                  "currentvalue": {"prefix": "tokenizers: "}, "pad": {"t": 55}}],
        xaxis_title="share of responses retokenized", yaxis_title="relative error",
        height=520, margin={"l": 10, "r": 20, "t": 60, "b": 20},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom"},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"size": 13, "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"},
    )
    fig.update_xaxes(range=[-0.02, 1.0], gridcolor="rgba(0,0,0,0.12)")
    # each position on its own scale: a few draws reach 7 where most lie below 1.5
    fig.update_yaxes(autorange=True, rangemode="tozero", gridcolor="rgba(0,0,0,0.12)")
    return fig


# The kept-mass explorer (the mismatch in practice): the sequence ratio with each reported
# log-prob and kept-mass correction (KEPT_MASS_CHOICES), its exact relative bias against the
# three targets of the chapter's table, as top-p tightens, on make_toy() at the table's
# temperature (docs/hooks/generate.py, ENGINE_KEPT_MASS). Below top-p 0.62 the engine writes no
# sequence with a reward on this toy, and the relative biases are undefined; from 0.98 it cuts
# nothing.
KEPT_MASS_TEMPERATURE = 0.7
KEPT_MASS_TOP_PS = (0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 1.0)
KEPT_MASS_START = KEPT_MASS_TOP_PS.index(0.93)  # the chapter's table
# the targets as the chapter's table names its columns
KEPT_MASS_TARGETS = (("rel_bias_true", "∇J_τ"),
                     ("rel_bias_writable", "∇J_τ^W (writable sequences)"),
                     ("rel_bias_masked", "∇E_{π_S}[R] (the engine's policy)"))
_REPORTED_NAMES = {"processed": "processed", "raw": "raw", "tempered": "SGLang tempered"}


def kept_mass_label(options: dict) -> str:
    """A name for a row of ``KEPT_MASS_CHOICES`` (the table's own labels repeat
    "+ renormalised on the kept set" under two log-probs): the log-probs, and on a second line
    the correction, so that the names leave the bars room on a phone."""
    name = _REPORTED_NAMES[options["reported"]]
    if options.get("kept_mass") == "sampler":
        name += "<br>renormalised"
    elif options.get("kept_mass") == "trainer":
        name += "<br>+ trainer's kept mass"
    if options.get("trainer_mask"):
        name += "<br>mask replayed"
    return name


def kept_mass_explorer_data() -> dict:
    """``{top_p: {"rel_bias_true": [...], "rel_bias_writable": [...], "rel_bias_masked": [...]}}``,
    one entry a row of ``KEPT_MASS_CHOICES``: ``kept_mass_table(make_toy(), temperature=0.7,
    top_p=top_p)``, exact."""
    from opd_literate.mismatch.engine import kept_mass_table
    from opd_literate.mismatch.toy import make_toy

    toy = make_toy()
    data = {}
    for top_p in KEPT_MASS_TOP_PS:
        rows = kept_mass_table(toy, temperature=KEPT_MASS_TEMPERATURE, top_p=top_p)
        data[top_p] = {key: [row[key] for row in rows] for key, _ in KEPT_MASS_TARGETS}
    return data


def _kept_mass_figure(data: dict):
    """Grouped bars, one group a row of ``KEPT_MASS_CHOICES`` and one colour a target; the
    slider picks top-p and shows that position's three traces. Each position keeps its own
    scale: the biases reach 70 at top-p 0.65, where they stay below 1 at 0.93."""
    import plotly.graph_objects as go

    from opd_literate.mismatch.engine import KEPT_MASS_CHOICES

    names = [kept_mass_label(options) for _, options in KEPT_MASS_CHOICES]
    colours = ("#3f51b5", "#e8710a", "#2ca02c")
    fig = go.Figure()
    for i, top_p in enumerate(KEPT_MASS_TOP_PS):
        for (key, target), colour in zip(KEPT_MASS_TARGETS, colours):
            fig.add_trace(go.Bar(
                x=data[top_p][key], y=names, orientation="h", visible=i == KEPT_MASS_START,
                name=target, legendgroup=target, marker_color=colour,
                hovertemplate=f"%{{y}}<br>against {target}: %{{x:.4g}}<extra></extra>"))
    n = len(KEPT_MASS_TARGETS)
    steps = [{"method": "restyle", "label": f"{top_p:g}",
              "args": [{"visible": [j // n == i for j in range(n * len(KEPT_MASS_TOP_PS))]}]}
             for i, top_p in enumerate(KEPT_MASS_TOP_PS)]
    fig.update_layout(
        title={"text": "The sequence ratio with each reported log-prob and kept-mass "
                       "correction: its exact relative bias against each target as top-p "
                       f"tightens (the chapter's toy, τ = {KEPT_MASS_TEMPERATURE:g})",
               "font": {"size": 15}},
        barmode="group", bargap=0.25,
        sliders=[{"active": KEPT_MASS_START, "steps": steps,
                  "currentvalue": {"prefix": "top-p = "}, "pad": {"t": 55}}],
        xaxis_title="relative bias", height=560,
        margin={"l": 10, "r": 20, "t": 60, "b": 20},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom"},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"size": 13, "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"},
    )
    fig.update_yaxes(autorange="reversed", gridcolor="rgba(0,0,0,0.12)")
    fig.update_xaxes(autorange=True, rangemode="tozero", gridcolor="rgba(0,0,0,0.12)",
                     zerolinecolor="rgba(0,0,0,0.3)")
    return fig


# Below this width of its box (a phone's column is 358 px) a figure takes its narrow layout.
NARROW_PX = 560


def _bars_narrow(fig) -> tuple[dict, dict]:
    """The two bar panels of ``_bars_with_slider`` one above the other, each as wide as the
    column (side by side, on a phone, the names leave each panel 60 px and the two subplot
    titles run into each other): ``(narrow, wide)`` relayouts."""
    layout = fig.layout
    narrow = {"xaxis.domain": [0, 1], "xaxis2.domain": [0, 1], "yaxis.domain": [0.56, 1],
              "yaxis2.domain": [0, 0.44], "yaxis2.showticklabels": True,
              "annotations[0].x": 0.5, "annotations[1].x": 0.5, "annotations[1].y": 0.44,
              "height": 2 * layout.height - 60}
    wide = {"xaxis.domain": list(layout.xaxis.domain), "xaxis2.domain": list(layout.xaxis2.domain),
            "yaxis.domain": list(layout.yaxis.domain), "yaxis2.domain": list(layout.yaxis2.domain),
            "yaxis2.showticklabels": False, "annotations[0].x": layout.annotations[0].x,
            "annotations[1].x": layout.annotations[1].x,
            "annotations[1].y": layout.annotations[1].y, "height": layout.height}
    return narrow, wide


def _html(fig, div_id: str, narrow: tuple[dict, dict] | None = None, after: str = "") -> str:
    """The figure's ``<div>`` and script, after the tag that loads the site's plotly.js; with
    ``narrow`` = ``(narrow, wide)`` relayouts, a script that applies the first while the
    figure's box is narrower than ``NARROW_PX`` and the second otherwise; ``after``, HTML
    under the plot."""
    caption = escape(fig.layout.title.text or "", quote=True)  # figures.py numbers it
    # The title becomes the figure's caption, which wraps: inside the plot a long title is cut
    # on a phone, under the toolbar.
    fig.update_layout(title_text="", margin={"t": 40 if fig.layout.annotations else 20})
    body = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config=PLOTLY_CONFIG)
    fit = "" if narrow is None else _FIT.format(id=json.dumps(div_id), px=NARROW_PX,
                                                narrow=json.dumps(narrow[0]),
                                                wide=json.dumps(narrow[1]))
    return (f'<div class="explorable" markdown="0" data-caption="{caption}">\n'
            f'<script src="../generated/plotly.min.js"></script>\n{body}\n{after}{fit}</div>\n')


# The plot's div and the one around it have its height in their style (to_html): both follow
# the layout's.
_FIT = """<script>
(function () {{
  var gd = document.getElementById({id}), state = null;
  var narrow = {narrow}, wide = {wide};
  function fit() {{
    var small = gd.parentElement.parentElement.clientWidth < {px};
    if (small === state || !window.Plotly || !gd.data) return;
    state = small;
    var keys = small ? narrow : wide;
    gd.style.height = gd.parentElement.style.height = keys.height + "px";
    Plotly.relayout(gd, keys);
  }}
  fit();
  window.addEventListener("resize", fit);
}})();
</script>
"""


def _write(name: str, data) -> None:
    path = OUT / name
    payload = data.encode() if isinstance(data, str) else data
    if not path.exists() or path.read_bytes() != payload:
        path.write_bytes(payload)


def fragments() -> dict[str, str]:
    """``{file name: the HTML a page includes}`` for every explorable figure."""
    mismatch = _bars_with_slider(
        mismatch_explorer_data(), MISMATCH_NAMES, MISMATCH_START, "mismatch ε = ",
        "Every estimator, exactly, as the mismatch grows (baseline 0)")
    threshold = _bars_with_slider(
        threshold_explorer_data(), THRESHOLD_NAMES, THRESHOLD_START, "threshold C = ",
        f"Truncated at C (TIS) or masked above C (MIS), mismatch {THRESHOLD_MISMATCH:g}")
    best_data = best_estimator_data()
    retokenization = retokenization_explorer_data()
    kept_mass = _kept_mass_figure(kept_mass_explorer_data())
    return {
        "explore_mismatch.html": _html(mismatch, "explore-mismatch", _bars_narrow(mismatch)),
        "explore_threshold.html": _html(threshold, "explore-threshold", _bars_narrow(threshold)),
        "explore_experiment.html": _html(_experiment_figure(experiment_explorer_data()),
                                         "explore-experiment"),
        "explore_best.html": _html(_best_estimator_figure(best_data), "explore-best",
                                   after=best_legend(best_colours(best_data))),
        "explore_kept_mass.html": _html(kept_mass, "explore-kept-mass"),
        **{f"explore_retokenization_{gradient}.html": _html(
            _retokenization_figure(retokenization, gradient),
            f"explore-retokenization-{gradient}") for gradient in RETOKENIZATION_GRADIENTS},
    }


def on_pre_build(config):
    # Only a build whose pages show an explorable (docs/hooks/_built.py) computes them.
    if not _built.wanted(_built.used_generated_files(config), ("explore_*.html",)):
        return
    import plotly

    OUT.mkdir(exist_ok=True)
    bundle = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    _write("plotly.min.js", bundle.read_bytes())
    for name, html in fragments().items():
        _write(name, html)
