"""The autoregressive toy of ``opd_literate.mismatch.toy``: enumeration, exact gradients against
torch autograd, estimators on it, and the claims of "When the prefix matters" (docs/mismatch.md).

Every expected value is computed here independently: the responses by filtering all ``V**T``
sequences, the objectives in torch (float64) from the logits, differentiated by autograd.
"""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.estimators import (
    REGISTRY,
    comparison_table,
    length_sweep,
    seq_is,
    token_is,
)
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    add_teacher,
    opd_estimate,
    opd_mismatch_table,
    reduction_table,
)
from opd_literate.mismatch.toy import (
    AR_TOY_KEYS,
    MAX_TOY_BYTES,
    TOY_KEYS,
    ar_num_responses,
    ar_toy_from_logits,
    ar_toy_nbytes,
    estimator_moments,
    make_ar_toy,
    make_toy,
    toy_from_logits,
)

DOUBLE = torch.float64


def brute_force_responses(T, V, eos):
    """Every response by filtering the V**T sequences: after <eos> only <eos> (the padding)."""
    kept = []
    for y in itertools.product(range(V), repeat=T):
        if eos is None or eos not in y or all(v == eos for v in y[y.index(eos):]):
            n = T if eos is None or eos not in y else y.index(eos) + 1
            kept.append((y, n))
    return kept


def torch_log_probs(logits, toy):
    """(M,) log pi(y) in torch, from the logits, the responses and their lengths only."""
    log_p = F.log_softmax(logits, -1)
    total = []
    for y, n in zip(toy["Y"].tolist(), toy["mask"].sum(1).astype(int).tolist()):
        rows = [0] + [1 + v for v in y[:-1]]  # start symbol, then the previous token
        total.append(sum(log_p[t, rows[t], y[t]] for t in range(n)))
    return torch.stack(total)


@pytest.mark.parametrize("T, V, eos", [(1, 2, True), (2, 2, True), (3, 3, True), (4, 3, False),
                                       (3, 4, True), (2, 1, False)])
def test_enumeration_is_every_response_once(T, V, eos):
    toy = make_ar_toy(T=T, V=V, eos=eos)
    expected = brute_force_responses(T, V, V - 1 if eos else None)
    assert [tuple(y) for y in toy["Y"].tolist()] == [y for y, _ in expected]  # lexicographic
    assert toy["mask"].sum(1).tolist() == [n for _, n in expected]
    assert len(toy["Y"]) == ar_num_responses(T, V, eos)
    assert set(toy) == set(AR_TOY_KEYS) and set(TOY_KEYS) < set(toy)
    for key in ("p_train", "p_sampler"):
        assert toy[key].sum() == pytest.approx(1.0, abs=1e-12)


def test_padding_holds_eos_log_probability_zero_and_no_score():
    toy = make_ar_toy(T=4, V=3, mismatch=0.7)
    pad = toy["mask"] == 0
    assert pad.any()
    assert (toy["Y"][pad] == 2).all() and (toy["prev"][pad] == 3).all()
    assert (toy["logp_train"][pad] == 0).all() and (toy["logp_sampler"][pad] == 0).all()
    assert (toy["score"][pad] == 0).all()
    # a response's tokens before its end are never <eos>
    real = toy["mask"] == 1
    last = toy["mask"].sum(1).astype(int) - 1
    before_end = real.copy()
    before_end[np.arange(len(last)), last] = False
    assert (toy["Y"][before_end] != 2).all()


@pytest.mark.parametrize("T, V, eos, seed", [(3, 3, True, 0), (4, 2, True, 1), (3, 3, False, 2)])
def test_true_grad_matches_torch_autograd(T, V, eos, seed):
    toy = make_ar_toy(T=T, V=V, mismatch=0.4, seed=seed, eos=eos)
    theta = torch.tensor(toy["theta"], requires_grad=True)
    J = (torch_log_probs(theta, toy).exp() * torch.tensor(toy["R"])).sum()
    J.backward()
    assert J.item() == pytest.approx(float(toy["p_train"] @ toy["R"]), rel=1e-12)
    np.testing.assert_allclose(toy["true_grad"], theta.grad.numpy(), rtol=1e-10, atol=1e-12)
    # the sampler's probabilities from its own logits
    mu = torch_log_probs(torch.tensor(toy["theta"] + toy["mismatch"] * toy["b"]), toy).exp()
    np.testing.assert_allclose(toy["p_sampler"], mu.numpy(), rtol=1e-12)


def test_reward_is_at_least_half_zeros_among_the_response_tokens():
    toy = make_ar_toy(T=4, V=3)
    for y, n, r in zip(toy["Y"], toy["mask"].sum(1).astype(int), toy["R"]):
        assert r == float(2 * np.sum(y[:n] == 0) >= n)
    # without <eos> it is make_toy's reward
    toy = make_ar_toy(T=4, V=3, eos=False)
    np.testing.assert_array_equal(toy["R"], make_toy(T=4, V=3)["R"])


def test_rows_that_ignore_the_previous_token_give_the_independent_toy():
    """theta[t, p] = theta_t for every p: the AR toy without <eos> is make_toy's."""
    ind = make_toy(T=3, V=3, mismatch=0.6, seed=4)
    sampler = ind["theta"] + 0.6 * ind["b"]
    ar = ar_toy_from_logits(np.repeat(ind["theta"][:, None], 4, axis=1),
                            np.repeat(sampler[:, None], 4, axis=1), eos=False)
    for key in ("Y", "logp_train", "logp_sampler", "p_train", "p_sampler", "R"):
        np.testing.assert_allclose(ar[key], ind[key], rtol=1e-13, atol=0, err_msg=key)
    # the gradient of a shared row is the sum of the gradients of its copies
    np.testing.assert_allclose(ar["true_grad"].sum(axis=1), ind["true_grad"], atol=1e-15)
    for name, spec in REGISTRY.items():
        np.testing.assert_allclose(spec.fn(ar, **spec.defaults).sum(axis=2),
                                   spec.fn(ind, **spec.defaults), atol=1e-14, err_msg=name)


def test_every_registered_estimator_runs_and_seq_is_alone_is_unbiased():
    toy = make_ar_toy(T=5, V=3, mismatch=0.3)
    rows = {r["name"]: r for r in comparison_table(toy, baseline=0.3)}
    assert set(rows) == set(REGISTRY)
    for name, row in rows.items():
        assert np.isfinite([row["bias"], row["var"], row["rel_rmse"]]).all(), name
        assert 0 <= row["token_frac"] <= row["seq_frac"] <= 1, name
    assert rows["seq_is"]["rel_bias"] < 1e-12
    assert rows["token_is"]["rel_bias"] > 0.05 and rows["naive"]["rel_bias"] > 0.05


def test_one_position_token_ratio_is_the_sequence_ratio():
    toy = make_ar_toy(T=1, V=3, mismatch=0.8)
    np.testing.assert_array_equal(token_is(toy), seq_is(toy))
    assert estimator_moments(toy, token_is(toy))["rel_bias"] < 1e-12


def test_length_normalized_quantities_use_the_response_length():
    toy = make_ar_toy(T=4, V=3, mismatch=0.9)
    n = toy["mask"].sum(1)
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    np.testing.assert_allclose(E.geometric_ratio(toy), np.exp(log_rho_t.sum(1) / n), rtol=1e-13)
    k3 = np.expm1(log_rho_t) - log_rho_t  # 0 on the padding, where rho_t = 1
    keep = (k3.sum(1) / n <= 0.05).astype(float)
    np.testing.assert_array_equal(E.k3_seq_rs(toy, threshold=0.05, return_weights=True), keep)
    # the veto looks at the response's tokens only: a threshold above 1 rejects every response
    # whose tokens all have rho_t >= 1.5, and keeps it only then
    rho_t = np.exp(log_rho_t)
    veto = E.token_veto(toy, threshold=1.5, return_weights=True)
    np.testing.assert_array_equal(veto, np.where(toy["mask"] > 0, rho_t, np.inf).min(1) >= 1.5)
    # the fraction of modified tokens counts the response's tokens only
    row = comparison_table(toy, names=["token_tis"])[0]
    modified = (rho_t > 2.0) & (toy["mask"] > 0)
    assert row["token_frac"] == pytest.approx(float(toy["p_sampler"] @ (modified.sum(1) / n)))


def test_the_independence_results_fail_on_the_ar_toy():
    """The product formula for E_mu[rho^2] holds for make_toy and fails here (marginals)."""

    def product_formula_gap(toy):
        rho = np.exp((toy["logp_train"] - toy["logp_sampler"]).sum(1))
        exact = float(toy["p_sampler"] @ rho**2)
        product = 1.0
        for t in range(toy["Y"].shape[1]):
            V = int(toy["Y"].max()) + 1
            pi_t = np.bincount(toy["Y"][:, t], weights=toy["p_train"], minlength=V)
            mu_t = np.bincount(toy["Y"][:, t], weights=toy["p_sampler"], minlength=V)
            product *= float((pi_t**2 / mu_t).sum())  # 1 + chi^2(pi_t || mu_t)
        return abs(exact - product) / exact

    assert product_formula_gap(make_toy(T=4, V=3, mismatch=0.5)) < 1e-12
    assert product_formula_gap(make_ar_toy(T=4, V=3, mismatch=0.5, eos=False)) > 0.01


class TestBadInput:
    @pytest.mark.parametrize("kwargs, error, message", [
        ({"T": 0}, ValueError, "T must be >= 1, got 0"),
        ({"V": 1}, ValueError, r"with eos=True, V must be >= 2 .* got V=1"),
        ({"V": 2.0}, TypeError, "V must be an integer, got 2.0"),
        ({"eos": "yes"}, TypeError, "eos must be True or False, got 'yes'"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer, got -1"),
        ({"seed": 1.5}, ValueError, "seed must be a non-negative integer, got 1.5"),
        ({"mismatch": float("nan")}, ValueError, "mismatch must be a finite number"),
        ({"mismatch": 2e6}, ValueError, r"mismatch must be in \[-1e\+06, 1e\+06\]"),
        ({"T": 10**6, "V": 3}, ValueError, r"make_ar_toy\(T=1000000, V=3, eos=True\) would "
                                           r"enumerate about 10\^301030 responses"),
        ({"T": 40, "V": 2}, ValueError, None),  # M = 41 responses: small, must work
    ])
    def test_arguments(self, kwargs, error, message):
        if message is None:
            assert len(make_ar_toy(**kwargs)["Y"]) == 41
            return
        with pytest.raises(error, match=message):
            make_ar_toy(**kwargs)

    def test_too_large_says_how_much_memory(self):
        assert ar_toy_nbytes(19, 3) > MAX_TOY_BYTES
        with pytest.raises(ValueError, match=r"1,048,575 responses and take 2.5 GiB, above"):
            make_ar_toy(T=19, V=3)
        assert ar_toy_nbytes(18, 3) < MAX_TOY_BYTES  # the largest T that fits at V = 3

    @pytest.mark.parametrize("train, sampler, message", [
        (np.zeros((2, 2, 2)), np.zeros((2, 2, 2)), r"train_logits must have shape \(T, V \+ 1"),
        (np.zeros((2, 3, 2)), np.zeros((1, 3, 2)), "sampler_logits must have the shape"),
        (np.full((1, 3, 2), np.inf), np.zeros((1, 3, 2)), "train_logits must be finite"),
        (np.zeros((1, 3, 2)), np.array([[[0, np.nan], [0, 0], [0, 0]]]),
         "sampler_logits must be finite"),
        (np.zeros((1, 3, 2)), np.array([[[-1e308, 1e308], [0, 0], [0, 0]]]),
         "a token has probability 0"),
    ])
    def test_ar_toy_from_logits(self, train, sampler, message):
        with pytest.raises(ValueError, match=message):
            ar_toy_from_logits(train, sampler)


def test_the_independent_toy_is_unchanged():
    """The generalised estimators give make_toy's toy the same arrays as toy_from_logits."""
    toy = make_toy(T=3, V=3, mismatch=0.7, seed=2)
    again = toy_from_logits(toy["theta"], toy["theta"] + 0.7 * toy["b"])
    np.testing.assert_array_equal(E.gspo(again), E.gspo(toy))
    assert "mask" not in toy


# Every statement of the section "When the prefix matters" of docs/mismatch.md, checked exactly
# with the settings of the docs hook (V = 3, T = 5, mismatch 0.3, 5 seeds for the figure).


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
    fixed_normaliser = ("sum", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                        "token-sum-norm")
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
