"""The committed experiment results and the claims the docs pages make about the numbers.

The site's experiment figures come from ``docs/data/experiment/results.json``, written by
``python -m opd_literate.experiment --out docs/data/experiment``, and the OPD chapter's
gradient-agreement table from ``docs/data/experiment/gradient_agreement.json``, written by
``python -m opd_literate.experiment --gradient-agreement --out docs/data/experiment``. The same
commands rerun on other machines are committed under ``docs/data/experiment/reruns/NAME/``
(``results.json``, ``long/results.json``, ``gradient_agreement.json`` and ``machine.json``), and
the experiment page's claims are checked against the committed run and every rerun: a sentence
that would be false on one of the machines fails. These tests fail when a file is stale (the
defaults changed) or when a sentence of the docs no longer matches the numbers.
"""

import json
import math
import pathlib
import re

import numpy as np
import pytest
import torch

from opd_literate.experiment.cli import build_parser
from opd_literate.experiment.config import DEFAULT as DEFAULT_CONFIG
from opd_literate.experiment.config import LONG as LONG_CONFIG
from opd_literate.experiment.config import METHODS, eval_steps
from opd_literate.experiment.run import GRADIENT_KEYS, _split
from opd_literate.experiment.stats import headline, ratios
from opd_literate.experiment.tinylm import V, answer_mask, answer_tokens
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.opd_mismatch import opd_mismatch_table
from opd_literate.mismatch.toy import make_toy
from tests.helpers.committed import FLOAT64_SUMS, assert_matches_committed

# The configurations as results.json records them (ExperimentConfig.as_dict)
DEFAULTS, LONG = DEFAULT_CONFIG.as_dict(), LONG_CONFIG.as_dict()

ROOT = pathlib.Path(__file__).resolve().parents[2]
MISMATCH_PRACTICE = ROOT / "docs" / "mismatch_practice.md"
RESULTS = ROOT / "docs/data/experiment/results.json"
GRADIENT_AGREEMENT = ROOT / "docs/data/experiment/gradient_agreement.json"
RESULTS_LONG = ROOT / "docs/data/experiment/long/results.json"
RERUNS = ROOT / "docs/data/experiment/reruns"
RERUN_NAMES = sorted(path.parent.name for path in RERUNS.glob("*/machine.json"))
MACHINES = ["committed"] + RERUN_NAMES
OPD_PAGE = ROOT / "docs/opd.md"
EXPERIMENT_PAGE = ROOT / "docs/experiment.md"
RUN_SOURCE = ROOT / "opd_literate/experiment/config.py"  # the DEFAULT and QUICK docstrings


@pytest.fixture(scope="module")
def results():
    return json.loads(RESULTS.read_text())


def _machine_files(name):
    """The committed run's files, or a rerun's: default results, --long results, gradient
    agreement."""
    if name == "committed":
        return RESULTS, RESULTS_LONG, GRADIENT_AGREEMENT
    folder = RERUNS / name
    return folder / "results.json", folder / "long/results.json", folder / "gradient_agreement.json"


def _load_machine(name):
    default, long, agreement = (json.loads(path.read_text()) for path in _machine_files(name))
    return dict(name=name, results=default, long=long, gradient_agreement=agreement)


@pytest.fixture(scope="module")
def machines():
    """Every machine's runs: the committed one first, then the reruns."""
    return [_load_machine(name) for name in MACHINES]


@pytest.fixture(scope="module", params=MACHINES)
def machine(request):
    return _load_machine(request.param)


def test_the_reruns_are_there_and_describe_their_machine():
    """At least the two reruns the page names (so no parametrization silently loses them), each
    with its machine description, which the page's Three machines section quotes."""
    assert len(RERUN_NAMES) >= 2
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    for name in RERUN_NAMES:
        machine = json.loads((RERUNS / name / "machine.json").read_text())
        for key in ("label", "cpu_model", "cpus", "simd_flags", "avx512", "ATEN_CPU_CAPABILITY",
                    "torch_cpu_capability", "torch", "numpy", "python", "commands", "seconds"):
            assert key in machine, (name, key)
        assert machine["cpus"] == 2 and "a 2-core AMD EPYC" in page
        assert machine["cpu_model"] == "AMD EPYC"
        assert "avx2" in machine["simd_flags"] and machine["avx512"] is False
        assert "with AVX2 and no AVX-512" in page
        assert f"torch {machine['torch'].split('+')[0]} and numpy {machine['numpy']}" in page
        if machine["ATEN_CPU_CAPABILITY"] is None:
            assert machine["torch_cpu_capability"] == "AVX2"
        else:
            assert machine["ATEN_CPU_CAPABILITY"] == "default" == machine[
                "torch_cpu_capability"].lower()
            assert "`ATEN_CPU_CAPABILITY=default`" in page
    capabilities = {json.loads((RERUNS / n / "machine.json").read_text())["torch_cpu_capability"]
                    for n in RERUN_NAMES}
    assert capabilities == {"AVX2", "DEFAULT"}  # "once as it is ... and once with ..."
    assert "docs/data/experiment/reruns/" in page


def test_reruns_use_the_current_configurations(machine):
    """Every run, committed or rerun, is of the current default, long and gradient-agreement
    configurations, with every method and every seed's curve."""
    for results, config in ((machine["results"], DEFAULT_CONFIG), (machine["long"], LONG_CONFIG)):
        assert results["config"] == json.loads(json.dumps(config.as_dict())), machine["name"]
        assert set(results["methods"]) == set(METHODS)
        n = len(eval_steps(config))
        for record in results["methods"].values():
            assert record["samples"] == [k * config.batch_size for k in eval_steps(config)]
            assert all(len(record[key]) == config.seeds for key in ("accuracy", "reverse_kl"))
            assert all(len(curve) == n for curve in record["accuracy"])
    agreement = machine["gradient_agreement"]
    assert agreement["config"] == json.loads(json.dumps({k: DEFAULTS[k] for k in GRADIENT_KEYS}))


def test_committed_results_use_the_current_defaults(results):
    assert results["config"] == json.loads(json.dumps(DEFAULTS))
    assert set(results["methods"]) == set(METHODS)
    n = len(eval_steps(DEFAULT_CONFIG))
    for method, record in results["methods"].items():
        assert record["samples"] == [k * DEFAULTS["batch_size"] for k in eval_steps(DEFAULT_CONFIG)]
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
        assert record["samples"] == [k * LONG["batch_size"] for k in eval_steps(LONG_CONFIG)]
        assert all(len(record[key]) == LONG["seeds"] for key in ("accuracy", "reverse_kl"))


def test_experiment_page_long_regime_claims(machine):
    """docs/experiment.md, "A second regime": every number and ordering it states, on every
    machine."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    results, long = machine["results"], machine["long"]
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
    # "after 3.7 to 3.8 times the samples it needed with two digits" (on the same machine)
    factor = table["opd_full_vocab"]["samples"]["mean"] / two["opd_full_vocab"]["samples"]["mean"]
    stated = re.search(r"after ([\d.]+) to ([\d.]+) times the samples it needed with two digits",
                       page)
    assert float(stated[1]) <= round(factor, 1) <= float(stated[2]), machine["name"]
    assert "As measured, on every machine: **only full-vocabulary OPD" in page
    found = ratios(long)
    assert found["sft"]["bound"] and found["rl"]["bound"]  # "lower bounds only"
    # "SFT, which reached the target on every seed with two digits, ends here at a final
    # accuracy whose interval lies below full-vocabulary OPD's"
    assert two["sft"]["reached"] == 5
    assert table["sft"]["final_accuracy"]["high"] < table["opd_full_vocab"]["final_accuracy"]["low"]


def test_long_regime_range_is_the_machines_spread(machines):
    """The stated range of full-vocabulary OPD's factor is the spread of the runs, no wider."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    stated = re.search(r"after ([\d.]+) to ([\d.]+) times the samples it needed with two digits",
                       page)
    factors = [round(headline(m["long"])["opd_full_vocab"]["samples"]["mean"]
                     / headline(m["results"])["opd_full_vocab"]["samples"]["mean"], 1)
               for m in machines]
    assert (min(factors), max(factors)) == (float(stated[1]), float(stated[2]))


def test_committed_gradient_agreement_uses_the_current_defaults():
    record = json.loads(GRADIENT_AGREEMENT.read_text())
    assert record["config"] == json.loads(json.dumps({k: DEFAULTS[k] for k in GRADIENT_KEYS}))
    assert set(record["cosine"]) == {"opd_sampled", "opd_full_vocab"}


def test_opd_page_gradient_agreement_claims(machine):
    """docs/opd.md and docs/experiment.md: the full-vocabulary gradient points closer to the
    expected gradient than the sampled-token one at every batch size, by the stated factor at
    the experiment's batch size, on every machine."""
    record = machine["gradient_agreement"]
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


def test_gradient_agreement_agrees_across_machines(machines):
    """docs/experiment.md: "on every machine; the cosines agree to three decimals"."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    assert "(on every machine; the cosines agree to three decimals)" in page
    first = machines[0]["gradient_agreement"]["cosine"]
    for other in machines[1:]:
        for method, row in other["gradient_agreement"]["cosine"].items():
            for size, cosine in row.items():
                assert abs(cosine - first[method][size]) < 5e-4, (other["name"], method)


def _interval(stat):
    return stat["low"], stat["high"]


def _stated(page, pattern):
    """The numbers a sentence of the page states, found by ``pattern``, as floats."""
    found = re.search(pattern, page)
    assert found, pattern
    return [float(x) for x in found.groups()]


RL_RATIO = (r"after ([\d.]+) to ([\d.]+) times the samples of full-vocabulary OPD on average, "
            r"depending on the machine, each with an interval inside ([\d.]+) to ([\d.]+):")
RL_BOUND = r"the ratio is a lower bound \(at least ([\d.]+) on that machine\)"
RL_REACHED = r"RL reaches the target on (\d) or (\d) of the 5 seeds, depending on the machine"
SAMPLED_RATIO = (r"Over sampled-token OPD the ratio of the means is ([\d.]+) to ([\d.]+) "
                 r"depending on the machine, with intervals whose lower ends lie at about 1 "
                 r"\(from ([\d.]+) to ([\d.]+)\), on one side of 1 or the other")


def test_experiment_page_claims(machine):
    """docs/experiment.md: every number and ordering of *What it says*, on every machine (the
    committed run and each rerun)."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    results, name = machine["results"], machine["name"]
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
    # other method on all five seeds"; every method but RL reaches it on every seed
    low_rl, high_rl = _stated(page, RL_REACHED)
    for method, row in table.items():
        if method == "rl":
            assert low_rl <= row["reached"] <= high_rl == row["seeds"], name
        else:
            assert row["reached"] == row["seeds"] == 5, (name, method)
    means = {m: row["samples"]["mean"] for m, row in table.items() if row["samples"]}
    assert min(means, key=means.get) == "opd_full_vocab"
    budget = DEFAULTS["steps"] * DEFAULTS["batch_size"]

    def per_seed(method):  # a seed that never reaches the target: after the budget
        return [budget + 1 if v is None else v for v in table[method]["samples_per_seed"]]

    full = per_seed("opd_full_vocab")
    for method in table:
        assert all(f <= o for f, o in zip(full, per_seed(method))), (name, method)
    found = ratios(results)
    # "Its lead over SFT (3.5 times the samples, interval 2.0 to 8.9, on every machine)"
    assert "SFT (3.5 times the samples, interval 2.0 to 8.9, on every machine)" in page
    sft = found["sft"]
    assert not sft["bound"]
    assert [round(sft[k], 1) for k in ("mean", "low", "high")] == [3.5, 2.0, 8.9], name
    assert sft["low"] > 1 and found["rl"]["low"] > 1  # "its lead ... is clear"
    # "Over sampled-token OPD the ratio of the means is 2.5 to 2.8 ..., with intervals whose
    # lower ends lie at about 1 (from 0.9 to 1.1)"
    mean_low, mean_high, low_low, low_high = _stated(page, SAMPLED_RATIO)
    sampled = found["opd_sampled"]
    assert not sampled["bound"] and sampled["high"] > 1
    assert mean_low <= round(sampled["mean"], 1) <= mean_high, name
    assert low_low <= round(sampled["low"], 1) <= low_high, name
    # "ends with the lowest reverse KL, its interval below every other method's"
    kl = {m: row["final_reverse_kl"] for m, row in table.items()}
    assert all(kl["opd_full_vocab"]["high"] < kl[m]["low"] for m in kl if m != "opd_full_vocab")
    # RL "gets there last: on every seed (or never, within the budget)"
    rl = per_seed("rl")
    for method in table:
        if method != "rl":
            assert all(o < r for o, r in zip(per_seed(method), rl)), (name, method)
    # "after 8.3 to 9.7 times the samples ..., each with an interval inside 4.0 to 24.9"; "where
    # a seed misses it ... the ratio is a lower bound (at least 8.5 on that machine)"
    low, high, interval_low, interval_high = _stated(page, RL_RATIO)
    r = found["rl"]
    assert low <= round(r["mean"], 1) <= high, name
    assert interval_low <= round(r["low"], 1) and round(r["high"], 1) <= interval_high, name
    assert r["bound"] == (table["rl"]["reached"] < table["rl"]["seeds"])
    if r["bound"]:
        assert round(r["mean"], 1) == _stated(page, RL_BOUND)[0], name
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


def test_experiment_page_ranges_are_the_machines_spread(machines):
    """The ranges *What it says* states are the spread of the committed run and the reruns:
    each end is one machine's figure (a range wider than the runs would hide a change), RL's
    seeds at the target span the stated counts, and the lower ends of the sampled-token
    ratio's intervals lie on both sides of 1 ("on one side of 1 or the other")."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    found = [ratios(m["results"]) for m in machines]
    rl = [r["rl"] for r in found]
    low, high, interval_low, interval_high = _stated(page, RL_RATIO)
    assert (min(round(r["mean"], 1) for r in rl), max(round(r["mean"], 1) for r in rl)) == (
        low, high)
    assert min(round(r["low"], 1) for r in rl) == interval_low
    assert max(round(r["high"], 1) for r in rl) == interval_high
    reached = {headline(m["results"])["rl"]["reached"] for m in machines}
    assert reached == set(_stated(page, RL_REACHED))  # "on 4 or 5 of the 5 seeds"
    sampled = [r["opd_sampled"] for r in found]
    mean_low, mean_high, low_low, low_high = _stated(page, SAMPLED_RATIO)
    assert (min(round(r["mean"], 1) for r in sampled),
            max(round(r["mean"], 1) for r in sampled)) == (mean_low, mean_high)
    assert (min(round(r["low"], 1) for r in sampled),
            max(round(r["low"], 1) for r in sampled)) == (low_low, low_high)
    assert min(r["low"] for r in sampled) < 1 < max(r["low"] for r in sampled)


@pytest.mark.parametrize("machine", MACHINES)
def test_index_headline_holds_on_every_machine(machines, machine):
    """docs/index.md: full-vocabulary OPD first, "RL with a 0/1 reward gets there last, after 8
    to 10 times as many samples (on each of the three machines measured; on one, an RL seed
    misses the target within the budget, so there the ratio is a lower bound)"."""
    index = " ".join((ROOT / "docs/index.md").read_text().split())
    assert "gets there last, after 8 to 10 times as many samples (on each of the three " in index
    assert "5 seeds each" in index
    assert len(machines) == 3
    results = next(m for m in machines if m["name"] == machine)["results"]
    # The ratios to full-vocabulary OPD; a method with a seed short of the target has a lower
    # bound (the budget counted for the miss), which still orders it.
    found = ratios(results)
    assert all(r["mean"] > 1 for r in found.values()), found  # full-vocabulary OPD first
    assert max(found, key=lambda m: found[m]["mean"]) == "rl", found  # RL last
    assert 8 <= found["rl"]["mean"] <= 10, found["rl"]
    bounded = [m["name"] for m in machines if ratios(m["results"])["rl"]["bound"]]
    assert len(bounded) == 1, bounded  # "on one, an RL seed misses the target"


def _largest_difference(machines, regime, method, key="accuracy"):
    """The largest difference of a method's curves (``key``) of any rerun from the committed
    run's, at any seed and evaluation point."""
    committed = np.array(machines[0][regime]["methods"][method][key])
    return max(float(np.abs(np.array(m[regime]["methods"][method][key]) - committed).max())
               for m in machines[1:])


def test_three_machines_section_claims(machines):
    """docs/experiment.md, "Three machines, one study": what repeats across the machines and
    what moves, by how much."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    section = page[page.index("## Three machines, one study"):page.index("## Rerun it")]
    committed = machines[0]
    # "the teachers' accuracies (1.000 and 0.996)"
    assert "the teachers' accuracies (1.000 and 0.996)" in section
    for m in machines:
        assert f"{m['results']['teacher_accuracy']:.3f}" == "1.000", m["name"]
        assert f"{m['long']['teacher_accuracy']:.3f}" == "0.996", m["name"]
    # "the students' starting accuracies with two digits (with three, within 0.002)"
    assert "starting accuracies with two digits (with three, within 0.002)" in section
    long_moved = 0.0
    for m in machines:
        for method in METHODS:
            starts = [c[0] for c in m["results"]["methods"][method]["accuracy"]]
            assert starts == [c[0] for c in committed["results"]["methods"][method]["accuracy"]]
            long_starts = np.array([c[0] for c in m["long"]["methods"][method]["accuracy"]])
            reference = [c[0] for c in committed["long"]["methods"][method]["accuracy"]]
            long_moved = max(long_moved, float(np.abs(long_starts - reference).max()))
    assert 0 < long_moved and round(long_moved, 3) <= 0.002
    # "full-vocabulary OPD's accuracy curves with two digits, at its chosen learning rate, bit
    # for bit (its reverse KLs by less than 0.0001)"
    assert ("at its chosen learning rate, bit for bit (its reverse KLs by less than 0.0001)"
            in section)
    for m in machines[1:]:
        record = m["results"]["methods"]["opd_full_vocab"]
        assert record["lr"] == committed["results"]["methods"]["opd_full_vocab"]["lr"]
        assert record["accuracy"] == committed["results"]["methods"]["opd_full_vocab"]["accuracy"]
    assert 0 < _largest_difference(machines, "results", "opd_full_vocab", "reverse_kl") < 1e-4
    # "SFT's samples to the target on every seed"
    assert "SFT's samples to the target on every seed" in section
    for m in machines:
        assert (headline(m["results"])["sft"]["samples_per_seed"]
                == headline(committed["results"])["sft"]["samples_per_seed"]), m["name"]
    # "every other method's curves differ from step 50 or 75 on"
    assert "every other method's curves differ from step 50 or 75 on" in section
    first_steps = set()
    for m in machines[1:]:
        for method in ("opd_sampled", "sft", "rl"):
            ours = np.array(m["results"]["methods"][method]["accuracy"])
            theirs = np.array(committed["results"]["methods"][method]["accuracy"])
            differs = (ours != theirs).any(0)
            assert differs.any(), (m["name"], method)
            first = int(np.argmax(differs))
            first_steps.add(committed["results"]["methods"][method]["samples"][first]
                            // DEFAULTS["batch_size"])
    assert first_steps == {50, 75}
    # "SFT's stay within 0.006 ...: sampled-token OPD by up to 0.096 and RL by up to 0.196"
    for method, text in (("sft", "SFT's stay within {:.3f} of the committed run's"),
                         ("opd_sampled", "sampled-token OPD by up to {:.3f}"),
                         ("rl", "RL by up to {:.3f}")):
        assert text.format(_largest_difference(machines, "results", method)) in section, method
    # "With three digits every method moves, full-vocabulary OPD by up to 0.014"
    assert all(_largest_difference(machines, "long", method) > 0 for method in METHODS)
    assert ("With three digits every method moves, full-vocabulary OPD by up to "
            f"{_largest_difference(machines, 'long', 'opd_full_vocab'):.3f}") in section


def test_experiment_page_setup_claims():
    """docs/experiment.md, Setup and What it says: statements about the configuration."""
    # "RL answers the first 16 of them, 4 times each, so that it too uses 64 samples a step"
    assert DEFAULTS["batch_size"] // DEFAULTS["group"] == 16 and DEFAULTS["group"] == 4
    # "the answers end at <eos> after 2, 3 or 4 tokens": variable lengths in the data
    train_pairs, held_out = _split(DEFAULT_CONFIG)
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
        "python -m opd_literate.experiment  "))
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
    assert _stated_times(help_text) == quick_times  # committed-exact: strings of cli.py's help


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
    np.testing.assert_array_equal(E.dppo_tv(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.dppo_kl(toy), E.token_is(toy))
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
                        if line.startswith("python -m opd_literate.experiment  "))
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


def test_stated_rerun_times_match_the_reruns():
    """The Rerun paragraph's times on the EPYC: each is the rerun's own record, the command's
    time from ``time`` (machine.json) and the time in ``run_experiment`` (results.json)."""
    page = " ".join(EXPERIMENT_PAGE.read_text().split())
    for name in RERUN_NAMES:
        machine = json.loads((RERUNS / name / "machine.json").read_text())
        default, long, _ = (json.loads(p.read_text()) for p in _machine_files(name))
        assert default["teacher_cached"] and long["teacher_cached"]
        assert default["run"]["workers"] == default["run"]["cpus"] == 2
        seconds = machine["seconds"]
        assert seconds["default"] - 10 <= default["run"]["wall_seconds"] <= seconds["default"]
        assert seconds["long"] - 10 <= long["run"]["wall_seconds"] <= seconds["long"]
        if machine["ATEN_CPU_CAPABILITY"] is None:
            text = (f"the default run took {round(seconds['default'])} s, of which "
                    f"{round(default['run']['wall_seconds'])} s in `run_experiment`, and the "
                    f"`--long` run {round(seconds['long'])} s")
        else:
            text = (f"with `ATEN_CPU_CAPABILITY=default`, {round(seconds['default'])} s "
                    f"({round(default['run']['wall_seconds'])} s in `run_experiment`) and "
                    f"{round(seconds['long'])} s")
        assert text in page, name
        if machine["ATEN_CPU_CAPABILITY"] is None:  # the README states the same EPYC figures
            readme = " ".join((ROOT / "README.md").read_text().split())
            assert (f"On a 2-core AMD EPYC with AVX2 the default run took "
                    f"{round(seconds['default'])} s and `--long` {round(seconds['long'])} s"
                    in readme), name


def test_the_home_pages_chapter_list_is_the_navigations():
    """The numbered list under "The chapters" names the pages of the navigation's "Chapters",
    in its order, with the same titles."""
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    chapters = next(item["Chapters"] for item in config["nav"] if "Chapters" in item)
    nav = [(title, page) for entry in chapters for title, page in entry.items()]
    home = (ROOT / "docs" / "index.md").read_text()
    section = home.split("## The chapters", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. \[([^\]]+)\]\(([^)]+)\)", section, re.M)
    assert listed == nav


def test_every_chapter_opens_with_what_it_assumes_and_its_key_equations():
    """Before its first section, each page of the navigation's "Chapters" says what it assumes
    the reader knows and shows its key equations (a display formula in the box)."""
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    chapters = next(item["Chapters"] for item in config["nav"] if "Chapters" in item)
    for entry in chapters:
        (page,) = entry.values()
        opening = (ROOT / "docs" / page).read_text().split("\n## ", 1)[0]
        assert '!!! info "What this chapter assumes"' in opening, page
        box = opening.split('!!! abstract "Key equations"', 1)
        assert len(box) == 2 and "$$" in box[1], page


def test_no_wrapped_line_of_prose_starts_a_heading_by_accident():
    """A hard-wrapped "issue\\n#4159" renders as a heading: every "#" heading has a space."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        in_code = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if not in_code and re.match(r"#+[^#\s]", line):
                raise AssertionError(f"{page.name}:{number} starts with {line[:20]!r}")


CLAMP_STUDY = ROOT / "docs/data/experiment/clamp_study.json"


def _clamp_study_claims(record):
    """The large-vocabulary chapter's sentences under its tinylm clamp table (one reader of
    them, shared with tests/experiment/test_exact.py)."""
    from tests.experiment.test_exact import tinylm_clamp_claims

    tinylm_clamp_claims(record, (ROOT / "docs" / "large_vocab.md").read_text())


def test_committed_clamp_study_uses_the_current_defaults_and_backs_the_chapter():
    from opd_literate.experiment.exact import CLAMP_STUDY_KEYS

    record = json.loads(CLAMP_STUDY.read_text())
    expected = {k: getattr(DEFAULT_CONFIG, k) for k in CLAMP_STUDY_KEYS}
    assert record["config"] == json.loads(json.dumps(expected))
    assert len({row["seed"] for row in record["rows"]}) == DEFAULTS["seeds"]
    _clamp_study_claims(record)


@pytest.mark.slow
def test_the_clamp_study_recomputed_here_backs_the_chapter_too():
    """Recomputed on this machine (the weights differ across CPUs by rounding): the same claims."""
    from opd_literate.experiment.exact import clamp_study_record

    _clamp_study_claims(clamp_study_record(DEFAULT_CONFIG))


def test_numbered_equations_are_numbered_in_order_and_each_is_referred_to():
    """A chapter numbers a display (\\tag{N}) only where its text refers to it, [(N)](#eq-N)."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        tags = [int(n) for n in re.findall(r"\\tag\{(\d+)\}", text)]
        links = {int(n) for n in re.findall(r"\]\(#eq-(\d+)\)", text)}
        assert tags == list(range(1, len(tags) + 1)), (page.name, tags)
        assert links == set(tags), (page.name, sorted(links), tags)


def test_every_display_is_a_paragraph_of_its_own():
    """arithmatex leaves a $$ block followed by text on the next line as raw TeX in the page."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        inside = False
        for number, line in enumerate(lines, 1):
            if line.strip() != "$$":
                continue
            inside = not inside
            if not inside and number < len(lines):
                following = lines[number]  # the line after the closing $$
                assert following.strip() == "", f"{page.name}:{number + 1}: text after a display"


TINYLM_MISMATCH = ROOT / "docs/data/experiment/tinylm_mismatch.json"
# The mismatch chapter's studies rerun with other kernels: one folder a machine, each with its
# machine.json, mismatch_training.json and tinylm_mismatch.json
MISMATCH_RERUNS = ROOT / "docs/data/mismatch_experiment/reruns"
MISMATCH_RERUN_NAMES = sorted(path.parent.name for path in MISMATCH_RERUNS.glob("*/machine.json"))


def _tinylm_mismatch_claims(record, spread=0.0):
    """The sentences of the mismatch chapter's section "The mismatch on a trained model".

    ``spread``: how far a rank correlation the page states to two decimals may lie from it
    beyond that rounding (0 for the committed records it is read from; a record recomputed on
    another CPU, whose students' weights differ in their last bits, moves it)."""
    m, est, opd = record["mismatch"], record["estimators"], record["opd"]
    order = ["fp32", "fp16", "bf16", "int8", "int4"]
    for student in range(len(record["seeds"])):  # every student ranks the samplers alike
        kls = [m[s][student]["kl"] for s in order]
        assert kls == sorted(kls)
        for toy in ("toy", "ar_toy"):  # int4 within a factor of 4 of the toys; bf16 500x below
            assert 1 / 4 < m["int4"][student]["kl"] / record["toy_b"][toy]["kl"] < 4
            assert m["bf16"][student]["kl"] * 500 < record["toy_b"][toy]["kl"]
    assert min(x["kurtosis"] for s in m for x in m[s]) > 7
    assert max(record["toy_b"][toy]["kurtosis"] for toy in ("toy", "ar_toy")) <= 3
    assert m["int4"][0]["abs_quantiles"]["0.999"] > 2 > m["int4"][0]["abs_quantiles"]["0.99"]

    # every record holds every estimator of the catalogue (test_committed_tinylm_mismatch_...)
    def by_name(sampler, kind="tinylm"):
        return {r["name"]: r for r in est[sampler][kind]}

    for sampler in order:
        assert by_name(sampler)["seq_is"]["rel_bias"] < 1e-12
    for kind in ("tinylm", "toy", "ar_toy"):  # seq_is's RMSE above naive's at int4
        rows = by_name("int4", kind)
        assert rows["seq_is"]["rel_rmse"] > rows["naive"]["rel_rmse"]
        assert rows["ppo_clip_bypass"]["rel_bias"] > rows["naive"]["rel_bias"]
    for sampler in ("bf16", "int8"):
        rows = by_name(sampler)
        assert abs(rows["seq_is"]["rel_rmse"] / rows["naive"]["rel_rmse"] - 1) < 0.01
        bands = ("geo_rs", "geo_rs_token_tis", "seq_mask_tis", "gspo")
        assert all(0.89 < r["rel_rmse"] < 0.91 for name, r in rows.items() if name not in bands)
    assert 0.6 < by_name("bf16")["geo_rs"]["seq_frac"] < 0.7
    assert all(by_name(s)["geo_rs"]["seq_frac"] > 0.95 for s in ("int8", "int4"))
    assert all(by_name(s)["geo_rs"]["rel_bias"] > 0.87 for s in ("bf16", "int8", "int4"))
    assert by_name("fp16")["geo_rs"]["seq_frac"] < 0.1
    # int4: the token ratio halves naive's bias on both toys, not on tinylm
    for kind in ("toy", "ar_toy"):
        rows = by_name("int4", kind)
        assert rows["token_is"]["rel_bias"] < rows["naive"]["rel_bias"] / 2
    rows = by_name("int4")
    assert rows["cispo"]["rel_bias"] == rows["token_is"]["rel_bias"] > rows["naive"]["rel_bias"]
    assert max(rows["token_tis"]["rel_bias"], rows["token_clamp"]["rel_bias"]) < \
        rows["token_is"]["rel_bias"]
    biased = sorted(r["rel_bias"] for r in rows.values() if r["rel_bias"] > 1e-12)
    # the sequence ratio truncated at 3, then at 2
    assert [rows["trl_sequence_truncate"]["rel_bias"], rows["seq_tis"]["rel_bias"]] == biased[:2]
    # the rank correlation of the chapter's table: over its estimators (a recomputed record's
    # own value is over every estimator of REGISTRY)
    from opd_literate.experiment.quantized import rank_correlation

    tiny = by_name("int8")
    for kind in ("ar_toy", "toy"):  # "(rank correlation 0.95)"
        toy_rows = by_name("int8", kind)
        value = rank_correlation([tiny[k]["rel_bias"] for k in sorted(tiny)],
                                 [toy_rows[k]["rel_bias"] for k in sorted(tiny)])
        assert abs(value - 0.95) <= 0.005 + spread, (kind, value)
    assert by_name("int8")["gspo"]["rel_bias"] > 1
    assert by_name("int8", "toy")["gspo"]["rel_bias"] < 1
    assert by_name("int8", "ar_toy")["gspo"]["rel_bias"] < 1
    # the bias over every parameter of the student
    from opd_literate.experiment.quantized import rank_correlation

    for sampler in order:
        assert by_name(sampler)["seq_is"]["rel_bias_all"] < 1e-10
    for sampler, stated in (("bf16", 0.89), ("int8", 1.00), ("int4", 0.95)):
        rows = est[sampler]["tinylm"]
        value = rank_correlation([r["rel_bias_all"] for r in rows], [r["rel_bias"] for r in rows])
        assert abs(value - stated) <= 0.005 + spread, (sampler, value)
    for r in est["fp16"]["tinylm"]:
        if r["name"] in FP16_EXACT:
            assert r["rel_bias_all"] < 1e-10
    # the others at fp16: their spread across machines, _tinylm_fp16_rel_bias_all below
    rows = by_name("int4")
    assert rows["token_is"]["rel_bias_all"] > rows["naive"]["rel_bias_all"]
    biased = sorted(r["rel_bias_all"] for r in rows.values() if r["rel_bias_all"] > 1e-10)
    assert [rows["trl_sequence_truncate"]["rel_bias_all"],
            rows["seq_tis"]["rel_bias_all"]] == biased[:2]
    assert by_name("int8")["gspo"]["rel_bias_all"] < 1 < by_name("int8")["gspo"]["rel_bias"]
    for sampler in ("bf16", "fp16", "int8", "int4"):  # OPD
        recipe = {(r["logp"], r["weight"]): r["rel_bias"] for r in opd[sampler]}
        assert recipe[("sampler", "none")] > recipe[("trainer", "none")]
        assert recipe[("sampler", "token_tis")] > recipe[("trainer", "token_tis")]
        assert recipe[("trainer", "token_is")] > 1e-4
        assert recipe[("trainer", "prefix_is")] < 1e-12 and recipe[("trainer", "seq_is")] < 1e-12


# The estimators that weight a response by its whole sequence ratio, which at fp16's mismatch no
# truncation or mask reaches (TRL's bounds 3 and, for the mask, none below): unbiased there.
FP16_EXACT = ("seq_is", "seq_tis", "seq_mis", "trl_sequence_truncate", "trl_sequence_mask")


def _tinylm_fp16_rel_bias_all(record):
    """``{name: rel_bias_all}`` at fp16 of the biased estimators but gspo (the exact ones of
    ``FP16_EXACT`` left out): the values the chapter states with their spread across machines."""
    return {r["name"]: r["rel_bias_all"] for r in record["estimators"]["fp16"]["tinylm"]
            if r["name"] not in FP16_EXACT + ("gspo",)}


# The stated range of the fp16 relative biases over every parameter, parsed from the page
FP16_RANGE = r"and between (0\.\d+) and (0\.\d+) over both\. At the first student's"


def _tinylm_records():
    """The committed tinylm_mismatch.json, then each rerun's (under the training study's
    reruns, one folder a machine)."""
    return [("committed", json.loads(TINYLM_MISMATCH.read_text()))] + [
        (name, json.loads((MISMATCH_RERUNS / name / "tinylm_mismatch.json").read_text()))
        for name in MISMATCH_RERUN_NAMES]


@pytest.mark.parametrize("name", MISMATCH_RERUN_NAMES)
def test_every_tinylm_mismatch_rerun_backs_the_chapter(name):
    """Each rerun of ``--tinylm-mismatch`` (docs/data/mismatch_experiment/reruns/NAME/) is of the
    current configuration, and every claim of the section holds on it."""
    from opd_literate.experiment.exact import CLAMP_STUDY_KEYS
    from opd_literate.experiment.quantized import SAMPLERS

    record = json.loads((MISMATCH_RERUNS / name / "tinylm_mismatch.json").read_text())
    expected = {k: getattr(DEFAULT_CONFIG, k) for k in CLAMP_STUDY_KEYS}
    assert record["config"] == json.loads(json.dumps(expected))
    assert record["samplers"] == SAMPLERS and record["prompts"] == 20
    _tinylm_mismatch_claims(record)


def test_the_tinylm_fp16_sentence_states_the_machines_spread():
    """"At `fp16` ... on each of the two records ... within a factor of 2.9 of each other, and
    between 0.00047 and 0.00168 over both. At the first student's per-token KL, below 1e-6,
    ... an estimator's value moves by up to 31% between them": each end of the range is one
    record's value (a range wider than the records would hide a change)."""
    page = " ".join(MISMATCH_PRACTICE.read_text().split())
    records = _tinylm_records()
    assert len(records) == 2 and "on each of the two records named at the end" in page
    values = [_tinylm_fp16_rel_bias_all(record) for _, record in records]
    assert all(max(v.values()) < 2.9 * min(v.values()) for v in values)
    assert "they lie within a factor of 2.9 of each other" in page
    low, high = re.search(FP16_RANGE, page).groups()
    everything = [x for v in values for x in v.values()]
    digits = len(low) - 2
    assert (f"{min(everything):.{digits}f}", f"{max(everything):.{digits}f}") == (low, high)
    assert all(record["mismatch"]["fp16"][0]["kl"] < 1e-6 for _, record in records)
    moved = max(abs(v[name] / values[0][name] - 1) for v in values[1:] for name in v)
    assert f"an estimator's value moves by up to {round(100 * moved)}% between them" in page
    assert ("`ATEN_CPU_CAPABILITY=default` (torch's baseline kernels, teacher and students "
            "trained afresh with them) wrote `docs/data/mismatch_experiment/reruns/"
            f"{MISMATCH_RERUN_NAMES[0]}/tinylm_mismatch.json`") in page


def test_committed_tinylm_mismatch_uses_the_current_defaults_and_backs_the_chapter():
    from opd_literate.experiment.exact import CLAMP_STUDY_KEYS
    from opd_literate.experiment.quantized import SAMPLERS

    record = json.loads(TINYLM_MISMATCH.read_text())
    expected = {k: getattr(DEFAULT_CONFIG, k) for k in CLAMP_STUDY_KEYS}
    assert record["config"] == json.loads(json.dumps(expected))
    assert record["samplers"] == SAMPLERS and record["prompts"] == 20
    assert record["batch_size"] == DEFAULT_CONFIG.batch_size
    assert record["seeds"] == list(range(DEFAULT_CONFIG.seeds))
    _tinylm_mismatch_claims(record)
    page = MISMATCH_PRACTICE.read_text()
    assert "the first 20 test prompts" in page and "(30,941 a prompt)" in page
    # the numbers of "The bias over every parameter", as the record gives them
    from opd_literate.experiment.quantized import rank_correlation

    text = " ".join(page.split())
    est = record["estimators"]
    assert all(est[s]["parameters"] == 39214 for s in est)
    assert "over all 39,214 parameters of the first student" in text
    spearman = [rank_correlation([r["rel_bias_all"] for r in est[s]["tinylm"]],
                                 [r["rel_bias"] for r in est[s]["tinylm"]])
                for s in ("bf16", "int8", "int4")]
    assert "(rank correlation {:.2f}, {:.2f} and {:.2f})".format(*spearman) in text
    int4 = {r["name"]: r["rel_bias_all"] for r in est["int4"]["tinylm"]}
    int8 = {r["name"]: r["rel_bias_all"] for r in est["int8"]["tinylm"]}
    assert (f"`token_is` stays above `naive` ({int4['token_is']:.3f} against "
            f"{int4['naive']:.3f})") in text
    assert (f"(`trl_sequence_truncate`, {int4['trl_sequence_truncate']:.3f}) is the least "
            f"biased of the biased estimators, then the one truncated at 2 (`seq_tis`, "
            f"{int4['seq_tis']:.3f})") in text
    assert f"over every parameter its relative bias is {int8['gspo']:.3f}, below 1" in text
    assert f"(over every parameter, {int8['gspo']:.3f})" in text


def test_a_sample_of_the_committed_tinylm_mismatch_recomputed_from_its_toys():
    """The toys' columns depend on numpy only: recomputed here, they equal the committed ones."""
    from opd_literate.experiment.quantized import toy_token_mismatch
    from opd_literate.mismatch.toy import make_ar_toy

    record = json.loads(TINYLM_MISMATCH.read_text())
    # numpy's exp and log kernels differ in the last bit between CPUs (the kurtosis moved in
    # its last bit on an AVX-512 machine): each column is a few hundred float64 operations on
    # the toy's log-probabilities, without cancellation, so it holds to FLOAT64_SUMS.
    why = "float64 moments and quantiles of a toy's log-ratios; exp/log kernels vary by CPU"
    assert_matches_committed(toy_token_mismatch(make_ar_toy(mismatch=0.3)),
                             record["toy_b"]["ar_toy"], rtol=FLOAT64_SUMS, why=why,
                             where="toy_b.ar_toy")
    # eps was matched by bisection on log(eps) to its last bit, so its KL is the student's to
    # rounding (the KL grows like eps**2: twice eps's relative error)
    eps = record["estimators"]["int4"]["ar_toy_eps"]
    assert_matches_committed(toy_token_mismatch(make_ar_toy(mismatch=eps))["kl"],
                             record["mismatch"]["int4"][0]["kl"], rtol=FLOAT64_SUMS,
                             why="the KL at the bisected eps: float64, to rounding")
    rows = E.comparison_table(make_ar_toy(mismatch=eps), names=["naive", "token_is", "seq_tis"])
    committed = {r["name"]: r for r in record["estimators"]["int4"]["ar_toy"]}
    for row in rows:  # biased by 3% to 35% of the gradient: the bias loses at most two digits
        assert_matches_committed(row["rel_bias"], committed[row["name"]]["rel_bias"],
                                 rtol=FLOAT64_SUMS, where=row["name"],
                                 why="exact float64 moments over the enumerated sequences")


@pytest.mark.slow
def test_the_tinylm_mismatch_recomputed_here_backs_the_chapter_too():
    """Recomputed on this machine (the students' weights differ across CPUs by rounding): the
    same claims; fp16's relative biases, which follow the weights' last bits, within a band
    set by their measured spread; naive's int4 bias near the committed one."""
    from opd_literate.experiment.quantized import mismatch_study_record

    record = mismatch_study_record(DEFAULT_CONFIG)
    # The rank correlations move with the students' weights: bf16's is 0.8907 in both committed
    # records (an AMD EPYC with AVX-512, torch's AVX-512 and baseline kernels) and 0.9049
    # recomputed on an Intel Xeon (AVX-512); 0.05 is the sanity bound for CPUs not measured, not
    # a measured spread.
    _tinylm_mismatch_claims(record, spread=0.05)
    # fp16: the engine's arithmetic does not depend on the CPU (rounded_half_forward), but the
    # students' weights do, and at fp16's KL (below 1e-6) the bias is set by the rounding
    # pattern of those weights: between the two committed records (torch's AVX-512 and baseline
    # kernels) an estimator's value moved by up to 31%, and they span 0.00047 to 0.00168; an
    # earlier record of the first 18 estimators on an AVX2 machine spanned 0.00080 to 0.00104,
    # inside. A factor of 1.5 beyond the records' range either way takes all of these in, and
    # still fails if fp16's bias changed its size by more: an operation rounded to bfloat16
    # instead, whose biases here are 5 times fp16's or more (0.00336 and up), lies above it.
    page = " ".join(MISMATCH_PRACTICE.read_text().split())
    low, high = (float(x) for x in re.search(FP16_RANGE, page).groups())
    values = _tinylm_fp16_rel_bias_all(record)
    assert all(low / 1.5 <= v <= 1.5 * high for v in values.values()), values
    committed = json.loads(TINYLM_MISMATCH.read_text())
    # Not rounding: the students are trained here in float32, and int4's grid turns a last-bit
    # difference of a weight into a step of the sampler. The rerun with torch's baseline kernels
    # moved it by 7e-6 of itself; 0.2 is the test's sanity bound for CPUs not measured (naive's
    # int4 bias, 0.37, within 0.07), not a measured spread.
    assert_matches_committed(record["estimators"]["int4"]["tinylm"][0]["rel_bias"],
                             committed["estimators"]["int4"]["tinylm"][0]["rel_bias"], rtol=0.2,
                             why="students trained here in float32, then quantized to int4")


MISMATCH_TRAINING = ROOT / "docs/data/mismatch_experiment/mismatch_training.json"
# The mismatch chapter's studies on the tiny LM and its training are on the second mismatch page.
MISMATCH_PAGE = MISMATCH_PRACTICE


def _training_record(name):
    """One machine's training study: ``dict(name, machine, record, exact, table)``, with the
    same machine's tinylm_mismatch.json as ``exact`` and ``mismatch_summary`` by name."""
    from opd_literate.experiment.mismatch_training import mismatch_summary

    folder = MISMATCH_TRAINING.parent if name == "committed" else MISMATCH_RERUNS / name
    record = json.loads((folder / "mismatch_training.json").read_text())
    exact = TINYLM_MISMATCH if name == "committed" else folder / "tinylm_mismatch.json"
    return dict(name=name, machine=json.loads((folder / "machine.json").read_text()),
                record=record, exact=json.loads(exact.read_text()),
                table={method: {row["name"]: row for row in rows}
                       for method, rows in mismatch_summary(record).items()})


@pytest.fixture(scope="module")
def training_records():
    """Every machine's training study: the committed record first, then the reruns."""
    return [_training_record(name) for name in ["committed"] + MISMATCH_RERUN_NAMES]


def _contains_0(stat):
    return stat["low"] <= 0 <= stat["high"]


def _span(values, digits=3):
    """``"a to b"``, the smallest and the largest of ``values`` as the page writes them, or
    ``"a"`` when the two agree to the digits written."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low} to {high}"


def _corrections(rows, geo=True):
    """The correction conditions of a table (``int4`` and a correction of the study),
    geometric rejection or not."""
    from opd_literate.experiment.mismatch_training import CORRECTIONS

    return [n for n in rows if n.startswith("int4 ") and n.split(" ", 1)[1] in CORRECTIONS
            and (geo or "geo_rs" not in n)]


def _mismatch_training_claims(record, exact=None, table=None):
    """What the section "Training under the mismatch" says of every machine, checked on one
    record. ``exact``: the same machine's tinylm_mismatch.json, for the sentences that compare
    the training with the exact tables. The numbers the page writes are the records' spread
    (test_the_training_sentences_state_the_machines_spread)."""
    from opd_literate.experiment.mismatch_training import mismatch_summary

    if table is None:
        table = {method: {row["name"]: row for row in rows}
                 for method, rows in mismatch_summary(record).items()}
    rl, opd = table["rl"], table["opd_sampled"]

    def mean(rows, name, key="final_accuracy"):
        return rows[name][key]["mean"]

    # the mismatch in training changes little over training
    for method in ("rl", "opd_sampled"):
        runs = record["methods"][method]
        for level in ("bf16", "int8", "int4"):
            curve = np.mean([seed[1:] for seed in runs[f"{level} none"]["mismatch_kl"]], axis=0)
            assert curve.max() / curve.min() < 1.5
    # bf16 and int8: OPD's paired intervals contain 0 (RL's, kernel by kernel: the spread test)
    for level in ("bf16", "int8"):
        assert _contains_0(opd[f"{level} none"]["difference"])
    # int4: a KL of about 0.1, more than 1,000 times bf16's; RL's loss measurable, OPD's smaller
    for rows in (rl, opd):
        kl = mean(rows, "int4 none", "mismatch_kl")
        assert 0.05 < kl < 0.15 and kl > 1000 * mean(rows, "bf16 none", "mismatch_kl")
    assert rl["int4 none"]["difference"]["high"] < 0
    assert rl["int4 none"]["difference"]["mean"] < opd["int4 none"]["difference"]["mean"] < 0
    assert _contains_0(opd["int4 none"]["difference"])
    # against the uncorrected int4 run: RL's token TIS higher on average, its sequence TIS
    # measurably; OPD's two each containing 0, and each within its interval of the on-policy run
    against = {(m, n): rows[n]["against_uncorrected"] for m, rows in (("rl", rl), ("opd", opd))
               for n in _corrections(rl)}
    for name in ("int4 decoupled_token_is", "int4 decoupled_seq_is"):
        assert against[("rl", name)]["mean"] > 0
        assert _contains_0(against[("opd", name)])
        assert _contains_0(opd[name]["difference"])
    assert against[("rl", "int4 decoupled_seq_is")]["low"] > 0
    # TRL's sequence corrections: RL's higher on average, each interval containing 0, each
    # below verl's sequence TIS; OPD's lower on average
    for name in ("int4 trl_sequence_mask", "int4 trl_sequence_truncate"):
        assert against[("rl", name)]["mean"] > 0 and _contains_0(against[("rl", name)])
        for m in ("rl", "opd"):
            assert against[(m, name)]["mean"] < against[(m, "int4 decoupled_seq_is")]["mean"]
        assert against[("opd", name)]["mean"] < 0
    # KPop: every interval below 0, the largest loss of a correction after geometric rejection
    for m, rows in (("rl", rl), ("opd", opd)):
        assert against[(m, "int4 kpop")]["high"] < 0
        others = [mean(rows, n) for n in _corrections(rows, geo=False) if n != "int4 kpop"]
        assert mean(rows, "int4 kpop") < min(others)
    # IcePop and sequence rejection: no interval above 0
    for m in ("rl", "opd"):
        for name in ("int4 decoupled_token_icepop", "int4 decoupled_seq_is_rs"):
            assert against[(m, name)]["low"] <= 0
    # geometric rejection: the largest loss of the study
    for rows in (rl, opd):
        assert mean(rows, "int4 decoupled_geo_rs") == min(mean(rows, n) for n in rows)
    for runs in record["methods"].values():  # the same five students in every condition
        starts = {tuple(seed[0] for seed in runs[name]["accuracy"]) for name in runs["conditions"]}
        assert len(starts) == 1 and len(next(iter(starts))) == 5
    # the sampler's log-probs in the OPD reward cost more than the mismatch itself
    assert opd["int4 none, sampler reward"]["difference"]["mean"] < opd["int4 none"][
        "difference"]["mean"]
    # the model the sampler runs: every correction serves a worse int4 model on average; the
    # float32 weights above their int4 model for each correction but geometric rejection; the
    # loss measurable for IcePop and sequence rejection (both methods) and RL's sequence TIS,
    # not for OPD's sequence TIS
    for rows in (rl, opd):
        none = mean(rows, "int4 none", "final_sampler_accuracy")
        assert all(mean(rows, n, "final_sampler_accuracy") < none for n in _corrections(rows))
        assert all(rows[n]["sampler_against_uncorrected"]["mean"] < 0 for n in _corrections(rows))
        # the one exception, RL's KPop with the baseline kernels: the spread test
        assert all(mean(rows, n) > mean(rows, n, "final_sampler_accuracy")
                   for n in _corrections(rows, geo=False) if n != "int4 kpop")
        for name in ("int4 decoupled_token_icepop", "int4 kpop"):
            assert rows[name]["sampler_against_uncorrected"]["high"] < 0
        assert _contains_0(rows["int4 decoupled_seq_is"]["sampler_against_uncorrected"])
    assert rl["int4 decoupled_seq_is_rs"]["sampler_against_uncorrected"]["high"] < 0
    if exact is not None:
        for rows in (rl, opd):
            for level in ("bf16", "int8", "int4"):
                reference = np.mean([s["kl"] for s in exact["mismatch"][level]])
                assert 1 / 1.5 < mean(rows, f"{level} none", "mismatch_kl") / reference < 1.5
        geo = {r["name"]: r for r in exact["estimators"]["int4"]["tinylm"]}["geo_rs"]
        assert round(geo["rel_bias"], 3) == 1.0 and 0.5e-6 < 1 - geo["seq_frac"] < 2e-6
        for sampler in ("bf16", "fp16", "int8", "int4"):
            recipe = {(r["logp"], r["weight"]): r["rel_bias"] for r in exact["opd"][sampler]}
            assert recipe[("sampler", "none")] > recipe[("trainer", "none")]


def test_the_training_reruns_are_there_and_describe_their_machine():
    """The committed record's machine.json and at least one rerun's, each describing the CPU, the
    kernels and the versions the section's "Two kernel sets, one study" names."""
    page = " ".join(MISMATCH_PAGE.read_text().split())
    assert len(MISMATCH_RERUN_NAMES) >= 1
    machines = [json.loads((MISMATCH_TRAINING.parent / "machine.json").read_text())] + [
        json.loads((MISMATCH_RERUNS / name / "machine.json").read_text())
        for name in MISMATCH_RERUN_NAMES]
    for machine in machines:
        for key in ("label", "cpu_model", "cpus", "simd_flags", "avx512", "ATEN_CPU_CAPABILITY",
                    "torch_cpu_capability", "torch", "numpy", "python", "commands", "seconds"):
            assert key in machine, (machine.get("label"), key)
        assert machine["cpus"] == 2 and machine["cpu_model"] == "AMD EPYC"
        assert "avx512f" in machine["simd_flags"] and machine["avx512"] is True
        assert f"torch {machine['torch'].split('+')[0]} and numpy {machine['numpy']}" in page
        assert set(machine["commands"]) == {"mismatch_training", "tinylm_mismatch"}
    assert "a 2-core AMD EPYC (a KVM guest) with AVX-512, torch" in page
    assert machines[0]["ATEN_CPU_CAPABILITY"] is None
    assert machines[0]["torch_cpu_capability"] == "AVX512" and "repeated" in machines[0]
    for name, machine in zip(MISMATCH_RERUN_NAMES, machines[1:]):
        assert machine["ATEN_CPU_CAPABILITY"] == "default" == machine[
            "torch_cpu_capability"].lower()
        assert all(command.startswith("ATEN_CPU_CAPABILITY=default python -m ")
                   and command.endswith(f"--out docs/data/mismatch_experiment/reruns/{name}")
                   for command in machine["commands"].values())
    assert "rerun there with `ATEN_CPU_CAPABILITY=default`" in page
    assert "committed under `docs/data/mismatch_experiment/reruns/`" in page
    assert '--8<-- "generated/mismatch_training_machines.md"' in page


@pytest.mark.parametrize("name", ["committed"] + MISMATCH_RERUN_NAMES)
def test_every_training_record_is_of_the_current_study_and_backs_the_chapter(name):
    """The committed record and every rerun: the current configuration, every condition's curve
    for every seed, and every claim of the section (with the same machine's exact tables)."""
    from opd_literate.experiment.mismatch_training import MISMATCH_DEFAULT, conditions

    machine = _training_record(name)
    record = machine["record"]
    assert record["config"] == json.loads(json.dumps(MISMATCH_DEFAULT.as_dict()))
    assert record["config"]["experiment"] == json.loads(json.dumps(DEFAULT_CONFIG.as_dict()))
    for method, runs in record["methods"].items():
        assert runs["conditions"] == [c.name for c in conditions(MISMATCH_DEFAULT, method)]
        assert runs["samples"][-1] == MISMATCH_DEFAULT.steps * DEFAULT_CONFIG.batch_size
        for condition in runs["conditions"]:
            assert all(len(seed) == len(runs["samples"])
                       for seed in runs[condition]["accuracy"])
            assert len(runs[condition]["accuracy"]) == DEFAULT_CONFIG.seeds
    assert record["run"]["workers"] == 2 and record["run"]["cpus"] == 2
    _mismatch_training_claims(record, machine["exact"], machine["table"])


def test_the_training_sentences_state_the_machines_spread(training_records):
    """Every number the section writes is the spread of the records (each end one machine's
    figure, so that a range wider than the runs would not hide a change), and what differs
    between the machines is said of the right one."""
    text = " ".join(MISMATCH_PAGE.read_text().split())
    assert len(training_records) == 2 and "Each statement below holds on both records" in text
    by_kernels = {r["machine"]["torch_cpu_capability"]: r["table"] for r in training_records}
    assert set(by_kernels) == {"AVX512", "DEFAULT"}

    def says(phrase):
        assert phrase in text, phrase

    tables = [r["table"] for r in training_records]
    methods = (("rl", "RL"), ("opd_sampled", "OPD"))

    def stats(method, name, key="difference"):
        return [t[method][name][key] for t in tables]

    def means(method, name, key="difference"):
        return [s["mean"] for s in stats(method, name, key)]

    # bf16 and int8 against fp32
    levels = ("bf16 none", "int8 none")
    paired = {m: [s for n in levels for s in stats(m, n)] for m, _ in methods}
    # accuracies are float32 fractions of the test prompts: 0.006 is 0.0060000062 there
    largest = max(abs(s["mean"]) for s in paired["opd_sampled"])
    assert largest <= round(largest, 3) + 1e-6
    says(f"With OPD the mean final accuracy is within {round(largest, 3):.3f} of the "
         "on-policy run's, and every paired interval contains 0")
    low, high = (min(s["low"] for s in paired["opd_sampled"]),
                 max(s["high"] for s in paired["opd_sampled"]))
    says(f"they lie within ${low:.3f}$ and ${high:.3f}$")
    rl_means = [s["mean"] for s in paired["rl"]]
    says(f"With RL the means range from ${min(rl_means):.3f}$ to ${max(rl_means):.3f}$ and the "
         f"intervals from ${min(s['low'] for s in paired['rl']):.3f}$ to "
         f"${max(s['high'] for s in paired['rl']):.3f}$; one of the four lies below 0 (`bf16` "
         "with the AVX-512 kernels), and with the baseline kernels the same condition ends "
         f"{by_kernels['DEFAULT']['rl']['bf16 none']['difference']['mean']:.3f} above")
    below = {(k, n) for k, t in by_kernels.items() for n in levels
             if t["rl"][n]["difference"]["high"] < 0}
    assert below == {("AVX512", "bf16 none")}
    assert not any(t["rl"][n]["difference"]["low"] > 0 for t in tables for n in levels)
    seeds = len(paired["rl"][0]["per_seed"])
    sd = {m: max(np.std(s["per_seed"], ddof=1) for s in paired[m]) for m, _ in methods}
    se = {m: sd[m] / np.sqrt(seeds) for m in sd}
    says(f"with a standard deviation of up to {sd['rl']:.3f} for RL and {sd['opd_sampled']:.3f} "
         f"for OPD, so the standard error of a mean of five seeds is up to {se['rl']:.3f} and "
         f"{se['opd_sampled']:.3f}: a mean of up to {2 * se['rl']:.3f} (RL) or "
         f"{2 * se['opd_sampled']:.3f} (OPD) either way is within two standard errors")
    fp32 = [np.array([seed[-1] for seed in r["record"]["methods"]["rl"]["fp32 none"]["accuracy"]])
            for r in training_records]
    apart = max(float(np.abs(f - fp32[0]).max()) for f in fp32[1:])
    int4 = means("rl", "int4 none", "final_accuracy")
    seed_by_seed = max(abs(x) for s in paired["rl"] for x in s["per_seed"])
    assert seed_by_seed < 1.5 * apart  # "about as much"
    says(f"the same `fp32` run ends up to {apart:.3f} apart seed by seed with the two kernel sets "
         f"(the `bf16` and `int8` runs up to {seed_by_seed:.3f} from their `fp32` run), and the "
         f"uncorrected `int4` run {max(int4) - min(int4):.3f} apart on average")
    # int4
    rl_loss, opd_loss = ([-x for x in means(m, "int4 none")] for m in ("rl", "opd_sampled"))
    says(f"RL ends {_span(rl_loss)} below the on-policy run, depending on the kernels, with each "
         f"interval below 0; sampled-token OPD ends {_span(opd_loss)} below, each interval "
         "containing 0")
    ratio = [a / b for a, b in zip(rl_loss, opd_loss)]
    says(f"OPD loses {int(min(ratio))} to {int(max(ratio))} times less")
    # the corrections against the uncorrected int4 run
    token, sequence = "int4 decoupled_token_is", "int4 decoupled_seq_is"
    says(f"RL's token TIS ends {_span(means('rl', token, 'against_uncorrected'))} higher, its "
         "interval above 0 with the AVX-512 kernels and containing 0 with the baseline ones")
    assert by_kernels["AVX512"]["rl"][token]["against_uncorrected"]["low"] > 0
    assert _contains_0(by_kernels["DEFAULT"]["rl"][token]["against_uncorrected"])
    says(f"RL's sequence TIS ends {_span(means('rl', sequence, 'against_uncorrected'))} higher, "
         "each interval above 0")
    gains = means("opd_sampled", token, "against_uncorrected")
    assert min(gains) < 0 < max(gains)
    says(f"OPD's token TIS ends between {-min(gains):.3f} lower and {max(gains):.3f} higher, its "
         f"sequence TIS {_span(means('opd_sampled', sequence, 'against_uncorrected'))} higher")
    moved = [x for n in (token, sequence) for x in means("opd_sampled", n)]
    assert min(moved) < 0 < max(moved)
    says(f"With OPD, token and sequence TIS end between {-min(moved):.3f} below and "
         f"{max(moved):.3f} above the on-policy run, and each interval against it contains 0")
    # TRL's sequence corrections
    trl_mask, trl_truncate = "int4 trl_sequence_mask", "int4 trl_sequence_truncate"
    says(f"RL's `trl_sequence_mask` ends {_span(means('rl', trl_mask, 'against_uncorrected'))} "
         f"higher and `trl_sequence_truncate` "
         f"{_span(means('rl', trl_truncate, 'against_uncorrected'))} higher, each interval "
         "containing 0, and each below `decoupled_seq_is` with both kernel sets")
    lower = [-x for n in (trl_mask, trl_truncate)
             for x in means("opd_sampled", n, "against_uncorrected")]
    says(f"with OPD they end {_span(lower)} lower, one interval below 0 (the mask, with the "
         "baseline kernels)")
    assert {(k, n) for k, t in by_kernels.items() for n in (trl_mask, trl_truncate)
            if t["opd_sampled"][n]["against_uncorrected"]["high"] < 0} == {("DEFAULT", trl_mask)}
    exact = json.loads(TINYLM_MISMATCH.read_text())
    bias_all = {r["name"]: r["rel_bias_all"] for r in exact["estimators"]["int4"]["tinylm"]}
    says(f"({bias_all['trl_sequence_truncate']:.3f} against {bias_all['seq_tis']:.3f} over every "
         "parameter at `int4`)")
    assert 1 / 3.5 < bias_all["trl_sequence_truncate"] / bias_all["seq_tis"] < 1 / 3 + 0.01
    # IcePop and sequence rejection
    icepop, rejection = "int4 decoupled_token_icepop", "int4 decoupled_seq_is_rs"
    for name, words in ((icepop, "IcePop's band sets the weight of"),
                        (rejection, "the sequence band that of")):
        zero = [100 * (1 - x) for m, _ in methods for x in means(m, name, "kept_fraction")]
        says(f"{words} {round(min(zero))} to {round(max(zero))}%")
    moved = [x for m, _ in methods for n in (icepop, rejection)
             for x in means(m, n, "against_uncorrected")]
    assert min(moved) < 0 < max(moved)
    says(f"their mean final accuracy is from {-min(moved):.3f} lower to {max(moved):.3f} higher, "
         "and no paired interval lies above 0: with the AVX-512 kernels one lies below 0 (IcePop "
         "with OPD), with the baseline kernels two (RL's sequence rejection, and IcePop with OPD)")
    for kernels, expected in (("AVX512", {("opd_sampled", icepop)}),
                              ("DEFAULT", {("rl", rejection), ("opd_sampled", icepop)})):
        table = by_kernels[kernels]
        assert not any(table[m][n]["against_uncorrected"]["low"] > 0
                       for m, _ in methods for n in (icepop, rejection))
        assert {(m, n) for m, _ in methods for n in (icepop, rejection)
                if table[m][n]["against_uncorrected"]["high"] < 0} == expected, kernels
    # KPop
    kpop = "int4 kpop"
    dropped = [100 * (1 - x) for m, _ in methods for x in means(m, kpop, "kept_fraction")]
    lost = [-x for m, _ in methods for x in means(m, kpop, "against_uncorrected")]
    says(f"It drops {round(min(dropped))} to {round(max(dropped))}% of the tokens and ends "
         f"{_span(lost)} below the uncorrected `int4` run, each interval below 0")
    # geometric rejection
    geo = "int4 decoupled_geo_rs"
    kept = {m: [100 * x for x in means(m, geo, "kept_fraction")] for m, _ in methods}
    says(f"gives a weight to {_span(kept['rl'], 1)}% of RL's tokens and "
         f"{_span(kept['opd_sampled'], 1)}% of OPD's")
    assert all(r["table"][m][geo]["final_accuracy"]["mean"] == min(
        row["final_accuracy"]["mean"] for row in r["table"][m].values())
        for r in training_records for m, _ in methods)
    starts = {round(float(np.mean([seed[0] for seed in runs["fp32 none"]["accuracy"]])), 3)
              for r in training_records for runs in r["record"]["methods"].values()}
    assert len(starts) == 1  # the same students on every machine
    start = starts.pop()
    falls = {m: means(m, geo, "final_accuracy") for m, _ in methods}
    says(f"The accuracy falls from {start:.3f} to between {min(falls['rl']):.3f} and "
         f"{max(falls['rl']):.3f} (RL) and between {min(falls['opd_sampled']):.3f} and "
         f"{max(falls['opd_sampled']):.3f} (OPD), the largest loss of the study with both kernel "
         "sets")
    says("(relative bias 1.000)")
    # the sampler's log-probs in the OPD reward
    bug = [-x for x in means("opd_sampled", "int4 none, sampler reward")]
    says(f"That run ends {_span(bug)} below the on-policy run, against {_span(opd_loss)} with the "
         "trainer's")
    # the model the sampler runs
    int4_starts = {round(float(np.mean([seed[0] for seed in r["record"]["methods"]["rl"][
        "int4 none"]["sampler_accuracy"]])), 3) for r in training_records}
    assert len(int4_starts) == 1
    says(f"answer {int4_starts.pop():.3f} of the test prompts, against {start:.3f} for their "
         "float32 weights")
    served = {m: means(m, "int4 none", "final_sampler_accuracy") for m, _ in methods}
    says(f"the `int4` model ends at {_span(served['rl'])} (RL) and "
         f"{_span(served['opd_sampled'])} (OPD)")
    corrected = {m: [x for n in _corrections(tables[0][m], geo=False)
                     for x in means(m, n, "final_sampler_accuracy")] for m, _ in methods}
    says(f"RL's corrected `int4` models end between {min(corrected['rl']):.3f} and "
         f"{max(corrected['rl']):.3f} (geometric rejection aside), OPD's between "
         f"{min(corrected['opd_sampled']):.3f} and {max(corrected['opd_sampled']):.3f}")
    below = {k: {(m, n) for m, _ in methods for n in _corrections(t[m], geo=False)
                 if t[m][n]["sampler_against_uncorrected"]["high"] < 0}
             for k, t in by_kernels.items()}
    both = {(m, n) for m, _ in methods for n in (icepop, kpop)} | {("rl", rejection)}
    default_only = {(m, n) for m, _ in methods for n in (token, trl_truncate)} | {("rl", trl_mask)}
    assert below["AVX512"] & below["DEFAULT"] == both
    assert below["DEFAULT"] - below["AVX512"] == default_only
    assert below["AVX512"] - below["DEFAULT"] == {("opd_sampled", rejection)}
    assert not any((m, sequence) in below[k] for k in below for m, _ in methods)
    says("measurable (an interval below 0) with both kernel sets for IcePop and KPop with both "
         "methods and for RL's sequence rejection; with the baseline kernels only, for token TIS "
         "and `trl_sequence_truncate` with both methods and for RL's `trl_sequence_mask`; with the "
         "AVX-512 kernels only, for OPD's sequence rejection. The sequence TIS's intervals contain "
         "0 with both methods and both kernel sets")
    # the float32 weights above their int4 model, but for geometric rejection and RL's KPop
    # with the baseline kernels
    exceptions = {(k, m, n) for k, t in by_kernels.items() for m, _ in methods
                  for n in _corrections(t[m], geo=False)
                  if t[m][n]["final_accuracy"]["mean"]
                  <= t[m][n]["final_sampler_accuracy"]["mean"]}
    assert exceptions == {("DEFAULT", "rl", kpop)}
    says("for each correction but geometric rejection (and RL's KPop with the baseline kernels)")
    says("`bf16` runs torch's own `bfloat16` CPU kernels, at every step of training")
    says(f"it took {round(training_records[0]['record']['run']['wall_seconds'])} s")


def test_the_training_sections_setup_is_the_studys():
    """The setup the section describes: the students, the steps, the optimizer, the presets."""
    from opd_literate.experiment.mismatch_training import MISMATCH_DEFAULT

    page = MISMATCH_PAGE.read_text()
    assert DEFAULT_CONFIG.warmup_steps == 30
    for text in ("the same five\nstudents for 600 steps of 64 answers",
                 "warm-up over the first 30 steps",
                 "a learning rate of $10^{-3}$", "the mean of its group of 4"):
        assert text in page
    assert (MISMATCH_DEFAULT.lr, MISMATCH_DEFAULT.steps, DEFAULT_CONFIG.group) == (1e-3, 600, 4)
    # the chapter's table of the presets: each row's thresholds are the preset's
    from opd_literate.mismatch.correction import PRESETS

    shown = {"decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
             "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
             "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
             "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                         rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
             "decoupled_geo_rs": dict(rollout_rs="seq_mean_k1",
                                      rollout_rs_threshold="0.999_1.001")}
    from opd_literate.experiment.mismatch_training import PEER_CORRECTIONS

    assert list(shown) + list(PEER_CORRECTIONS) == list(MISMATCH_DEFAULT.corrections)
    for name, options in shown.items():
        assert PRESETS[name] == options and f"| `{name}` |" in page
    # the three of other frameworks, at their defaults: TRL's bound 3, KPop's threshold 0.1
    import inspect

    from opd_literate.mismatch.correction import kpop_mask, trl_importance_weights

    trl = inspect.signature(trl_importance_weights).parameters
    assert (trl["vllm_importance_sampling_mode"].default, trl[
        "vllm_importance_sampling_clip_max"].default) == ("sequence_mask", 3.0)
    assert inspect.signature(kpop_mask).parameters["kpop_threshold"].default == 0.1
    for row in ("| `trl_sequence_mask` (TRL's default) | $\\rho$ if $\\rho \\le 3$, else 0 | none |",
                "| `trl_sequence_truncate` | $\\min(\\rho, 3)$ | none |",
                "| `kpop` | 1 | a token whose two binary KLs"):
        assert row in page, row


@pytest.mark.slow
def test_the_mismatch_training_rerun_here_keeps_the_chapters_robust_claims(training_records):
    """The default study recomputed on this machine (three minutes with the teacher cached, on 2
    cores): its trajectories differ from the records' wherever its kernels round differently,
    so only the claims that the records leave room for are checked, each bound from their
    measured spread (the records: torch's AVX-512 and baseline kernels on a 2-core AMD EPYC)."""
    from opd_literate.experiment.mismatch_training import mismatch_summary, run_mismatch_training

    record = run_mismatch_training(progress=False, workers=2)
    table = {method: {row["name"]: row for row in rows}
             for method, rows in mismatch_summary(record).items()}
    seeds = len(record["methods"]["rl"]["fp32 none"]["accuracy"])
    for method, rows in table.items():
        recorded = [r["table"][method] for r in training_records]
        # bf16 and int8 against fp32: no effect that the seeds can tell. Under no effect, the
        # mean of the seeds' paired differences has the standard error sd / sqrt(seeds); sd is
        # the largest measured on the records (0.149 for RL, 0.022 for OPD). Four standard
        # errors (0.266 and 0.039): an sd estimated from five seeds can be 1.5 times too small,
        # which still leaves 2.7 standard errors. The records' largest mean, RL's 0.065 at bf16,
        # is 1 of RL's standard errors; were it OPD's, 6.6 of OPD's, and this would fail, as it
        # should (the records' seeds do not explain it).
        sd = max(np.std(t[f"{level} none"]["difference"]["per_seed"], ddof=1)
                 for t in recorded for level in ("bf16", "int8"))
        for level in ("bf16", "int8"):
            assert abs(rows[f"{level} none"]["difference"]["mean"]) <= 4 * sd / np.sqrt(seeds), (
                method, level, rows[f"{level} none"]["difference"])
        # int4's per-token KL is set by the quantization grid at the states visited: on the
        # records it moved by 3% at most between the kernels (0.096 to 0.100), and it is 1,360
        # to 1,820 times bf16's and 337 to 433 times int8's; a factor 100 over int8 leaves 3.4
        kl = rows["int4 none"]["mismatch_kl"]["mean"]
        assert kl > 100 * rows["int8 none"]["mismatch_kl"]["mean"]
        assert min(t["int4 none"]["mismatch_kl"]["mean"] for t in recorded) / 1.5 < kl < 1.5 * max(
            t["int4 none"]["mismatch_kl"]["mean"] for t in recorded)
        # geometric rejection: the records end at 0.023 to 0.064 from 0.708, weighting 1.1% to
        # 2.7% of the tokens: a collapse, far from these bounds
        assert rows["int4 decoupled_geo_rs"]["final_accuracy"]["mean"] < 0.3
        assert rows["int4 decoupled_geo_rs"]["kept_fraction"]["mean"] < 0.1
        # sequence rejection's band: 68% to 72% of the tokens kept on the records
        assert 0.5 < rows["int4 decoupled_seq_is_rs"]["kept_fraction"]["mean"] < 0.9
    # RL's loss at int4: on the records its mean is 7 and 2.1 standard errors below 0
    assert table["rl"]["int4 none"]["difference"]["mean"] < 0
    # the sampler's log-probs in OPD's reward: -0.230 and -0.268 on the records, each more than
    # 3 standard errors (0.04) below -0.1
    assert table["opd_sampled"]["int4 none, sampler reward"]["difference"]["mean"] < -0.1


def test_the_which_switch_sentences_hold_for_its_table():
    """docs/mismatch.md, "Which switch to flip": its two sentences against the rows the
    generated table is made of (docs/hooks/generate.py, which_switch_rows)."""
    import generate  # a docs hook (tests/site/conftest.py)

    page = " ".join((ROOT / "docs" / "mismatch.md").read_text().split())
    assert "With 16 answers no estimator's error is below 0.99 on any row" in page
    rows = generate.which_switch_rows()
    at = {label: dict((n, (name, error)) for n, name, error in best)
          for label, _, best in rows}
    assert all(at[label][16][1] >= 0.99 for label in at)
    assert ("so at that batch size no correction beats not stepping. On seven rows the winner is "
            "a sequence rejection (`geo_rs` or `k3_seq_rs`) at an error of 1.000 to 1.019, a "
            "step of 0 on six of them (an error of exactly 1: no kept answer moves the gradient) "
            "and nearly 0 on the seventh; on tinylm's `bf16` and `fp16` rows every estimator "
            "errs by more than 1.3 (the winners, `geo_rs_token_tis` and `gspo`, by 1.318 and "
            "1.662).") in page
    rejections = [at[label][16][1] for label in at
                  if at[label][16][0] in ("geo_rs", "k3_seq_rs")]
    assert len(rejections) == 7 and rejections.count(1.0) == 6
    assert f"{min(rejections):.3f}" == "1.000" and f"{max(rejections):.3f}" == "1.019"
    others = {label.split("`")[1]: at[label][16] for label in at
              if at[label][16][0] not in ("geo_rs", "k3_seq_rs")}
    assert {k: (name, f"{error:.3f}") for k, (name, error) in others.items()} == {
        "bf16": ("geo_rs_token_tis", "1.318"), "fp16": ("gspo", "1.662")}
    assert all(error > 1.3 for _, error in others.values())  # the winner's: every one's above
    assert ("With 1,024 answers and a per-token KL below $10^{-3}$ (`bf16`, `fp16`, `int8`) "
            "the error is mostly variance: every estimator but the four sequence bands "
            "(`geo_rs`, `geo_rs_token_tis`, `seq_mask_tis` and `gspo`) lies within 0.03 of the "
            "winner, which changes from row to row (`seq_is`, `vespo`, `sapo`, each at a "
            "relative error of 0.224). With 1,024 answers at the toys' mismatches of 1 and more, "
            "and at tinylm's `int4`, the sequence ratio truncated at 3 wins "
            "(`trl_sequence_truncate`).") in page
    record = json.loads(TINYLM_MISMATCH.read_text())
    winners = []
    for label, kl, _ in rows:
        if label.startswith("tinylm"):
            assert (kl < 1e-3) == any(s in label for s in ("bf16", "fp16", "int8"))
            if kl < 1e-3:
                name, error = at[label][1024]
                winners.append(name)
                assert abs(error - 0.224) <= 5e-4, label
                # "within 0.03 of the winner", but the four sequence bands (least_error's
                # r_n = sqrt(b^2 + N (r_N^2 - b^2) / n) at n = 1024)
                sampler, N = label.split("`")[1], record["batch_size"]
                bands = ("geo_rs", "geo_rs_token_tis", "seq_mask_tis", "gspo")
                errors = [math.sqrt(r["rel_bias"] ** 2
                                    + N * (r["rel_rmse"] ** 2 - r["rel_bias"] ** 2) / 1024)
                          for r in record["estimators"][sampler]["tinylm"]
                          if r["name"] not in bands]
                assert max(errors) - error < 0.03, (label, max(errors), error)
            else:
                assert at[label][1024][0] == "trl_sequence_truncate", label
        elif float(label.rsplit("= ", 1)[1]) >= 1:
            assert at[label][1024][0] == "trl_sequence_truncate", label
    assert winners == ["seq_is", "vespo", "sapo"]  # bf16, fp16, int8, as the page lists them


def test_the_other_frameworks_switches_are_the_tables_last_rows():
    """docs/mismatch.md, "The other frameworks' switches": the comparison tables list the
    catalogue in its order, and the peers' switches and policy losses are its last twelve."""
    from opd_literate.mismatch.estimators import REGISTRY, comparison_table, format_table
    from opd_literate.mismatch.toy import make_toy

    page = " ".join((ROOT / "docs" / "mismatch.md").read_text().split())
    assert ("read from the two tables (their last twelve rows, from `trl_token_truncate` "
            "down):") in page
    names = list(REGISTRY)
    assert names[-12:][0] == "trl_token_truncate"
    assert set(names[-12:]) == {"trl_token_truncate", "trl_token_mask", "trl_sequence_truncate",
                                "trl_sequence_mask", "off_policy_mask", "seq_mask_tis", "kpop",
                                "sapo", "gmpo", "clip_cov", "luspo", "vespo"}
    # the tables as the docs hook writes them (docs/hooks/generate.py, _estimators)
    table = format_table(comparison_table(make_toy(), N=64), N=64)
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == names
