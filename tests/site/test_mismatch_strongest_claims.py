"""The section "Four more corrections, trained" of the mismatch-in-practice chapter, read back
from its records (docs/data/mismatch_experiment/strongest/, one folder a kernel set) and from
the exact tinylm study: every number the section writes is the records' spread, each end one
record's figure, and each statement holds on both."""

import json
import pathlib

import numpy as np
import pytest

from opd_literate.experiment.mismatch_training import (
    CORRECTIONS,
    MISMATCH_STRONGEST,
    conditions,
    mismatch_summary,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDER = ROOT / "docs" / "data" / "mismatch_experiment" / "strongest"
PAGE = ROOT / "docs" / "mismatch_practice.md"
EXACT = ROOT / "docs" / "data" / "experiment" / "tinylm_mismatch.json"
NEW = [f"int4 {name}" for name in ("kpop_is", "gspo", "clip_cov", "sapo")]
# The first study's corrections by their row in the catalogue (the exact tinylm study); the
# sequence TIS with sequence rejection and KPop's mask with weight 1 have none.
FIRST_STUDY_CATALOGUE = {"decoupled_token_is": "token_tis", "decoupled_seq_is": "seq_tis",
                         "decoupled_token_icepop": "icepop", "decoupled_seq_is_rs": None,
                         "decoupled_geo_rs": "geo_rs", "trl_sequence_mask": "trl_sequence_mask",
                         "trl_sequence_truncate": "trl_sequence_truncate", "kpop": None}
FIRST_STUDY = ROOT / "docs" / "data" / "mismatch_experiment" / "mismatch_training.json"
CORRECTED = ["int4 decoupled_seq_is", "int4 kpop", *NEW]


def _records():
    found = []
    for path in sorted(FOLDER.glob("*/machine.json")):
        machine = json.loads(path.read_text())
        record = json.loads((path.parent / "mismatch_training.json").read_text())
        found.append(dict(name=path.parent.name, machine=machine, record=record,
                          table={m: {row["name"]: row for row in rows}
                                 for m, rows in mismatch_summary(record).items()}))
    return sorted(found, key=lambda r: r["machine"]["order"])


RECORDS = _records()


@pytest.fixture(scope="module")
def text():
    return " ".join(PAGE.read_text().split())


def _span(values, digits=3):
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low} to {high}"


def _against(method, name, key="mean"):
    return [r["table"][method][name]["against_uncorrected"][key] for r in RECORDS]


def _contains_0(stat):
    return stat["low"] <= 0 <= stat["high"]


def test_the_two_records_are_the_study_on_one_machine_with_both_kernel_sets(text):
    assert [r["machine"]["torch_cpu_capability"] for r in RECORDS] == ["AVX512", "DEFAULT"]
    for r in RECORDS:
        machine, record = r["machine"], r["record"]
        assert machine["cpu_model"] == "Intel Xeon" and machine["cpus"] == 2
        assert machine["avx512"] is True and machine["hypervisor"] == "KVM"
        assert record["config"] == json.loads(json.dumps(MISMATCH_STRONGEST.as_dict()))
        for method, runs in record["methods"].items():
            assert runs["conditions"] == [c.name for c in conditions(MISMATCH_STRONGEST, method)]
        command = machine["commands"]["mismatch_training"]
        assert command.endswith(f"--mismatch-training --strongest --out "
                                f"docs/data/mismatch_experiment/strongest/{r['name']}")
        assert command.startswith("ATEN_CPU_CAPABILITY=default " if machine[
            "ATEN_CPU_CAPABILITY"] == "default" else "python -m")
        assert f"torch {machine['torch'].split('+')[0]} and numpy {machine['numpy']}" in text
    assert "a 2-core Intel Xeon (a KVM guest) with AVX-512" in text
    seconds = [round(r["machine"]["seconds"]["mismatch_training"]) for r in RECORDS]
    assert (f"{seconds[0]} s with the AVX-512 kernels (the teacher cached) and {seconds[1]} s "
            "with the baseline ones (training the teacher first)") in text
    assert f"--out docs/data/mismatch_experiment/strongest/{RECORDS[0]['name']}`" in text


def _curve_values(record):
    """Every recorded number of every curve, keyed by where it is (None at step 0 left out)."""
    return {(method, name, key, s, i): value
            for method, runs in record["methods"].items() for name in runs["conditions"]
            for key, curves in runs[name].items() for s, curve in enumerate(curves)
            for i, value in enumerate(curve) if value is not None}


def test_the_first_studys_record_is_not_repeated_here_as_stated(text):
    """The first study rerun on the Xeon (first_study.json, its configuration the committed
    one's): the count of its curve values that differ from the EPYC record's, as stated."""
    committed = json.loads(FIRST_STUDY.read_text())
    rerun = json.loads((FOLDER / RECORDS[0]["name"] / "first_study.json").read_text())
    assert rerun["config"] == committed["config"]
    ours, theirs = _curve_values(committed), _curve_values(rerun)
    assert ours.keys() == theirs.keys()
    differ = sum(ours[k] != theirs[k] for k in ours)
    stated = f"{differ:,} of its {len(ours):,} curve values differ"
    assert stated in RECORDS[0]["machine"]["first_study"]
    assert f"({stated}; that run's record is `first_study.json` there)" in text


def test_the_exact_ranking_that_chose_the_corrections(text):
    exact = {r["name"]: r for r in json.loads(EXACT.read_text())["estimators"]["int4"]["tinylm"]}
    rmse = {name: exact[name]["rel_rmse"] for name in ("gspo", "clip_cov", "sapo", "seq_tis")}
    assert (f"at relative RMSEs of {rmse['gspo']:.3f}, {rmse['clip_cov']:.3f} and "
            f"{rmse['sapo']:.3f}; sequence TIS (`seq_tis`), the first study's best correction "
            f"for RL, has {rmse['seq_tis']:.3f}") in text
    # "first among the catalogue's estimators the first study does not train", with the tie
    assert set(FIRST_STUDY_CATALOGUE) == set(CORRECTIONS)
    trained = {row for row in FIRST_STUDY_CATALOGUE.values() if row}
    untrained = sorted((r["rel_rmse"], n) for n, r in exact.items() if n not in trained)
    assert [n for _, n in untrained[:4]] in (["gspo", "clip_cov", "ppo_clip_bypass", "sapo"],
                                             ["gspo", "ppo_clip_bypass", "clip_cov", "sapo"])
    assert exact["clip_cov"]["rel_rmse"] == pytest.approx(exact["ppo_clip_bypass"]["rel_rmse"],
                                                          rel=1e-12)
    assert ("ranks verl's policy losses `gspo`, `clip_cov` and `sapo`, with the sampler as their "
            "anchor, first among the catalogue's estimators the first study does not train "
            "(PPO's clip in bypass mode ties `clip_cov`)") in text
    assert all(row in exact for row in trained)
    # "one step with no baseline": the exact study's estimators at baseline 0
    assert "one step with no baseline ($A = R \\ge 0$, where the lower clips never act)" in text
    kpop, gspo = exact["kpop"]["rel_bias"], exact["gspo"]["rel_bias"]
    assert kpop > gspo
    rl = {n: [-x for x in _against("rl", n)] for n in ("int4 kpop_is", "int4 gspo")}
    assert max(rl["int4 kpop_is"]) < min(rl["int4 gspo"])  # "do not order the losses"
    assert (f"the catalogue's `kpop`, which `kpop_is` trains, has {kpop:.3f} against GSPO's "
            f"{gspo:.3f}, and with RL loses {_span(rl['int4 kpop_is'])} where GSPO loses "
            f"{_span(rl['int4 gspo'])}") in text


def test_the_reductions_and_band_stated_for_verl(text):
    from opd_literate.mismatch import correction

    assert ("verl 0.9.1 reduces GSPO by `loss_agg_mode` (token mean by default) and SAPO by "
            "`seq-mean-token-mean`") in text
    assert "verl 0.9.1 reduces GSPO by the actor's ``loss_agg_mode``" in " ".join(
        correction.gspo_loss.__doc__.split())
    assert "it reduces by ``\"seq-mean-token-mean\"`` whatever ``loss_agg_mode`` says" in " ".join(
        correction.sapo_loss.__doc__.split())
    import inspect
    band = inspect.signature(correction.gspo_weights).parameters
    assert (band["clip_ratio_low"].default, band["clip_ratio_high"].default) == (3e-4, 4e-4)
    assert "GSPO trains at the paper's band ($3 \\cdot 10^{-4}$, $4 \\cdot 10^{-4}$)" in text


def test_sapo_is_the_only_new_correction_that_helps_and_only_rl(text):
    sapo, seq = "int4 sapo", "int4 decoupled_seq_is"
    assert ("**SAPO is the only new correction that ends above the uncorrected run, and only "
            "with RL.**") in text
    assert (f"RL's SAPO ends {_span(_against('rl', sapo))} higher (its interval above 0 with the "
            "AVX-512 kernels, containing 0 with the baseline ones) and its sequence TIS "
            f"{_span(_against('rl', seq))} higher (the other way round)") in text
    avx, base = ([r["table"]["rl"][n]["against_uncorrected"] for r in RECORDS]
                 for n in (sapo, seq))
    assert avx[0]["low"] > 0 and _contains_0(avx[1])
    assert _contains_0(base[0]) and base[1]["low"] > 0
    opd = [abs(x) for n in (sapo, seq) for x in _against("opd_sampled", n)]
    assert max(opd) <= round(max(opd), 3) + 1e-6
    assert f"with OPD both end within {round(max(opd), 3):.3f} of it, each interval containing 0" \
        in text
    assert all(_contains_0(r["table"]["opd_sampled"][n]["against_uncorrected"])
               for r in RECORDS for n in (sapo, seq))
    for r in RECORDS:
        for method in ("rl", "opd_sampled"):
            above = {n for n in CORRECTED
                     if r["table"][method][n]["against_uncorrected"]["mean"] > 0}
            assert above == ({sapo, seq} if method == "rl" else set())


def test_gspo_and_clip_cov_collapse_rl(text):
    gspo, clip = "int4 gspo", "int4 clip_cov"
    accuracy = {n: [r["table"]["rl"][n]["final_accuracy"]["mean"] for r in RECORDS]
                for n in (gspo, clip)}
    assert "**GSPO and Clip-Cov, the exact table's first two, collapse RL.**" in text
    assert (f"Its accuracy ends at {_span(accuracy[gspo])} with GSPO and {_span(accuracy[clip])} "
            "with Clip-Cov") in text
    rl = [-x for n in (gspo, clip) for x in _against("rl", n)]
    assert f"from {min(rl):.3f} to {max(rl):.3f} below the uncorrected run" in text
    opd = [-x for n in (gspo, clip) for x in _against("opd_sampled", n)]
    assert f"with OPD they end {_span(opd)} below, each interval below 0" in text
    for r in RECORDS:
        for method in ("rl", "opd_sampled"):
            assert all(r["table"][method][n]["against_uncorrected"]["high"] < 0
                       for n in (gspo, clip))
        lowest = sorted(r["table"]["rl"], key=lambda n: r["table"]["rl"][n]["final_accuracy"][
            "mean"])[:2]
        assert set(lowest) == {gspo, clip}


def test_kpops_ratio_does_not_recover_what_its_mask_costs(text):
    assert "**KPop's ratio does not recover what its mask costs.**" in text
    spans = {(m, n): _span([-x for x in _against(m, n)])
             for m in ("rl", "opd_sampled") for n in ("int4 kpop_is", "int4 kpop")}
    assert (f"KPop ends {spans['rl', 'int4 kpop_is']} below the uncorrected run with RL and "
            f"{spans['opd_sampled', 'int4 kpop_is']} with OPD, against {spans['rl', 'int4 kpop']} "
            f"and {spans['opd_sampled', 'int4 kpop']} with weight 1, each interval below 0") in text
    for r in RECORDS:
        for method in ("rl", "opd_sampled"):
            rows = r["table"][method]
            assert all(rows[n]["against_uncorrected"]["high"] < 0
                       for n in ("int4 kpop_is", "int4 kpop"))
            # "does not recover": the ratio gives back less than a tenth of the mask's loss
            ratio, mask = (-rows[n]["against_uncorrected"]["mean"]
                           for n in ("int4 kpop_is", "int4 kpop"))
            assert ratio > 0.9 * mask


def test_every_correction_serves_a_worse_int4_model(text):
    assert ("**The model the sampler runs fares worse with every correction,** as in the first "
            "study: each correction's `int4` model ends below the uncorrected run's on average") \
        in text
    first = {m: {row["name"]: row for row in rows}
             for m, rows in mismatch_summary(json.loads(FIRST_STUDY.read_text())).items()}
    for rows in first.values():  # "as in the first study" (its EPYC record)
        assert all(rows[f"int4 {c}"]["sampler_against_uncorrected"]["mean"] < 0
                   for c in CORRECTIONS)
    for r in RECORDS:
        for method in ("rl", "opd_sampled"):
            assert all(r["table"][method][n]["sampler_against_uncorrected"]["mean"] < 0
                       for n in CORRECTED)


def test_the_which_switch_tables_int4_winner_is_the_one_that_collapses_training():
    """docs/mismatch.md's sentence after the "which switch" table: gspo wins tinylm's int4 row
    at 64 answers, and the records' RL accuracies are the ones it states."""
    from opd_literate.mismatch.estimators import least_error

    exact = json.loads(EXACT.read_text())
    (_, name, _), = least_error(exact["estimators"]["int4"]["tinylm"], (64,),
                                N=exact["batch_size"])
    assert name == "gspo"
    accuracy = {n: [r["table"]["rl"][n]["final_accuracy"]["mean"] for r in RECORDS]
                for n in ("int4 gspo", "int4 none")}
    page = " ".join((ROOT / "docs" / "mismatch.md").read_text().split())
    # committed-exact: least_error only sorts the committed rows, the name is a string
    assert (f"`{name}`, the winner there with 64 answers, ends RL at an accuracy of "
            f"{_span(accuracy['int4 gspo'])}, where the uncorrected run ends at "
            f"{_span(accuracy['int4 none'])}") in page
    assert "(mismatch_practice.md#four-more-corrections-trained)" in page


def test_the_seeds_are_paired_across_conditions():
    for r in RECORDS:
        for runs in r["record"]["methods"].values():
            starts = {tuple(seed[0] for seed in runs[n]["accuracy"]) for n in runs["conditions"]}
            assert len(starts) == 1
            assert np.isfinite([v for n in runs["conditions"] for s in runs[n]["accuracy"]
                                for v in s]).all()
