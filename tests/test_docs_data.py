"""The committed experiment results and the claims the docs pages make about the numbers.

The site's experiment figures come from ``docs/data/experiment/results.json``, written by
``python -m opd_literate.run --out docs/data/experiment``. These tests fail when that file is
stale (the defaults changed) or when a sentence of the docs no longer matches the numbers.
"""

import json
import pathlib
import re

import numpy as np
import pytest
import torch

from opd_literate import estimators as E
from opd_literate.opd_mismatch import opd_mismatch_table
from opd_literate.run import DEFAULTS, METHODS, _split, build_parser, headline
from opd_literate.tinylm import V, answer_mask, answer_tokens
from opd_literate.toy import make_toy

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs/data/experiment/results.json"
EXPERIMENT_PAGE = ROOT / "docs/experiment.md"
RUN_SOURCE = ROOT / "opd_literate/run.py"


@pytest.fixture(scope="module")
def results():
    return json.loads(RESULTS.read_text())


def test_committed_results_use_the_current_defaults(results):
    assert results["config"] == json.loads(json.dumps(DEFAULTS))
    assert set(results["methods"]) == set(METHODS)
    for record in results["methods"].values():
        assert record["samples"][0] == 0
        assert len(record["samples"]) == DEFAULTS["steps"] // DEFAULTS["eval_every"] + 1


def test_experiment_page_claims(results):
    """docs/experiment.md and index.md: who reaches the target first, who never does."""
    # "Setup": the numbers the page states about the configuration.
    for key, value in dict(steps=600, batch_size=64, group=4, warmup_steps=30, eval_every=30,
                           eval_prompts=1000, lrs=[3e-4, 1e-3, 3e-3], teacher_hidden=256,
                           student_hidden=128, teacher_label_smoothing=0.1).items():
        assert DEFAULTS[key] == value, key
    # "trained briefly, to about a third of the teacher's accuracy"
    start = results["methods"]["rl"]["accuracy"][0] / results["teacher_accuracy"]
    assert 0.25 <= start <= 0.45
    table = headline(results)
    assert table["opd_full_vocab"]["samples"] is not None
    reached = {m: row["samples"] for m, row in table.items() if row["samples"] is not None}
    assert min(reached, key=reached.get) == "opd_full_vocab"
    assert table["rl"]["samples"] is None  # RL never reaches the target...
    assert all(run["samples_to_target"] is None for run in results["lr_search"]["rl"].values())
    largest = str(max(DEFAULTS["lrs"]))  # ...and collapses at the largest learning rate
    assert results["lr_search"]["rl"][largest]["final_accuracy"] < 0.1
    assert table["opd_sampled"]["samples"] > table["sft"]["samples"]  # slower than SFT here
    # "the lowest final reverse KL of the four methods"
    finals = {m: row["final_reverse_kl"] for m, row in table.items()}
    assert min(finals, key=finals.get) == "opd_full_vocab"
    # SFT's "final reverse KL on its own samples stays above both OPD methods'"
    assert finals["sft"] > max(finals["opd_sampled"], finals["opd_full_vocab"])
    # "its greedy accuracy on the held-out prompts is 1.000"
    assert f"{results['teacher_accuracy']:.3f}" == "1.000"


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
    # "so about 29% of its sampled answers to the held-out prompts hold a wrong token"
    eval_lengths = answer_mask(answer_tokens(held_out[: DEFAULTS["eval_prompts"]])).sum(1)
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
