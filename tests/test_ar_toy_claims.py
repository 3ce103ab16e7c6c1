"""Every statement of the section "When the prefix matters" of docs/mismatch.md, checked exactly
with the settings of the docs hook (V = 3, T = 5, mismatch 0.3, 5 seeds for the figure)."""

import numpy as np
import pytest

from opd_literate.mismatch.estimators import REGISTRY, comparison_table, length_sweep
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    add_teacher,
    estimator_moments,
    opd_estimate,
    opd_mismatch_table,
    reduction_table,
)
from opd_literate.mismatch.toy import make_ar_toy, make_toy

SIZE = dict(T=5, V=3)


def test_per_token_corrections_are_biased_on_both_toys_and_seq_is_on_neither():
    for toy in (make_toy(**SIZE, mismatch=0.3), make_ar_toy(**SIZE, mismatch=0.3)):
        for row in comparison_table(toy):
            if REGISTRY[row["name"]].reference == "token":
                assert row["rel_bias"] > 0.01, row["name"]
            if row["name"] == "seq_is":
                assert row["rel_bias"] < 1e-12


@pytest.fixture(scope="module")
def sweeps():
    names = ["token_is", "seq_is", "seq_tis"]
    kinds = {"eos": dict(eos=True), "fixed": dict(eos=False),
             "independent": dict(autoregressive=False)}
    return {kind: length_sweep(range(1, 9), names, mismatch=0.3, V=3, **kwargs)
            for kind, kwargs in kinds.items()}


def test_the_figure_of_bias_against_length(sweeps):
    for kind, sweep in sweeps.items():
        assert all(sweep[1][name] < 1e-12 for name in sweep[1]), kind  # T = 1: all exact
        assert all(sweep[T]["seq_is"] < 1e-12 for T in sweep), kind
        assert all(sweep[T]["token_is"] > 0.01 for T in range(2, 9)), kind
        assert sweep[8]["seq_tis"] > sweep[2]["seq_tis"], kind
    for T in range(2, 9):  # <eos> lowers the token ratio's bias on the AR toy
        assert sweeps["eos"][T]["token_is"] < sweeps["fixed"][T]["token_is"], T


def test_the_opd_table_statements():
    mismatches = [0.1, 0.3, 1.0]
    recipes = OPD_RECIPES + PREFIX_RECIPES
    for autoregressive in (False, True):
        rows = opd_mismatch_table(mismatches, **SIZE, recipes=recipes,
                                  autoregressive=autoregressive)
        for m in mismatches:
            at = {(r["logp"], r["weight"]): r for r in rows if r["mismatch"] == m}
            token_is = at[("trainer", "token_is")]["rel_bias"]
            assert (token_is > 0.01) if autoregressive else (token_is < 1e-12)
            for weight in ("prefix_is", "seq_is"):
                assert at[("trainer", weight)]["rel_bias"] < 1e-12
            worst_trainer = max(r["rel_bias"] for k, r in at.items() if k[0] == "trainer")
            best_sampler = min(r["rel_bias"] for k, r in at.items() if k[0] == "sampler")
            # on the AR toy the sampler's log-prob is worse than every trainer recipe (on the
            # independent toy not at mismatch 1: uncorrected trainer 1.34 > sampler TIS 1.17)
            assert (best_sampler > worst_trainer) == (autoregressive or m < 1.0), (m, at)
    # the sequence ratio has more variance than the prefix ratio
    for m in mismatches:
        toy = add_teacher(make_ar_toy(**SIZE, mismatch=m))
        target = dict(toy, true_grad=toy["kl_grad_per_state"])
        var = {w: estimator_moments(target, opd_estimate(toy, "trainer", w))["var"]
               for w in ("prefix_is", "seq_is")}
        assert var["seq_is"] > var["prefix_is"], m


def test_the_reduction_table_statements():
    rows = reduction_table(add_teacher(make_ar_toy(**SIZE)), batch_sizes=(1, 8))
    cell = {(r["gamma"], r["reduction"], r["batch_size"]): r for r in rows}
    fixed_normaliser = ("sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    for (gamma, reduction, B), r in cell.items():
        exact = gamma == 1.0 and reduction in fixed_normaliser
        assert (r["rel_bias"] < 1e-12) == exact, (gamma, reduction, B)
    assert cell[(1.0, "token-mean", 8)]["angle"] < cell[(1.0, "token-mean", 1)]["angle"]
    for gamma in (0.0, 1.0):
        assert cell[(gamma, "seq-mean-token-mean", 1)]["angle"] == pytest.approx(
            cell[(gamma, "seq-mean-token-mean", 8)]["angle"], rel=1e-12)
    fixed = reduction_table(add_teacher(make_ar_toy(**SIZE, eos=False)), batch_sizes=(8,))
    for r in fixed:
        assert (r["rel_bias"] < 1e-12) == (r["gamma"] == 1.0), r
    assert np.isfinite([r["angle"] for r in rows + fixed]).all()


def test_angle_degrees_refuses_two_shapes():
    import pytest

    from opd_literate.mismatch.opd_mismatch import angle_degrees

    with pytest.raises(ValueError, match=r"b must have the shape of a \(1,\), got \(3,\)"):
        angle_degrees([1.0], [1.0, 1.0, 1.0])


def test_ar_num_responses_counts_by_hand():
    from opd_literate.mismatch.toy import ar_num_responses

    # T = 2, V = 2 (token 1 is <eos>): "1", "00", "01" -> 3; T = 3, V = 3: the formula's
    # middle form, sum_{k <= T-2} (V-1)^k + (V-1)^(T-1) V = 1 + 2 + 4 * 3 = 15.
    assert ar_num_responses(2, 2) == 3
    assert ar_num_responses(3, 3) == 1 + 2 + 4 * 3 == sum(2**k for k in range(4))
