"""The committed experiment results and the claims the docs pages make about the numbers.

The site's experiment figures come from ``docs/data/experiment/results.json``, written by
``python -m opd_literate.run --out docs/data/experiment``, and the OPD chapter's
gradient-agreement table from ``docs/data/experiment/gradient_agreement.json``, written by
``python -m opd_literate.run --gradient-agreement --out docs/data/experiment``. These tests
fail when either file is stale (the defaults changed) or when a sentence of the docs no longer
matches the numbers.
"""

import json
import pathlib
import re

import numpy as np
import pytest
import torch

from opd_literate import estimators as E
from opd_literate.opd_mismatch import opd_mismatch_table
from opd_literate.run import (
    DEFAULTS,
    GRADIENT_KEYS,
    LONG,
    METHODS,
    _split,
    build_parser,
    eval_steps,
    headline,
    ratios,
)
from opd_literate.tinylm import V, answer_mask, answer_tokens
from opd_literate.toy import make_toy

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs/data/experiment/results.json"
GRADIENT_AGREEMENT = ROOT / "docs/data/experiment/gradient_agreement.json"
RESULTS_LONG = ROOT / "docs/data/experiment/long/results.json"
OPD_PAGE = ROOT / "docs/opd.md"
EXPERIMENT_PAGE = ROOT / "docs/experiment.md"
RUN_SOURCE = ROOT / "opd_literate/run.py"


@pytest.fixture(scope="module")
def results():
    return json.loads(RESULTS.read_text())


def test_committed_results_use_the_current_defaults(results):
    assert results["config"] == json.loads(json.dumps(DEFAULTS))
    assert set(results["methods"]) == set(METHODS)
    n = len(eval_steps(DEFAULTS))
    for method, record in results["methods"].items():
        assert record["samples"] == [k * DEFAULTS["batch_size"] for k in eval_steps(DEFAULTS)]
        for key in ("accuracy", "reverse_kl", "seconds"):  # every seed's curve is kept
            assert len(record[key]) == DEFAULTS["seeds"] >= 5, (method, key)
            assert all(len(curve) == n for curve in record[key]), (method, key)
        assert record["lr"] in DEFAULTS["lrs"]
        assert set(results["lr_search"][method]) == {str(lr) for lr in DEFAULTS["lrs"]}


def test_committed_long_results_use_the_current_long_config():
    long = json.loads(RESULTS_LONG.read_text())
    assert long["config"] == json.loads(json.dumps(LONG))
    assert set(long["methods"]) == set(METHODS)
    for record in long["methods"].values():
        assert record["samples"] == [k * LONG["batch_size"] for k in eval_steps(LONG)]
        assert all(len(record[key]) == LONG["seeds"] for key in ("accuracy", "reverse_kl"))


def test_experiment_page_long_regime_claims(results):
    """docs/experiment.md, "A second regime": every number and ordering it states."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    long = json.loads(RESULTS_LONG.read_text())
    assert LONG["digits"] == 3 and LONG["teacher_steps"] == 1200
    assert LONG["student_pretrain_steps"] == 600 and LONG["steps"] == 1200
    assert "76,800 student samples (1,200 steps of 64)" in page
    assert LONG["steps"] * LONG["batch_size"] == 76_800
    assert "(greedy accuracy 0.996 on the test prompts)" in page
    assert f"{long['teacher_accuracy']:.3f}" == "0.996"
    starts = [c[0] for c in long["methods"]["rl"]["accuracy"]]
    assert "68% on average" in page and round(100 * sum(starts) / len(starts)) == 68
    table, two = headline(long), headline(results)
    reached = {m: row["reached"] for m, row in table.items()}
    assert reached == {"opd_full_vocab": 5, "opd_sampled": 2, "sft": 0, "rl": 0}
    assert "Sampled-token OPD reaches it on 2 of 5 seeds" in page
    # "after 3.7 times the samples it needed with two digits"
    factor = table["opd_full_vocab"]["samples"]["mean"] / two["opd_full_vocab"]["samples"]["mean"]
    assert "after 3.7 times the samples it needed with two digits" in page
    assert round(factor, 1) == 3.7
    found = ratios(long)
    assert found["sft"]["bound"] and found["rl"]["bound"]  # "lower bounds only"
    # "SFT, which reached the target on every seed with two digits, ends here at a final
    # accuracy whose interval lies below full-vocabulary OPD's"
    assert two["sft"]["reached"] == 5
    assert table["sft"]["final_accuracy"]["high"] < table["opd_full_vocab"]["final_accuracy"]["low"]


def test_committed_gradient_agreement_uses_the_current_defaults():
    record = json.loads(GRADIENT_AGREEMENT.read_text())
    assert record["config"] == json.loads(json.dumps({k: DEFAULTS[k] for k in GRADIENT_KEYS}))
    assert set(record["cosine"]) == {"opd_sampled", "opd_full_vocab"}


def test_opd_page_gradient_agreement_claims():
    """docs/opd.md and docs/experiment.md: the full-vocabulary gradient points closer to the
    expected gradient than the sampled-token one at every batch size, by the stated factor at
    the experiment's batch size."""
    record = json.loads(GRADIENT_AGREEMENT.read_text())
    full, sampled = record["cosine"]["opd_full_vocab"], record["cosine"]["opd_sampled"]
    assert all(full[str(B)] > sampled[str(B)] for B in record["batch_sizes"])
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    stated = re.search(r"by a factor of about ([\d.]+) in cosine at the experiment's batch of "
                       r"(\d+)", page)
    B = int(stated[2])
    assert B == DEFAULTS["batch_size"] and str(B) in full
    assert round(full[str(B)] / sampled[str(B)], 1) == float(stated[1])
    opd = " ".join(OPD_PAGE.read_text().split())
    assert "estimated from 4,096" in opd and record["reference"] == 4096
    assert "averaged over 4 batches" in opd and record["repeats"] == 4


def _interval(stat):
    return stat["low"], stat["high"]


def test_experiment_page_claims(results):
    """docs/experiment.md and index.md: every number and ordering the page states."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    # "Setup": the numbers the page states about the configuration.
    for key, value in dict(seeds=5, steps=1800, batch_size=64, group=4, warmup_steps=30,
                           eval_every=25, eval_dense_until=300, eval_every_late=100,
                           val_prompts=500, eval_prompts=500, lrs=[1e-3, 3e-3],
                           teacher_hidden=256, student_hidden=128,
                           teacher_label_smoothing=0.1).items():
        assert DEFAULTS[key] == value, key
    assert "115,200 student samples (1,800 steps of 64)" in page
    assert DEFAULTS["steps"] * DEFAULTS["batch_size"] == 115_200
    table = headline(results)
    # "to about 70% of the teacher's accuracy (the 5 students start between 61% and 76%)"
    starts = [curve[0] / results["teacher_accuracy"]
              for curve in results["methods"]["rl"]["accuracy"]]
    assert round(sum(starts) / len(starts), 1) == 0.7
    assert (round(100 * min(starts)), round(100 * max(starts))) == (61, 76)
    # "Full-vocabulary OPD reaches the target first ... seed by seed first or tied with every
    # other method on all five seeds"
    assert all(row["reached"] == row["seeds"] == 5 for row in table.values())
    means = {m: row["samples"]["mean"] for m, row in table.items()}
    assert min(means, key=means.get) == "opd_full_vocab"
    full = table["opd_full_vocab"]["samples"]["per_seed"]
    for method, row in table.items():
        assert all(f <= o for f, o in zip(full, row["samples"]["per_seed"])), method
    # the ratios and their intervals, as stated
    found = ratios(results)
    assert not any(r["bound"] for r in found.values())  # every ratio measured, none a bound
    for other, text in (("sft", "(3.5 times the samples, interval 2.0 to 8.9)"),
                        ("opd_sampled", "ratio of the means is 2.8, but with an interval from "
                                        "0.9 to 7.8"),
                        ("rl", "after 8.3 times the samples of full-vocabulary OPD on average "
                               "(interval 4.1 to 21.5)")):
        r = found[other]
        assert text in page, other
        numbers = [float(x) for x in re.findall(r"\d+\.\d", text)]
        assert numbers == [round(r["mean"], 1), round(r["low"], 1), round(r["high"], 1)], other
    assert found["sft"]["low"] > 1 and found["rl"]["low"] > 1  # "its lead ... is clear"
    assert found["opd_sampled"]["low"] < 1 < found["opd_sampled"]["high"]  # "do not settle it"
    # "ends with the lowest reverse KL, its interval below every other method's"
    kl = {m: row["final_reverse_kl"] for m, row in table.items()}
    assert all(kl["opd_full_vocab"]["high"] < kl[m]["low"] for m in kl if m != "opd_full_vocab")
    # RL "gets there last ... on every seed"
    rl = table["rl"]["samples"]["per_seed"]
    for method, row in table.items():
        if method != "rl":
            assert all(o < r for o, r in zip(row["samples"]["per_seed"], rl)), method
    # "At the larger learning rate RL collapses: every seed ends below 60% accuracy on the
    # validation prompts", below where the students start (61% to 76% on the test prompts)
    larger = str(max(DEFAULTS["lrs"]))
    collapsed = max(results["lr_search"]["rl"][larger]["val_final_accuracy"])
    assert collapsed < 0.6 and collapsed < min(c[0] for c in results["methods"]["rl"]["accuracy"])
    assert results["methods"]["rl"]["lr"] == min(DEFAULTS["lrs"])
    # "Sampled-token OPD and SFT cannot be told apart ... their intervals overlap"
    a, b = _interval(table["opd_sampled"]["samples"]), _interval(table["sft"]["samples"])
    assert a[0] <= b[1] and b[0] <= a[1]
    # SFT's "final reverse KL on its own samples stays above full-vocabulary OPD's"
    assert kl["sft"]["mean"] > kl["opd_full_vocab"]["mean"]
    # "its greedy accuracy on the test prompts is 1.000"
    assert f"{results['teacher_accuracy']:.3f}" == "1.000"
    # index.md: "RL with a 0/1 reward gets there last, after about 8 times as many samples"
    index = " ".join((ROOT / "docs/index.md").read_text().split())
    assert "gets there last, after about 8 times as many samples" in index
    assert round(found["rl"]["mean"]) == 8 and "5 seeds each" in index
    assert max(means, key=means.get) == "rl"


def test_experiment_page_setup_claims():
    """docs/experiment.md, Setup and What it says: statements about the configuration."""
    # "RL answers the first 16 of them, 4 times each, so that it too uses 64 samples a step"
    assert DEFAULTS["batch_size"] // DEFAULTS["group"] == 16 and DEFAULTS["group"] == 4
    # "the answers end at <eos> after 2, 3 or 4 tokens": variable lengths in the data
    train_pairs, held_out = _split(DEFAULTS)
    lengths = answer_mask(answer_tokens(held_out)).sum(1)
    assert set(lengths.long().tolist()) == {2, 3, 4}
    # "a teacher at the optimum of its loss puts probability 0.9 + 0.1/14 ~ 0.907 on each right
    # token": minimise the label-smoothed cross-entropy of one position over free logits.
    epsilon = DEFAULTS["teacher_label_smoothing"]
    logits = torch.zeros(V, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([logits], max_iter=200, tolerance_grad=1e-12,
                                  tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        log_p = torch.log_softmax(logits, -1)
        loss = -(1 - epsilon) * log_p[3] - epsilon * log_p.mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    p_right = float(torch.softmax(logits.detach(), -1)[3])
    assert abs(p_right - (0.9 + 0.1 / 14)) < 1e-6 and round(p_right, 3) == 0.907
    # "so about 29% of its sampled answers to the test prompts hold a wrong token"
    test = held_out[DEFAULTS["val_prompts"]: DEFAULTS["val_prompts"] + DEFAULTS["eval_prompts"]]
    eval_lengths = answer_mask(answer_tokens(test)).sum(1)
    wrong = float((1 - p_right ** eval_lengths.double()).mean())
    assert round(wrong, 2) == 0.29


def _stated_times(text):
    """The run times a text states, as "about N s" figures."""
    return re.findall(r"about (\d+) s", text)


def test_run_times_are_stated_once_and_agree():
    """The default and quick run times: docs/experiment.md's Rerun block, the DEFAULTS and QUICK
    docstrings and the --quick help state the same measured figures, and nothing else on the
    page states another (the page once said "two minutes" and "about 90 s")."""
    page = EXPERIMENT_PAGE.read_text()
    rerun = page[page.index("## Rerun it"):]
    default_line = next(line for line in rerun.splitlines() if line.startswith(
        "python -m opd_literate.run  "))
    quick_line = next(line for line in rerun.splitlines() if "--quick" in line)
    default_times, quick_times = _stated_times(default_line), _stated_times(quick_line)
    assert default_times and quick_times
    assert "minute" not in page and _stated_times(page[:page.index("## Rerun it")]) == []
    source = RUN_SOURCE.read_text()
    defaults_doc = source[source.index('"""The default experiment'):]
    defaults_doc = defaults_doc[: defaults_doc.index('"""', 3)]
    quick_doc = source[source.index('"""``--quick``'):]
    quick_doc = quick_doc[: quick_doc.index('"""', 3)]
    assert _stated_times(defaults_doc) == default_times
    assert _stated_times(quick_doc) == quick_times
    help_text = " ".join(build_parser().format_help().split())
    assert _stated_times(help_text) == quick_times


def test_mismatch_page_claims():
    """docs/mismatch.md: the bullet points under the exact comparison table."""
    rows = {r["name"]: r for r in E.comparison_table(make_toy(), N=64)}
    assert rows["seq_is"]["rel_rmse"] > rows["naive"]["rel_rmse"]
    assert rows["geo_rs"]["seq_frac"] > 0.95 and rows["k3_seq_rs"]["seq_frac"] > 0.95
    assert rows["ppo_clip_bypass"]["rel_bias"] > rows["naive"]["rel_bias"]
    toy = make_toy()
    np.testing.assert_array_equal(E.icepop(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.cispo(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.token_veto(toy), E.naive(toy))
    # "Taking the student log-prob from the sampler is the worst choice" (at every mismatch > 0)
    opd_rows = opd_mismatch_table([0.1, 0.3, 0.5, 1.0, 1.5])
    for m in {r["mismatch"] for r in opd_rows}:
        at_m = [r for r in opd_rows if r["mismatch"] == m]
        worst = max(at_m, key=lambda r: r["rel_bias"])
        assert (worst["logp"], worst["weight"]) == ("sampler", "none"), m


def test_stated_run_times_match_the_committed_runs(results):
    """The Rerun paragraph's default-run time is the committed run's own record (``run``), and
    the command's times include it: its start-up and plots only add a few seconds."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    execution = results["run"]
    assert (execution["workers"], execution["cpus"]) == (2, 2)  # "two worker processes"
    assert results["teacher_cached"]  # "with the teacher cached"
    took = re.search(r"The default run took (\d+) s, of which (\d+) s in `run_experiment`", page)
    command, inside = int(took[1]), int(took[2])
    assert inside == round(execution["wall_seconds"])
    assert 0 <= command - inside <= 10
    raw = EXPERIMENT_PAGE.read_text()
    default_line = next(line for line in raw[raw.index("## Rerun it"):].splitlines()
                        if line.startswith("python -m opd_literate.run  "))
    assert abs(int(_stated_times(default_line)[0]) - command) <= 5  # "about"
    quick, quick_first = map(int, re.search(
        r"The `--quick` run took (\d+) s, and (\d+) s the first time", page).groups())
    readme = " ".join((ROOT / "README.md").read_text().split())
    long = json.loads(RESULTS_LONG.read_text())
    stated_long = int(re.search(r"The `--long` run took (\d+) s with its teacher cached", page)[1])
    # the README states the same figures
    assert (f"the default run {command} s with the teacher cached; `--quick` {quick} s "
            f"({quick_first} s the first time, which trains its teacher); `--long` "
            f"{stated_long} s with its teacher cached") in readme
    assert long["teacher_cached"] and long["run"]["workers"] == 2
    assert 0 <= stated_long - long["run"]["wall_seconds"] <= 10
