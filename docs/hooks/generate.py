"""MkDocs hook: compute every number, table and figure of the site from the package.

Runs before each build and writes into ``docs/generated/`` (not committed). A file is written
only when its content changed, so ``mkdocs serve`` does not rebuild in a loop. The pages
include the tables with ``--8<-- "generated/NAME.md"`` and show the figures as images.

The experiment's numbers come from ``docs/data/experiment/results.json``, written by the
documented command ``python -m opd_literate.experiment --out docs/data/experiment`` (115 s on the
2-core machine that wrote it, too long for a docs build), its reruns on other machines from
``docs/data/experiment/reruns/*/``, and the OPD chapter's
gradient-agreement table from
``docs/data/experiment/gradient_agreement.json``, written by
``python -m opd_literate.experiment --gradient-agreement --out docs/data/experiment``;
``tests/site/test_docs_data.py`` checks that both match the current defaults.
"""

from __future__ import annotations

import fnmatch
import json
import pathlib
import re
import tempfile

import _built  # docs/hooks/_built.py (MkDocs puts a hook's folder on sys.path)
import numpy as np
import torch
from matplotlib.lines import Line2D

from opd_literate._figures import new_figure, svg_bytes

DOCS = pathlib.Path(__file__).resolve().parents[1]
OUT = DOCS / "generated"
EXPERIMENT = DOCS / "data" / "experiment" / "results.json"
GRADIENT_AGREEMENT = DOCS / "data" / "experiment" / "gradient_agreement.json"
EXPERIMENT_LONG = DOCS / "data" / "experiment" / "long" / "results.json"
# Reruns of the same commands on other machines: one folder each, with its machine.json, its
# results.json (default run), long/results.json (--long) and gradient_agreement.json.
EXPERIMENT_RERUNS = DOCS / "data" / "experiment" / "reruns"
COMMITTED_MACHINE = "committed: 2 cores, AVX-512"
TINYLM_MISMATCH = DOCS / "data" / "experiment" / "tinylm_mismatch.json"
MISMATCH_TRAINING = DOCS / "data" / "mismatch_experiment" / "mismatch_training.json"
# The training study's machine (machine.json beside its record) and its reruns on other kernels:
# one folder each, with machine.json, mismatch_training.json and tinylm_mismatch.json.
MISMATCH_RERUNS = DOCS / "data" / "mismatch_experiment" / "reruns"
# The second training study (--mismatch-training --strongest), one folder a kernel set, each
# with machine.json and mismatch_training.json.
MISMATCH_STRONGEST = DOCS / "data" / "mismatch_experiment" / "strongest"


def _write(name: str, data) -> None:
    if not any(fnmatch.fnmatch(name, pattern) for _, patterns in GENERATORS
               for pattern in patterns):
        raise ValueError(f"generated/{name} is not declared in GENERATORS")
    path = OUT / name
    payload = data.encode() if isinstance(data, str) else data
    if not path.exists() or path.read_bytes() != payload:
        path.write_bytes(payload)


def _estimators():
    from opd_literate.mismatch.estimators import comparison_table, format_table, mismatch_sweep
    from opd_literate.mismatch.toy import make_toy

    toy = make_toy()
    rows = comparison_table(toy, N=64)
    _write("estimators_table.md", format_table(rows, N=64) + "\n")
    # With a baseline some advantages are negative: ppo_clip_bypass, gspo and DPPO change.
    rows_baseline = comparison_table(make_toy(mismatch=1.0), N=64, baseline=0.5)
    _write("estimators_table_baseline.md", format_table(rows_baseline, N=64) + "\n")

    names = ["naive", "token_is", "seq_is", "token_tis", "seq_tis", "token_mis", "seq_mis",
             "icepop", "ppo_clip_bypass", "gspo"]
    # solid: the textbook weights; dashed: the weights of the framework losses built on them
    framework = {"icepop", "ppo_clip_bypass", "gspo"}
    mismatches = np.round(np.linspace(0.0, 1.5, 16), 3)
    sweep = mismatch_sweep(mismatches, names=names, N=64)
    fig, axes = new_figure(1, 2, height=3.9)
    for i, name in enumerate(names):
        bias = [rows_m[i]["rel_bias"] for rows_m in sweep.values()]
        rmse = [rows_m[i]["rel_rmse"] for rows_m in sweep.values()]
        style = "--" if name in framework else "-"
        axes[0].plot(mismatches, bias, style, marker=".", label=name)
        axes[1].plot(mismatches, rmse, style, marker=".", label=name)
    axes[0].set(xlabel="mismatch $\\epsilon$", ylabel="relative bias", title="exact bias")
    axes[1].set(xlabel="mismatch $\\epsilon$", ylabel="relative RMSE, N = 64",
                title="exact error of a batch of 64", yscale="log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5,
               bbox_to_anchor=(0.5, -0.02), columnspacing=1.0, handlelength=2.2,
               title="solid: textbook weights; dashed: framework losses")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    _write("mismatch_sweep.svg", svg_bytes(fig))

    # Relative RMSE against the batch size at the default mismatch: where variance stops
    # mattering and bias takes over.
    fig, ax = new_figure(height=3.6)
    batch = np.logspace(0, 4, 30)
    grad_norm = float(np.linalg.norm(toy["true_grad"]))
    for name in ["naive", "token_is", "seq_is", "token_tis", "seq_tis", "seq_mis"]:
        row = next(r for r in rows if r["name"] == name)
        # rel. RMSE(N) = sqrt(bias^2 + var / N) / ||grad J||, exactly
        ax.loglog(batch, np.sqrt(row["bias"] ** 2 + row["var"] / batch) / grad_norm, label=name)
    ax.set(xlabel="batch size N (sequences)", ylabel="relative RMSE",
           title="bias floor against variance, mismatch 0.3")
    ax.grid(True, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    _write("rmse_vs_batch.svg", svg_bytes(fig))


def _opd_mismatch():
    from opd_literate.mismatch.opd_mismatch import opd_mismatch_table

    mismatches = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5]
    rows = opd_mismatch_table(mismatches)
    recipes = list(dict.fromkeys((r["logp"], r["weight"]) for r in rows))
    header = "| student log-prob in the reward | weight | " + " | ".join(
        f"ε = {m:g}" for m in mismatches) + " |"
    lines = [header, "| --- | --- | " + " | ".join("---:" for _ in mismatches) + " |"]
    fig, ax = new_figure(height=3.6)
    for logp, weight in recipes:
        bias = [r["rel_bias"] for r in rows if (r["logp"], r["weight"]) == (logp, weight)]
        lines.append(f"| {logp} | {weight} | " + " | ".join(f"{b:.4f}" for b in bias) + " |")
        ax.plot(mismatches, bias, marker=".", label=f"{logp} log-prob, {weight}")
    ax.set(xlabel="mismatch $\\epsilon$", ylabel="relative bias of the OPD gradient",
           title="sampled-token OPD, tokens from the sampler")
    ax.legend(loc="upper left", title="student log-prob, weight")
    fig.tight_layout()
    _write("opd_mismatch_table.md", "\n".join(lines) + "\n")
    _write("opd_mismatch.svg", svg_bytes(fig))


AR_SIZE = dict(T=5, V=3)  # the autoregressive section's toys (V = 3, T up to 8)


def _ar_estimators():
    """The estimator table on the AR toy beside the independent one (same T, V, mismatch)."""
    from opd_literate.mismatch.estimators import comparison_table
    from opd_literate.mismatch.toy import ar_num_responses, make_ar_toy, make_toy

    independent = comparison_table(make_toy(**AR_SIZE, mismatch=0.3), N=64)
    autoregressive = comparison_table(make_ar_toy(**AR_SIZE, mismatch=0.3), N=64)
    M_ind, M_ar = AR_SIZE["V"] ** AR_SIZE["T"], ar_num_responses(**AR_SIZE)
    lines = [f"| estimator | independent ({M_ind} responses): rel. bias | rel. RMSE (N=64) "
             f"| autoregressive, <eos> ({M_ar} responses): rel. bias | rel. RMSE (N=64) "
             "| tokens modified |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for ind, ar in zip(independent, autoregressive):
        lines.append(f"| `{ar['name']}` | {ind['rel_bias']:.4f} | {ind['rel_rmse']:.4f} | "
                     f"{ar['rel_bias']:.4f} | {ar['rel_rmse']:.4f} | "
                     f"{100 * ar['token_frac']:.1f}% |")
    _write("ar_estimators_table.md", "\n".join(lines) + "\n")


def _ar_opd():
    """OPD recipes on both toys at three mismatches: which stay exact with a prefix."""
    from opd_literate.mismatch.opd_mismatch import OPD_RECIPES, PREFIX_RECIPES, opd_mismatch_table

    mismatches = [0.1, 0.3, 1.0]
    recipes = OPD_RECIPES + PREFIX_RECIPES
    tables = {kind: opd_mismatch_table(mismatches, **AR_SIZE, recipes=recipes,
                                       autoregressive=kind == "autoregressive")
              for kind in ("independent", "autoregressive")}
    header = "| student log-prob | weight | " + " | ".join(
        f"{kind[:5]}. ε = {m:g}" for kind in tables for m in mismatches) + " |"
    lines = [header, "| --- | --- | " + " | ".join("---:" for _ in range(6)) + " |"]
    for logp, weight in recipes:
        cells = []
        for rows in tables.values():
            for r in rows:
                if (r["logp"], r["weight"]) == (logp, weight):
                    cells.append("**0**" if r["rel_bias"] < 1e-12 else f"{r['rel_bias']:.4f}")
        lines.append(f"| {logp} | {weight} | " + " | ".join(cells) + " |")
    _write("ar_opd_table.md", "\n".join(lines) + "\n")


AR_LENGTHS = list(range(1, 9))
AR_SWEEP_NAMES = ["token_is", "token_tis", "seq_is", "seq_tis"]


def _ar_bias_against_length():
    """Relative bias of token- and sequence-level corrections against T, three toys."""
    from opd_literate.mismatch.estimators import length_sweep

    toys = {"autoregressive, <eos>": dict(autoregressive=True, eos=True),
            "autoregressive, fixed length": dict(autoregressive=True, eos=False),
            "independent": dict(autoregressive=False)}
    fig, axes = new_figure(1, 2, height=3.9, sharey=True)
    # colour: the toy; solid with circles: the plain ratio; dashed with crosses: truncated at 2
    colours = dict(zip(toys, ("C0", "C1", "C2")))
    for label, kwargs in toys.items():
        sweep = length_sweep(AR_LENGTHS, AR_SWEEP_NAMES, mismatch=0.3, V=3, **kwargs)
        for ax, pair in zip(axes, (AR_SWEEP_NAMES[:2], AR_SWEEP_NAMES[2:])):
            for name in pair:
                plain = name in ("token_is", "seq_is")
                ax.plot(AR_LENGTHS, [sweep[T][name] for T in AR_LENGTHS],
                        "-o" if plain else "--x", color=colours[label], markersize=4)
    axes[0].set(xlabel="response length T", ylabel="relative bias (median of 5 seeds)",
                title="token level: token_is, token_tis")
    axes[1].set(xlabel="response length T", title="sequence level: seq_is, seq_tis")
    # Two legends, one a channel: the colour names the toy, the line style the weight.
    toy_handles = [Line2D([], [], color=c, label=t) for t, c in colours.items()]
    style_handles = [Line2D([], [], color="0.3", ls="-", marker="o", markersize=4,
                            label="plain ratio (token_is, seq_is)"),
                     Line2D([], [], color="0.3", ls="--", marker="x",
                            label="truncated at 2 (token_tis, seq_tis)")]
    fig.legend(handles=toy_handles + style_handles, loc="lower center", ncol=2,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    _write("ar_bias_vs_length.svg", svg_bytes(fig))


def _ar_reductions():
    """Each loss reduction, gamma = 0 and 1, against the sequence KL gradient."""
    from opd_literate.mismatch.opd_mismatch import REDUCTIONS, add_teacher, reduction_table
    from opd_literate.mismatch.toy import make_ar_toy

    with_eos = reduction_table(add_teacher(make_ar_toy(**AR_SIZE)), batch_sizes=(1, 8))
    fixed = reduction_table(add_teacher(make_ar_toy(**AR_SIZE, eos=False)), gammas=(0.0, 1.0),
                            batch_sizes=(8,))
    columns = [("<eos>", 0.0, 1), ("<eos>", 0.0, 8), ("<eos>", 1.0, 1), ("<eos>", 1.0, 8),
               ("fixed", 0.0, 8), ("fixed", 1.0, 8)]
    names = {"<eos>": "with <eos>", "fixed": "fixed length"}
    lines = ["| reduction | " + " | ".join(f"γ = {g:g}, B = {B}, {names[k]}"
                                          for k, g, B in columns) + " |",
             "| --- | " + " | ".join("---:" for _ in columns) + " |"]
    for reduction in REDUCTIONS:
        cells = []
        for kind, gamma, B in columns:
            rows = with_eos if kind == "<eos>" else fixed
            r = next(r for r in rows if (r["reduction"], r["gamma"], r["batch_size"])
                     == (reduction, gamma, B))
            cells.append("**0**" if r["rel_bias"] < 1e-12
                         else f"{r['rel_bias']:.3f} ({r['angle']:.1f}°)")
        lines.append(f"| `{reduction}` | " + " | ".join(cells) + " |")
    _write("ar_reductions_table.md", "\n".join(lines) + "\n")


def _k_estimators():
    from opd_literate.opd import (
        expected_kl_estimator_gradient,
        forward_kl,
        full_vocab_reverse_kl,
    )

    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)
    zt = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)
    ones = torch.ones(1, 1, dtype=torch.float64)

    def grad(fn):
        x = z.clone().requires_grad_(True)
        fn(x).backward()
        return x.grad

    targets = {"0": torch.zeros_like(z),
               "∇ KL(π_θ ‖ π_T) (reverse)": grad(lambda x: full_vocab_reverse_kl(x, zt, ones)),
               "∇ KL(π_T ‖ π_θ) (forward)": grad(lambda x: forward_kl(x, zt, ones))}
    lines = ["| estimator | used as | " + " | ".join(f"distance to {t}" for t in targets) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in targets) + " |"]
    for kind in ("k1", "k2", "k3"):
        for mode in ("loss", "reward"):
            expected = expected_kl_estimator_gradient(z, zt, kind, mode)
            cells = []
            for target in targets.values():
                distance = float((expected - target).norm())
                cells.append("**0**" if distance < 1e-12 else f"{distance:.3f}")
            lines.append(f"| {kind} | {mode} | " + " | ".join(cells) + " |")
    _write("k_estimators_table.md", "\n".join(lines) + "\n")


def _experiment():
    from opd_literate.experiment.plots import write_plots
    from opd_literate.experiment.stats import format_headline

    results = json.loads(EXPERIMENT.read_text())
    lrs = results["config"]["lrs"]
    # Plot outside docs/ (a rewritten file there would make `mkdocs serve` rebuild forever),
    # then copy in only what changed.
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_plots(results, tmp, format="svg"):
            _write(f"experiment_{path.name}", path.read_bytes())
    _write("experiment_headline.md", format_headline(results) + "\n")
    # The learning-rate search, on the validation prompts: mean final validation accuracy,
    # and how many seeds reached the target there.
    seeds = results["config"]["seeds"]
    lr_lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
                "| --- | " + " | ".join("---:" for _ in lrs) + " | ---: |"]
    for method, runs in results["lr_search"].items():
        cells = []
        for lr in lrs:
            run = runs[str(lr)]
            final = sum(run["val_final_accuracy"]) / seeds
            reached = sum(hit is not None for hit in run["val_samples_to_target"])
            cells.append(f"{final:.3f} ({reached}/{seeds})")
        chosen = results["methods"][method]["lr"]
        lr_lines.append(f"| {method} | " + " | ".join(cells) + f" | {chosen:g} |")
    _write("experiment_lr_search.md", "\n".join(lr_lines) + "\n")
    _write("experiment_config.md",
           "```json\n" + json.dumps(results["config"], indent=1) + "\n```\n")
    # The second regime (--long): its headline and accuracy plot.
    long = json.loads(EXPERIMENT_LONG.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_plots(long, tmp, format="svg"):
            _write(f"experiment_long_{path.name}", path.read_bytes())
    _write("experiment_long_headline.md", format_headline(long) + "\n")
    # The same study on every machine: the committed run and each rerun, side by side.
    _write("experiment_machines.md", _machines_table("results.json", results) + "\n")
    _write("experiment_long_machines.md", _machines_table("long/results.json", long) + "\n")


def experiment_reruns():
    """``[(folder, machine)]``: the committed reruns, each with its machine.json, in the order
    machine.json gives (then by folder name)."""
    reruns = [(path.parent, json.loads(path.read_text()))
              for path in EXPERIMENT_RERUNS.glob("*/machine.json")]
    return sorted(reruns, key=lambda rerun: (rerun[1].get("order", 0), rerun[0].name))


def _machines_table(name, committed):
    """One column a machine: seeds at the target and samples to it per method, the ratios to
    full-vocabulary OPD, and how far each method's accuracy curves moved from the committed
    run's (the largest difference at any seed and evaluation point)."""
    from opd_literate.experiment.stats import headline, ratios

    runs = [(COMMITTED_MACHINE, committed)] + [
        (machine["label"], json.loads((folder / name).read_text()))
        for folder, machine in experiment_reruns()]
    tables = [headline(results) for _, results in runs]
    found = [ratios(results) for _, results in runs]
    lines = ["| | " + " | ".join(label for label, _ in runs) + " |",
             "| --- | " + " | ".join("---:" for _ in runs) + " |"]
    for method in committed["methods"]:
        cells = []
        for table in tables:
            row = table[method]
            samples = ("" if row["samples"] is None else
                       f", {row['samples']['mean']:,.0f} [{row['samples']['low']:,.0f}, "
                       f"{row['samples']['high']:,.0f}]")
            cells.append(f"{row['reached']}/{row['seeds']}{samples}")
        lines.append(f"| {method}: seeds at target, samples to it | " + " | ".join(cells) + " |")
    for other in found[0]:
        cells = []
        for ratio in found:
            r = ratio[other]
            cells.append(("at least " if r["bound"] else "")
                         + f"{r['mean']:.1f}x [{r['low']:.1f}, {r['high']:.1f}]")
        lines.append(f"| {other} / opd_full_vocab, samples | " + " | ".join(cells) + " |")
    for method, record in committed["methods"].items():
        cells = ["(reference)"]
        for _, results in runs[1:]:
            other = results["methods"][method]["accuracy"]
            if other == record["accuracy"]:
                cells.append("0, bit for bit")
                continue
            difference = np.abs(np.array(other) - np.array(record["accuracy"])).max()
            cells.append(f"{float(difference):.3f}")
        lines.append(f"| {method}: largest accuracy difference from the committed run | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gradient_agreement():
    """The OPD chapter's table, from the committed ``gradient_agreement.json`` (computing it took
    59 s on the shared 2-core machine, more the first time, which trains the teacher)."""
    record = json.loads(GRADIENT_AGREEMENT.read_text())
    sizes = record["batch_sizes"]
    lines = ["| OPD gradient | " + " | ".join(f"batch of {B}" for B in sizes) + " |",
             "| --- | " + " | ".join("---:" for _ in sizes) + " |"]
    for method, row in record["cosine"].items():
        lines.append(f"| `{method}` | " + " | ".join(f"{row[str(B)]:.2f}" for B in sizes) + " |")
    _write("gradient_agreement.md", "\n".join(lines) + "\n")


def _handout():
    from opd_literate.course.handouts import write_lab
    from opd_literate.course.labs import PACKAGE

    source = (PACKAGE / "opd.py").read_text()
    begin = source.index("    ### BEGIN SOLUTION Task 1")
    end = source.index("### END SOLUTION", begin) + len("### END SOLUTION")
    _write("handout_marked.md", "```python\n" + source[begin:end] + "\n```\n")

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_lab("opd", pathlib.Path(tmp) / "lab")[0]
        student = (folder / "opd.py").read_text()
        readme = (folder / "README.md").read_text()
        tree = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    # The Task 1 function: its signature, the start of its docstring, and the stub.
    start = student.index("def reverse_kl_rewards(")
    stub_end = student.index('raise NotImplementedError("Task 1', start)
    stub_end = student.index("\n", stub_end)
    function = student[start:stub_end]
    doc_cut = function.index("    Parameters")
    stub_start = function.index("    mask = _check_token_pair")
    excerpt = function[:doc_cut] + "    ...\n    \"\"\"\n" + function[stub_start:]
    _write("handout_stub.md", "```python\n" + excerpt + "\n```\n")
    table = re.search(r"\| task \|.*?\n\n", readme, re.S).group(0)
    _write("handout_tasks.md", table)
    _write("handout_tree.md", "```text\n" + "\n".join(tree) + "\n```\n")


def _topk():
    """The top-k teacher study of the large-vocabulary chapter: its table and figure."""
    from opd_literate.large_vocab.topk import (
        format_topk_bias_table,
        plot_topk_bias,
        topk_bias_figure_data,
    )

    data = topk_bias_figure_data()
    _write("topk_bias_table.md", format_topk_bias_table(data) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        svg = plot_topk_bias(pathlib.Path(tmp) / "topk_bias.svg", data)
        _write("topk_bias.svg", svg.read_bytes())


ENGINE_ESTIMATORS = ["naive", "token_is", "seq_is", "token_tis", "seq_tis", "icepop"]


def _engine():
    """The engine's sampler (mismatch chapter): temperature, top-p and the reported log-probs."""
    from opd_literate.mismatch.engine import engine_toy
    from opd_literate.mismatch.estimators import comparison_table, seq_is
    from opd_literate.mismatch.toy import estimator_moments, make_toy

    toy = make_toy()  # mismatch 0.3, T = 6, V = 4

    def rel_bias(**engine):
        rows = comparison_table(engine_toy(toy, **engine), names=ENGINE_ESTIMATORS, N=64)
        return [row["rel_bias"] for row in rows]

    tau, top_p = 0.7, 0.9

    def table(columns):
        values = [rel_bias(**engine) for _, engine in columns]
        lines = ["| estimator | " + " | ".join(title for title, _ in columns) + " |",
                 "| --- | " + " | ".join("---:" for _ in columns) + " |"]
        for i, name in enumerate(ENGINE_ESTIMATORS):
            lines.append(f"| `{name}` | " + " | ".join(f"{column[i]:.3f}" for column in values)
                         + " |")
        return lines

    _write("engine_temperature_table.md", "\n".join(table([
        ("processed, trainer at τ", dict(temperature=tau)),
        ("raw, trainer at τ", dict(temperature=tau, reported="raw")),
        ("processed, trainer at 1", dict(temperature=tau, trainer_temperature=False)),
        ("raw, trainer at 1", dict(temperature=tau, reported="raw", trainer_temperature=False)),
    ])) + "\n")
    lines = table([
        ("processed", dict(top_p=top_p)),
        ("raw", dict(top_p=top_p, reported="raw")),
        ("processed, mask replayed", dict(top_p=top_p, trainer_mask=True)),
    ])
    cut = engine_toy(toy, top_p=top_p)
    share = np.linalg.norm(cut["truncated_grad"]) / np.linalg.norm(cut["true_grad"])
    replayed = engine_toy(toy, top_p=top_p, trainer_mask=True)
    own = np.linalg.norm(estimator_moments(replayed, seq_is(replayed))["mean"]
                         - replayed["masked_grad"]) / np.linalg.norm(replayed["masked_grad"])
    lines += ["", f"At top-p = {top_p} the engine cannot write {len(toy['Y']) - len(cut['Y']):,} "
              f"of the {len(toy['Y']):,} sequences; they carry {cut['truncated_mass']:.3f} of "
              f"the trainer's probability and {share:.3f} of the norm of the true gradient. "
              "With the mask replayed, `seq_is`'s relative bias against the gradient of the "
              f"truncated policy's own objective is {own:.1e} (float64 rounding)."]
    _write("engine_top_p_table.md", "\n".join(lines) + "\n")
    _engine_samplers()

    temperatures = np.round(np.linspace(0.5, 1.5, 11), 2)
    top_ps = np.round(np.linspace(0.8, 1.0, 11), 2)
    fig, axes = new_figure(1, 2, height=3.9, sharey=True)
    for reported, style in (("processed", "-"), ("raw", "--")):
        by_tau = np.array([rel_bias(temperature=t, reported=reported) for t in temperatures])
        by_p = np.array([rel_bias(top_p=p, reported=reported) for p in top_ps])
        for i, name in enumerate(ENGINE_ESTIMATORS):
            colour = f"C{i}"
            label = name if reported == "processed" else None
            axes[0].plot(temperatures, by_tau[:, i], style, color=colour, marker=".", label=label)
            axes[1].plot(top_ps, by_p[:, i], style, color=colour, marker=".")
    floor = [np.linalg.norm(e["truncated_grad"]) / np.linalg.norm(e["true_grad"])
             for e in (engine_toy(toy, top_p=p) for p in top_ps)]
    axes[1].plot(top_ps, floor, ":", color="black", label="part of ∇J cut")
    axes[0].set(xlabel="sampling temperature τ (top-p 1)", ylabel="relative bias",
                title="temperature, trainer at τ")
    axes[1].set(xlabel="top-p (τ = 1)", title="top-p truncation")
    handles, labels = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], color="grey", ls="-"), Line2D([], [], color="grey", ls="--"),
                *axes[1].get_legend_handles_labels()[0]]
    labels += ["processed log-probs", "raw log-probs", "part of ∇J cut"]
    fig.legend(handles, labels, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.02),
               columnspacing=1.0, handlelength=2.2)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    _write("engine_bias.svg", svg_bytes(fig))


SAMPLER_NAMES = {"exact": "exact", "vllm": "vLLM", "transformers": "transformers",
                 "sglang": "SGLang"}


NUCLEUS_DISAGREEMENT = DOCS / "data" / "engine" / "nucleus_disagreement.json"


def _engine_kept_mass():
    """Kept masses (mismatch chapter, practice): the sequence ratio with each reported log-prob
    and correction, against the three gradients."""
    from opd_literate.mismatch.engine import kept_mass_table
    from opd_literate.mismatch.toy import make_toy

    for name, options in (("engine_kept_mass_table.md", ENGINE_KEPT_MASS),
                          ("engine_kept_mass_min_p_table.md", ENGINE_KEPT_MASS_MIN_P)):
        lines = ["| log-probs, correction | ∇J_τ | ∇J_τ^W (writable sequences) | "
                 "∇E_{π_S}[R] (the engine's policy) | variance |",
                 "| --- | ---: | ---: | ---: | ---: |"]
        for row in kept_mass_table(make_toy(), **options):
            lines.append(f"| {row['label']} | {row['rel_bias_true']:.3f} | "
                         f"{row['rel_bias_writable']:.3f} | {row['rel_bias_masked']:.3f} | "
                         f"{row['var']:.3f} |")
        _write(name, "\n".join(lines) + "\n")


# The kept-mass table's engine: make_toy() sampled at temperature 0.7 and top-p 0.93.
ENGINE_KEPT_MASS = dict(temperature=0.7, top_p=0.93)
ENGINE_KEPT_MASS_MIN_P = dict(temperature=0.7, top_p=1.0, min_p=0.3)


def _engine_samplers():
    """Which nucleus (mismatch chapter): each sampler's biases on the boundary toy, and where
    its kept sets differ from the exact nucleus on every two-decimal distribution, from
    docs/data/engine/nucleus_disagreement.json (``--nucleus-disagreement``: 15.5 million rows a
    sampler, 10 to 15 s, most of a build's budget)."""
    from opd_literate.mismatch.engine import SAMPLERS, boundary_toy, engine_toy
    from opd_literate.mismatch.estimators import comparison_table

    toy = boundary_toy()
    engines = {s: engine_toy(toy, top_p=0.8, sampler=s) for s in SAMPLERS}
    values = {s: [row["rel_bias"] for row in comparison_table(e, names=ENGINE_ESTIMATORS, N=64)]
              for s, e in engines.items()}
    lines = ["| estimator | " + " | ".join(SAMPLER_NAMES[s] for s in SAMPLERS) + " |",
             "| --- | " + " | ".join("---:" for _ in SAMPLERS) + " |"]
    for i, name in enumerate(ENGINE_ESTIMATORS):
        lines.append(f"| `{name}` | " + " | ".join(f"{values[s][i]:.3f}" for s in SAMPLERS)
                     + " |")
    lines.append("| sequences written | " + " | ".join(f"{len(engines[s]['Y'])}" for s in SAMPLERS)
                 + " |")
    lines.append("| mass cut | " + " | ".join(f"{engines[s]['truncated_mass']:.3f}"
                                            for s in SAMPLERS) + " |")
    _write("engine_samplers_table.md", "\n".join(lines) + "\n")

    stats = json.loads(NUCLEUS_DISAGREEMENT.read_text())["samplers"]
    first = stats["exact"]
    lines = ["| rule (`sampler=`) | rows kept otherwise | more tokens | as many, others | largest "
             "difference of kept mass | where |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for s in SAMPLERS:
        d = stats[s]
        where = (f"{tuple(d['worst']['probs'])} at top-p {d['worst']['top_p']:.2f}"
                 if d["differ"] else "")
        lines.append(f"| {SAMPLER_NAMES[s]} | {d['differ']:,} ({100 * d['fraction']:.2f}%) | "
                     f"{d['more']:,} | {d['swapped']:,} | {d['max_mass_difference']:.2f} | "
                     f"{where} |")
    lines += ["", "Each rule's arithmetic as `processed_log_probs(..., sampler=)` computes it, its "
              "probabilities the exact softmax of the float32 logits rounded once to float32 (the "
              "installed transformers warper's own count follows the table). "
              f"The rows: the {first['distributions']:,} distributions of {first['V']} tokens "
              f"whose probabilities are positive multiples of 1/{first['resolution']}, each at the "
              f"{first['resolution'] - 1} top-p values 1/{first['resolution']} to "
              f"{first['resolution'] - 1}/{first['resolution']}: {first['rows']:,} rows, "
              f"{first['boundary']:,} ({100 * first['boundary'] / first['rows']:.2f}%) of them on "
              "the exact rule's boundary, where the tokens ranked above one carry exactly $p$. "
              "Counted by `python -m opd_literate.experiment --nucleus-disagreement --out "
              "docs/data/engine` (numpy 2.4.6 on a 2-core AMD EPYC with AVX2); the counts are "
              "those of any CPU whose float64 exp and log lie within 100 ulps of that machine's, "
              "where every probability that `sampler=` rounds to float32 rounds alike."]
    _write("engine_nucleus_table.md", "\n".join(lines) + "\n")


TASK_REWARD_COEFS = (0.0, 0.1, 0.3, 1.0, 3.0)


def _task_rewards():
    """OPD with task rewards (mismatch chapter): every mixture's exact bias against lambda."""
    from opd_literate.mismatch.opd_mismatch import add_teacher
    from opd_literate.mismatch.task_rewards import MIXED_ESTIMATORS, mixed_table
    from opd_literate.mismatch.toy import make_ar_toy

    toy = add_teacher(make_ar_toy(**AR_SIZE, mismatch=0.0))
    rows = mixed_table(toy, TASK_REWARD_COEFS)
    lines = ["| teacher's part | " + " | ".join(f"λ = {c:g}" for c in TASK_REWARD_COEFS) + " |",
             "| --- | " + " | ".join("---:" for _ in TASK_REWARD_COEFS) + " |"]
    at_1 = ["| teacher's part | rel. bias, ∇J − λ∇K | rel. bias, per-state | variance of one "
            "response | rel. RMSE, N = 64 |", "| --- | ---: | ---: | ---: | ---: |"]
    for kind in MIXED_ESTIMATORS:
        mine = {r["coef"]: r for r in rows if r["kind"] == kind}
        lines.append(f"| `{kind}` | " + " | ".join(f"{mine[c]['rel_bias']:.3f}"
                                                  for c in TASK_REWARD_COEFS) + " |")
        one = mine[1.0]
        at_1.append(f"| `{kind}` | {one['rel_bias']:.3f} | {one['rel_bias_per_state']:.3f} | "
                    f"{one['var']:.3f} | {one['rel_rmse']:.3f} |")
    _write("task_rewards_at_1.md", "\n".join(at_1) + "\n")
    _write("task_rewards_table.md", "\n".join(lines) + "\n")

    coefs = np.logspace(-2, 1, 19)
    sweep = mixed_table(toy, coefs)
    fig, axes = new_figure(1, 2, height=3.6)
    for i, kind in enumerate(MIXED_ESTIMATORS):
        mine = [r for r in sweep if r["kind"] == kind]
        axes[0].plot(coefs, [r["rel_bias"] for r in mine], color=f"C{i}", marker=".", label=kind)
        axes[1].plot(coefs, [r["rel_rmse"] for r in mine], color=f"C{i}", marker=".")
    axes[0].set(xscale="log", xlabel="mixing weight λ", ylabel="relative bias",
                title="bias against ∇J − λ∇K")
    axes[1].set(xscale="log", xlabel="mixing weight λ", ylabel="relative RMSE, N = 64",
                title="error of a batch of 64")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5,
               bbox_to_anchor=(0.5, -0.02), columnspacing=1.0, handlelength=2.0)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _write("task_rewards.svg", svg_bytes(fig))


# The group-baseline section (mismatch chapter): the toy, verl's "0.5_2.0" band on rho, G.
GROUPS_TOY = dict(T=3, V=2, mismatch=0.3, seed=0)
GROUPS_BAND = dict(low=0.5, high=2.0)
GROUPS_G = 4
GROUPS_SIZES = (2, 3, 4, 8)


def _groups():
    """Rejected answers in a group baseline: every choice's exact moments, and RLOO's two
    choices against the group size."""
    from opd_literate.mismatch.groups import (
        group_moments,
        group_table,
        kept_statistics,
        rejection_weights,
    )
    from opd_literate.mismatch.toy import make_toy

    toy = make_toy(**GROUPS_TOY)
    w = rejection_weights(toy, "seq_mis", **GROUPS_BAND)
    stats = kept_statistics(toy, w)
    lines = ["| baseline | rel. bias against ∇J | bias against $C_K$ | cosine with ∇J | "
             "variance | rel. RMSE (N = 64) | verl 0.9.1 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for row in group_table(toy, w, GROUPS_G):
        lines.append(f"| `{row['baseline']}` | {row['rel_bias']:.4f} | {row['target_bias']:.4f} "
                     f"| {row['cosine']:.4f} | {row['var']:.4f} | {row['rel_rmse']:.4f} | "
                     f"{'yes' if row['verl'] else ''} |")
    kept = int((w > 0).sum())
    lines.append("")
    lines.append(f"`make_toy({', '.join(f'{k}={v}' for k, v in GROUPS_TOY.items())})` "
                 f"({len(w)} responses), `seq_mis(low={GROUPS_BAND['low']}, "
                 f"high={GROUPS_BAND['high']})`, which keeps {kept} of them: $p = "
                 f"{stats['p']:.4f}$, $\\bar r = {stats['reward_mean']:.4f}$, $\\bar r_K = "
                 f"{stats['kept_reward_mean']:.4f}$; $G = {GROUPS_G}$.")
    _write("groups_table.md", "\n".join(lines) + "\n")
    sizes = ["| $G$ | `rloo_all`: bias against $C_K$ | `rloo_kept`: bias against $C_K$ | "
             "`rloo_all`: variance | `rloo_kept`: variance |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for G in GROUPS_SIZES:
        a, k = (group_moments(toy, w, G, b) for b in ("rloo_all", "rloo_kept"))
        sizes.append(f"| {G} | {a['target_bias']:.4f} | {k['target_bias']:.4f} | "
                     f"{a['var']:.4f} | {k['var']:.4f} |")
    _write("groups_by_size.md", "\n".join(sizes) + "\n")


def _cross_tokenizer():
    """The teachers chapter: each cross-tokenizer loss's exact bias on the four toys."""
    from opd_literate.teachers.cross_tokenizer import bias_table

    lines = ["| toy | loss | E[loss] | string KL | pathwise: rel. error | pathwise: cosine | "
             "total: rel. error | total: cosine |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in bias_table():
        lines.append(f"| `{r['kind']}` | {r['method']} | {r['value']:.4f} | "
                     f"{r['exact_value']:.4f} | {r['rel_norm']:.3f} | {r['cosine']:.3f} | "
                     f"{r['total_rel_norm']:.3f} | {r['total_cosine']:.3f} |")
    _write("cross_tokenizer_table.md", "\n".join(lines) + "\n")


# The teachers chapter's several teachers: the toys' draws (make_prompts' defaults: 3 prompts,
# 3 teachers, T = 3, V = 3, seed 0) and the misrouting rates of the second table.
MANY_TEACHERS_EPSILONS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
MANY_TEACHERS_KINDS = ("routed", "weighted_kl", "token_mixture", "sequence_mixture")


def _many_teachers():
    """The teachers chapter: each estimator's exact bias against each objective, on the
    independent and the autoregressive prompts, and the routed estimate under misrouting."""
    from opd_literate.teachers.many_teachers import bias_table, make_prompts, misrouting_curve

    toys = (("independent", False), ("autoregressive", True))
    lines = ["| toy | γ | estimator | " + " | ".join(f"vs `{k}`" for k in MANY_TEACHERS_KINDS)
             + " |", "| --- | ---: | --- |" + " ---: |" * len(MANY_TEACHERS_KINDS)]
    for label, autoregressive in toys:
        rows = bias_table(make_prompts(autoregressive=autoregressive))
        cell = {(r["gamma"], r["estimator"], r["objective"]): r["rel_bias"] for r in rows}
        for gamma in (0.0, 1.0):
            for estimator in MANY_TEACHERS_KINDS:
                lines.append(f"| {label} | {gamma:g} | `{estimator}` | " + " | ".join(
                    f"{cell[gamma, estimator, k]:.3f}" for k in MANY_TEACHERS_KINDS) + " |")
    _write("many_teachers_bias_table.md", "\n".join(lines) + "\n")
    columns = ("bias vs (a)", "added by misrouting", "KL at the fixed point")
    lines = ["| ε | " + " | ".join(f"{label}: {c}" for label, _ in toys for c in columns) + " |",
             "| ---: |" + " ---: |" * 6]
    curves = [misrouting_curve(make_prompts(autoregressive=ar), MANY_TEACHERS_EPSILONS)
              for _, ar in toys]
    for i, epsilon in enumerate(MANY_TEACHERS_EPSILONS):
        cells = [f"{c[i][key]:.3f}" for c in curves
                 for key in ("rel_bias", "rel_misrouting", "fixed_point_kl")]
        lines.append(f"| {epsilon:g} | " + " | ".join(cells) + " |")
    _write("many_teachers_misrouting_table.md", "\n".join(lines) + "\n")


# The "which switch" table (mismatch chapter): the toys' mismatches, tinylm's samplers, and the
# batch sizes whose best estimator it gives.
SWITCH_MISMATCHES = (0.1, 0.3, 0.6, 1.0, 1.5)
SWITCH_SAMPLERS = ("bf16", "fp16", "int8", "int4")
SWITCH_BATCHES = (16, 64, 1024)


def which_switch_rows():
    """``[(label, per-token KL, [(n, name, rel_rmse)])]``: the estimator of least error at each
    of ``SWITCH_BATCHES``, on the independent toy at each of ``SWITCH_MISMATCHES`` (every
    estimator of the catalogue, exact) and on tinylm's first weak student with each sampler of
    ``SWITCH_SAMPLERS`` (the estimators of the committed record, its head-bias moments)."""
    from opd_literate.experiment.quantized import toy_token_mismatch
    from opd_literate.mismatch.estimators import comparison_table, least_error
    from opd_literate.mismatch.toy import make_toy

    out = []
    for eps in SWITCH_MISMATCHES:
        toy = make_toy(mismatch=eps)
        out.append((f"independent toy, ε = {eps:g}", toy_token_mismatch(toy)["kl"],
                    least_error(comparison_table(toy, N=64), SWITCH_BATCHES, N=64)))
    record = json.loads(TINYLM_MISMATCH.read_text())
    for sampler in SWITCH_SAMPLERS:
        rows = record["estimators"][sampler]["tinylm"]
        out.append((f"tinylm, `{sampler}`", record["mismatch"][sampler][0]["kl"],
                    least_error(rows, SWITCH_BATCHES, N=record["batch_size"])))
    return out


def _which_switch():
    lines = ["| mismatch | per-token KL | " + " | ".join(f"N = {n:,}" for n in SWITCH_BATCHES)
             + " |", "| --- | ---: | " + " | ".join("---" for _ in SWITCH_BATCHES) + " |"]
    for label, kl, best in which_switch_rows():
        lines.append(f"| {label} | {kl:.2e} | " + " | ".join(
            f"`{name}` ({error:.3f})" for _, name, error in best) + " |")
    _write("which_switch_table.md", "\n".join(lines) + "\n")


CLAMP_STUDY = DOCS / "data" / "experiment" / "clamp_study.json"


def _tinylm_clamps():
    """verl's clamp on the experiment's teacher against its students (large-vocabulary chapter),
    from docs/data/experiment/clamp_study.json (``--clamp-study``: two minutes, too long here):
    the clamps of the config verl's trainer composes (``rows``), then the dataclass's
    (``dataclass_rows``)."""
    record = json.loads(CLAMP_STUDY.read_text())
    seeds = sorted({row["seed"] for row in record["rows"]})

    def spread(rows, key):
        values = [row[key] for row in rows]
        return f"{np.mean(values):.3f} ({min(values):.3f} to {max(values):.3f})"

    def table(rows_of_record):
        lines = ["| k | positions clamped | share of the gradient lost | $P > Q$ "
                 "| gradient error, verl's (c) | gradient error, tail bucket (b) |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in record["ks"]:
            rows = [row for row in rows_of_record if row["k"] == k]
            lines.append(f"| {k} | " + " | ".join(spread(rows, key) for key in (
                "clamped", "lost", "p_above_q", "c_grad_error", "b_grad_error")) + " |")
        return lines

    def clamps(setting):
        return ", ".join(f"`{name}: {'null' if value is None else f'{value:g}'}`"
                         for name, value in setting.items())

    lines = [f"The config verl's trainer composes ({clamps(record['clamps'])}):", "",
             *table(record["rows"]), "",
             f"With the `DistillationLossConfig` dataclass's clamps switched on "
             f"({clamps(record['dataclass_clamps'])}), on the same states:", "",
             *table(record["dataclass_rows"]), "",
             f"Mean over the {len(seeds)} weak students (smallest to largest), every state of "
             f"their answers to {record['prompts']} test prompts weighted by the student's "
             "probability of reaching it."]
    _write("tinylm_clamps_table.md", "\n".join(lines) + "\n")


def _supports():
    """The "Which support" study of the large-vocabulary chapter: its table and figure."""
    from opd_literate.large_vocab.supports import (
        NEMO_CHOICES,
        format_support_table,
        plot_support_bias,
        support_study,
    )

    data = support_study()
    _write("supports_table.md", format_support_table(data) + "\n")
    _write("supports_nemo_table.md",
           format_support_table(support_study(choices=NEMO_CHOICES)) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        svg = plot_support_bias(pathlib.Path(tmp) / "supports_bias.svg", data)
        _write("supports_bias.svg", svg.read_bytes())


def _rank_cells(values):
    """'0.1234 (3)': each value with its rank among the column (1 = smallest, ties shared)."""
    from opd_literate.experiment.quantized import average_ranks

    return [f"{v:.4f} ({r:g})" for v, r in zip(values, average_ranks(values))]


def _estimator_columns(names, header, columns):
    """A table's lines: one row an estimator, one column of cells each."""
    lines = ["| estimator | " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(header)]
    for i, name in enumerate(names):
        lines.append(f"| `{name}` | " + " | ".join(c[i] for c in columns) + " |")
    return lines


def _spearman_all(rows):
    """Rank correlation of the bias over every parameter with the LM head's bias."""
    from opd_literate.experiment.quantized import rank_correlation

    return rank_correlation([r["rel_bias_all"] for r in rows["tinylm"]],
                            [r["rel_bias"] for r in rows["tinylm"]])


def _tinylm_mismatch():
    """The mismatch chapter's section on tinylm, from docs/data/experiment/tinylm_mismatch.json
    (``--tinylm-mismatch``: minutes, too long here)."""
    record = json.loads(TINYLM_MISMATCH.read_text())
    samplers = list(record["samplers"])
    lines = ["| sampler | per-token KL | median $\\lvert\\log\\rho\\rvert$ | 99% | 99.9% | max "
             "| kurtosis |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def row(name, stats):
        kls = [s["kl"] for s in stats]
        first = stats[0]
        return (f"| {name} | {np.mean(kls):.2e} ({min(kls):.1e} to {max(kls):.1e}) | "
                + " | ".join(f"{first['abs_quantiles'][q]:.2e}" for q in ("0.5", "0.99", "0.999"))
                + f" | {first['max_abs_log_ratio']:.3g} | {first['kurtosis']:.1f} |")

    for sampler in samplers:
        lines.append(row(f"`{sampler}`", record["mismatch"][sampler]))
    lines.append(row("independent toy, $\\epsilon = 0.3$", [record["toy_b"]["toy"]]))
    lines.append(row("autoregressive toy, $\\epsilon = 0.3$", [record["toy_b"]["ar_toy"]]))
    lines += ["", f"Per-token KL: the mean over the {len(record['seeds'])} weak students "
              "(smallest to largest); the quantiles of $\\lvert\\log\\rho\\rvert$, its largest "
              "value over every token of every state, and the kurtosis of $\\log\\rho$: the "
              f"first student. {record['prompts']} test prompts, every state weighted by the "
              "sampler's probability of reaching it."]
    _write("tinylm_mismatch_table.md", "\n".join(lines) + "\n")

    shown = [s for s in samplers if s != "fp32"]
    est = record["estimators"]
    names = [r["name"] for r in est[samplers[0]]["tinylm"]]
    for key, file, label in (("rel_bias", "tinylm_estimators_bias.md", "relative bias"),
                             ("rel_rmse", "tinylm_estimators_rmse.md",
                              f"relative RMSE at N = {record['batch_size']}")):
        columns = [_rank_cells([r[key] for r in est[s]["tinylm"]]) for s in shown]
        columns += [_rank_cells([r[key] for r in est["int4"][kind]])
                    for kind in ("toy", "ar_toy")]
        header = ([f"tinylm `{s}`" for s in shown]
                  + [f"toy, $\\epsilon = {est['int4']['toy_eps']:.3f}$",
                     f"AR toy, $\\epsilon = {est['int4']['ar_toy_eps']:.3f}$"])
        lines = _estimator_columns(names, header, columns)
        spearman = [f"`{s}` {est[s]['ar_toy_spearman_' + key]:.2f}" for s in shown]
        lines += ["", f"Each cell: the {label} (its rank, 1 = smallest; equal values share a "
                  "rank). The toys' $\\epsilon$ gives them the mean per-token KL of tinylm's "
                  "`int4` sampler on the first student, whose answers these columns sum over. "
                  "Spearman's rank correlation of each tinylm column with the "
                  "autoregressive toy at that sampler's KL: " + ", ".join(spearman) + "."]
        _write(file, "\n".join(lines) + "\n")

    # over every parameter of the student, beside the LM head's bias
    columns = [_rank_cells([r["rel_bias_all"] for r in est[s]["tinylm"]]) for s in shown]
    lines = _estimator_columns(names, [f"`{s}`" for s in shown], columns)
    spearman = [f"`{s}` {_spearman_all(est[s]):.2f}" for s in shown]
    lines += ["", f"Each cell: the relative bias over all {est[shown[0]]['parameters']:,} "
              "parameters of the first student (its rank, 1 = smallest). Spearman's rank "
              "correlation with the LM head's bias column at the same sampler: "
              + ", ".join(spearman) + "."]
    _write("tinylm_estimators_bias_all.md", "\n".join(lines) + "\n")

    lines = ["| student log-prob | weight | " + " | ".join(f"tinylm `{s}`" for s in shown)
             + " | AR toy (`int4`'s KL) |",
             "| --- | --- |" + " ---: |" * (len(shown) + 1)]
    for i, r in enumerate(record["opd"][shown[0]]):
        cells = [f"{record['opd'][s][i]['rel_bias']:.4f}" for s in shown]
        cells.append(f"{record['opd']['int4'][i]['ar_toy_rel_bias']:.4f}")
        lines.append(f"| `{r['logp']}` | `{r['weight']}` | " + " | ".join(cells) + " |")
    _write("tinylm_opd_table.md", "\n".join(lines) + "\n")

    fig, axes = new_figure(1, 2, height=4.3)
    kls = [[s["kl"] for s in record["mismatch"][name]] for name in samplers]
    axes[0].bar(range(len(samplers)), [np.mean(k) for k in kls], color="C0")
    for i, k in enumerate(kls):
        axes[0].plot([i] * len(k), k, "k.", markersize=4)
    for kind, style in (("toy", "--"), ("ar_toy", ":")):
        axes[0].axhline(record["toy_b"][kind]["kl"], color="C3", linestyle=style,
                        label=("independent" if kind == "toy" else "autoregressive")
                        + " toy, $\\epsilon$ = 0.3")
    axes[0].set(xticks=range(len(samplers)), xticklabels=samplers, yscale="log",
                ylabel="per-token KL(sampler || trainer)", title="the mismatch, per sampler")
    fig_handles = axes[0].get_legend_handles_labels()
    for sampler, marker in (("int8", "o"), ("int4", "s")):
        x = [max(r["rel_bias"], 1e-17) for r in est[sampler]["tinylm"]]
        y = [max(r["rel_bias"], 1e-17) for r in est[sampler]["ar_toy"]]
        axes[1].scatter(x, y, marker=marker, label=f"{sampler} (AR toy at its KL)", alpha=0.8)
    axes[1].plot([1e-17, 2], [1e-17, 2], color="0.6", linewidth=0.8)
    axes[1].set(xscale="log", yscale="log", xlabel="relative bias on tinylm",
                ylabel="relative bias, autoregressive toy", title="every estimator, exactly")
    from matplotlib.ticker import LogLocator

    # few log ticks: their exponents are the figure's smallest text
    for axis in (axes[0].yaxis, axes[1].xaxis, axes[1].yaxis):
        axis.set_major_locator(LogLocator(numticks=5))
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(fig_handles[0] + handles, fig_handles[1] + labels, loc="lower center", ncol=2,
               bbox_to_anchor=(0.5, -0.02), columnspacing=1.0, handlelength=2.0)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    _write("tinylm_mismatch.svg", svg_bytes(fig))


def _mismatch_training():
    """The mismatch chapter's training study, from
    docs/data/mismatch_experiment/mismatch_training.json (``--mismatch-training``: three
    minutes, too long here): a table per method and the figure."""
    from opd_literate.experiment.mismatch_training import mismatch_summary
    from opd_literate.experiment.plots import write_mismatch_plot

    record = json.loads(MISMATCH_TRAINING.read_text())
    level = record["config"]["correction_level"]

    def cell(stat, digits=3):
        return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"

    for method, rows in mismatch_summary(record).items():
        lines = ["| sampler | correction | trainer's accuracy | against `fp32` "
                 f"| against `{level} none` | sampler's accuracy | against `{level} none` "
                 "| KL(sampler ‖ trainer) | tokens weighted |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in rows:
            sampler, _, correction = row["name"].partition(" ")
            correction = correction.replace("none, sampler reward",
                                            "none, the sampler's log-probs in the reward")
            lines.append(f"| `{sampler}` | `{correction}` | {cell(row['final_accuracy'])} | "
                         f"{cell(row['difference'])} | {cell(row['against_uncorrected'])} | "
                         f"{cell(row['final_sampler_accuracy'])} | "
                         f"{cell(row['sampler_against_uncorrected'])} | "
                         f"{row['mismatch_kl']['mean']:.2e} | "
                         f"{row['kept_fraction']['mean']:.3f} |")
        seeds = len(rows[0]["final_accuracy"]["per_seed"])
        lines += ["", f"Greedy accuracy on the {record['config']['experiment']['eval_prompts']} "
                  f"test prompts after {record['config']['steps']} steps: the mean of "
                  f"{seeds} seeds [95% percentile bootstrap]. \"Against\": the accuracy less "
                  "that of the same seed trained on policy (`fp32`), or with the "
                  f"`{level}` sampler and no correction. The sampler's accuracy: the model the "
                  f"sampler runs (for the corrections, `{level}`). KL, and the share of the "
                  "tokens whose weight in the loss is not 0: the mean over training."]
        _write(f"mismatch_training_{method}.md", "\n".join(lines) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mismatch_plot(record, pathlib.Path(tmp) / "mismatch_training_curves.svg")
        _write("mismatch_training_curves.svg", path.read_bytes())
    _write("mismatch_training_machines.md", _mismatch_machines_table(record) + "\n")


def mismatch_training_machines():
    """``[(machine, record)]``: the committed training record with the machine.json beside it,
    then each rerun's, in the order machine.json gives (then by folder name)."""
    reruns = sorted(((path.parent, json.loads(path.read_text()))
                     for path in MISMATCH_RERUNS.glob("*/machine.json")),
                    key=lambda rerun: (rerun[1].get("order", 0), rerun[0].name))
    committed = json.loads((MISMATCH_TRAINING.parent / "machine.json").read_text())
    return [(committed, json.loads(MISMATCH_TRAINING.read_text()))] + [
        (machine, json.loads((folder / "mismatch_training.json").read_text()))
        for folder, machine in reruns]


def _mismatch_machines_table(committed):
    """One row a machine and method: the paired differences the chapter's statements use."""
    from opd_literate.experiment.mismatch_training import mismatch_summary

    level = committed["config"]["correction_level"]
    columns = [(f"{name} none", "difference", f"`{name}` against `fp32`")
               for name in committed["config"]["levels"][1:]]
    columns += [(f"{level} decoupled_{name}", "against_uncorrected",
                 f"{words} against `{level} none`")
                for name, words in (("token_is", "token TIS"), ("seq_is", "sequence TIS"))]
    lines = ["| machine | method | " + " | ".join(title for _, _, title in columns) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in columns) + " |"]
    for machine, record in mismatch_training_machines():
        for method, rows in mismatch_summary(record).items():
            rows = {row["name"]: row for row in rows}
            cells = []
            for name, key, _ in columns:
                stat = rows[name][key]
                cells.append(f"{stat['mean']:.3f} [{stat['low']:.3f}, {stat['high']:.3f}]")
            lines.append(f"| {machine['label']} | `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


STRONGEST_CATALOGUE = {"decoupled_seq_is": "seq_tis", "kpop_is": "kpop", "gspo": "gspo",
                       "clip_cov": "clip_cov", "sapo": "sapo"}
"""The second study's corrections by their name in the catalogue (the exact tinylm study's
rows); ``kpop``, KPop's mask with weight 1, has no row there."""


def mismatch_strongest_records():
    """``[(machine, record)]`` of the second training study, in machine.json's order."""
    found = [(json.loads(path.read_text()), path.parent)
             for path in MISMATCH_STRONGEST.glob("*/machine.json")]
    found.sort(key=lambda item: (item[0].get("order", 0), item[1].name))
    return [(machine, json.loads((folder / "mismatch_training.json").read_text()))
            for machine, folder in found]


def _mismatch_strongest():
    """The second training study's table: per method and condition, with each kernel set, the
    final accuracy and its paired difference to the uncorrected ``int4`` run, the share of
    tokens weighted, and the exact tinylm study's relative RMSE with 64 answers."""
    from opd_literate.experiment.mismatch_training import mismatch_summary

    records = mismatch_strongest_records()
    exact = {r["name"]: r for r in
             json.loads(TINYLM_MISMATCH.read_text())["estimators"]["int4"]["tinylm"]}
    tables = [(machine, {method: {row["name"]: row for row in rows}
                         for method, rows in mismatch_summary(record).items()})
              for machine, record in records]

    def cell(stat):
        return f"{stat['mean']:.3f} [{stat['low']:.3f}, {stat['high']:.3f}]"

    short = {"AVX512": "AVX-512", "DEFAULT": "baseline"}
    header = ["method", "condition"]
    for machine, _ in tables:
        kernels = short.get(machine["torch_cpu_capability"], machine["torch_cpu_capability"])
        header += [f"accuracy ({kernels})", f"against `int4 none` ({kernels})",
                   f"tokens weighted ({kernels})"]
    header.append("exact relative RMSE, N = 64")
    lines = ["| " + " | ".join(header) + " |",
             "| --- | --- |" + " ---: |" * (len(header) - 2)]
    names = {"rl": "RL", "opd_sampled": "OPD"}
    for method in ("rl", "opd_sampled"):
        for name in tables[0][1][method]:
            if "sampler reward" in name:
                continue
            correction = name.split(" ", 1)[1]
            cells = [names[method], f"`{name}`"]
            for _, table in tables:
                row = table[method][name]
                cells += [cell(row["final_accuracy"]), cell(row["against_uncorrected"]),
                          f"{row['kept_fraction']['mean']:.3f}"]
            catalogue = STRONGEST_CATALOGUE.get(correction)
            if name == "int4 none":
                catalogue = "naive"
            cells.append(f"{exact[catalogue]['rel_rmse']:.3f}" if catalogue else "")
            lines.append("| " + " | ".join(cells) + " |")
    seeds = len(records[0][1]["methods"]["rl"]["int4 none"]["accuracy"])
    lines += ["", f"Greedy accuracy on the test prompts after {records[0][1]['config']['steps']} "
              f"steps: the mean of {seeds} seeds [95% percentile bootstrap]; \"against\": less "
              "the same seed's uncorrected `int4` run. Tokens weighted: the share whose weight in "
              "the loss is not 0, over training. The exact relative RMSE: the catalogue's row "
              "of the same estimator in the exact tinylm study at `int4` (`naive` for no "
              "correction; none for the on-policy run, or for KPop's mask with weight 1, which the "
              "catalogue does not hold)."]
    _write("mismatch_strongest_table.md", "\n".join(lines) + "\n")


# Each generator with the names it writes (fnmatch patterns): a build runs the generators whose
# files its pages use (docs/hooks/_built.py), which for mkdocs.yml is every one.
GENERATORS = (
    (_estimators, ("estimators_table.md", "estimators_table_baseline.md", "mismatch_sweep.svg",
                   "rmse_vs_batch.svg")),
    (_opd_mismatch, ("opd_mismatch_table.md", "opd_mismatch.svg")),
    (_ar_estimators, ("ar_estimators_table.md",)),
    (_ar_opd, ("ar_opd_table.md",)),
    (_ar_bias_against_length, ("ar_bias_vs_length.svg",)),
    (_ar_reductions, ("ar_reductions_table.md",)),
    (_k_estimators, ("k_estimators_table.md",)),
    (_experiment, ("experiment_*",)),
    (_gradient_agreement, ("gradient_agreement.md",)),
    (_handout, ("handout_*",)),
    (_topk, ("topk_bias_table.md", "topk_bias.svg")),
    (_engine, ("engine_temperature_table.md", "engine_top_p_table.md", "engine_bias.svg",
               "engine_samplers_table.md", "engine_nucleus_table.md")),
    (_engine_kept_mass, ("engine_kept_mass_table.md", "engine_kept_mass_min_p_table.md")),
    (_task_rewards, ("task_rewards_table.md", "task_rewards_at_1.md", "task_rewards.svg")),
    (_groups, ("groups_table.md", "groups_by_size.md")),
    (_cross_tokenizer, ("cross_tokenizer_table.md",)),
    (_many_teachers, ("many_teachers_bias_table.md", "many_teachers_misrouting_table.md")),
    (_which_switch, ("which_switch_table.md",)),
    (_tinylm_clamps, ("tinylm_clamps_table.md",)),
    (_supports, ("supports_table.md", "supports_nemo_table.md", "supports_bias.svg")),
    (_tinylm_mismatch, ("tinylm_mismatch_table.md", "tinylm_estimators_bias.md",
                        "tinylm_estimators_rmse.md", "tinylm_estimators_bias_all.md",
                        "tinylm_opd_table.md", "tinylm_mismatch.svg")),
    (_mismatch_training, ("mismatch_training_*",)),
    (_mismatch_strongest, ("mismatch_strongest_table.md",)),
)


def on_pre_build(config):
    OUT.mkdir(exist_ok=True)
    used = _built.used_generated_files(config)
    for generator, patterns in GENERATORS:
        if _built.wanted(used, patterns):
            generator()
