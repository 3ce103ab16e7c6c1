"""The committed experiment results and the claims the docs pages make about the numbers.

The site's experiment figures come from ``docs/data/experiment/results.json``, written by
``python -m opd_literate.run --out docs/data/experiment``. These tests fail when that file is
stale (the defaults changed) or when a sentence of the docs no longer matches the numbers.
"""

import json
import pathlib

import numpy as np
import pytest

from opd_literate import estimators as E
from opd_literate.opd_mismatch import opd_mismatch_table
from opd_literate.run import DEFAULTS, METHODS, headline
from opd_literate.toy import make_toy

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs/data/experiment/results.json"


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
    assert table["sft"]["final_reverse_kl"] > table["opd_full_vocab"]["final_reverse_kl"]


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
