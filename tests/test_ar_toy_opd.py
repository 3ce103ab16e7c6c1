"""OPD on the autoregressive toy: the KL gradients against autograd, the recipes under mismatch,
and the exact expected gradient of each loss reduction against torch's ``aggregate_loss``.

The reduction figures of ``tests/opd/test_reductions.py`` (a two-step model with ``<eos>``, built
in torch) are reproduced here by the numpy toy layer, from the same logits.
"""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opd_literate import opd
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    REDUCTIONS,
    add_teacher,
    angle_degrees,
    expected_reduced_gradient,
    opd_estimate,
    opd_mismatch_table,
    reduction_table,
)
from opd_literate.mismatch.toy import ar_toy_from_logits, estimator_moments, make_ar_toy, make_toy
from tests.opd.test_reductions import TOKEN_MEAN_ANGLE
from tests.opd.test_reductions import model as two_step_model


def gathered(log_probs, toy):
    """(M, T) log-probs of the sampled tokens at their rows, -inf on the padding (torch)."""
    rows = torch.tensor(toy["prev"])
    tokens = torch.tensor(toy["Y"])
    positions = torch.arange(toy["T"])[None, :].expand_as(rows)
    values = log_probs[positions, rows, tokens]
    return torch.where(torch.tensor(toy["mask"]) > 0, values,
                       torch.full_like(values, -math.inf))


@pytest.fixture(scope="module")
def ar():
    return add_teacher(make_ar_toy(T=3, V=3, mismatch=0.6, seed=1), teacher_seed=4)


def test_sequence_kl_and_its_gradient_match_autograd(ar):
    theta = torch.tensor(ar["theta"], requires_grad=True)
    mask = torch.tensor(ar["mask"]) > 0
    lp = gathered(F.log_softmax(theta, -1), ar)
    lq = gathered(F.log_softmax(torch.tensor(ar["phi"]), -1), ar)
    zero = torch.zeros_like(lp)
    log_ratio = torch.where(mask, lp - lq, zero).sum(1)  # log pi(y) - log pi_T(y)
    kl = (torch.where(mask, lp, zero).sum(1).exp() * log_ratio).sum()
    kl.backward()
    assert kl.item() == pytest.approx(ar["kl"], rel=1e-12)
    np.testing.assert_allclose(ar["kl_grad"], theta.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_per_state_gradient_is_the_full_vocab_loss_with_frozen_states(ar):
    """E_pi[sum_t d_t s_t] = grad of sum_y sg(pi(y)) sum_t KL(pi(.|s_t) || pi_T(.|s_t))."""
    theta = torch.tensor(ar["theta"], requires_grad=True)
    rows = torch.tensor(ar["prev"])
    positions = torch.arange(ar["T"])[None, :].expand_as(rows)
    student = theta[positions, rows]  # (M, T, V): the logits at the visited states
    teacher = torch.tensor(ar["phi"])[positions, rows]
    per_state = opd.reverse_kl_per_position(student, teacher)  # (M, T)
    mask = torch.tensor(ar["mask"])
    weights = torch.tensor(ar["p_train"])  # a constant: the states are frozen
    (weights * (per_state * mask).sum(1)).sum().backward()
    np.testing.assert_allclose(ar["kl_grad_per_state"], theta.grad.numpy(), rtol=1e-10,
                               atol=1e-12)
    # the chain rule: the sequence KL is the expected sum of the per-state KLs
    assert float(ar["p_train"] @ (per_state * mask).sum(1).detach().numpy()) == pytest.approx(
        ar["kl"], rel=1e-12)
    assert angle_degrees(ar["kl_grad_per_state"], ar["kl_grad"]) > 5


def test_on_the_independent_toy_the_two_gradients_are_one():
    toy = add_teacher(make_toy(T=3, V=3))
    assert toy["kl_grad_per_state"] is toy["kl_grad"]


@pytest.mark.parametrize("mismatch", [0.2, 0.6, 1.5])
def test_prefix_and_sequence_ratios_are_exact_and_the_token_ratio_is_not(mismatch):
    toy = add_teacher(make_ar_toy(T=4, V=3, mismatch=mismatch, seed=2))
    target = dict(toy, true_grad=toy["kl_grad_per_state"])
    bias = {w: estimator_moments(target, opd_estimate(toy, "trainer", w))["rel_bias"]
            for w in ("none", "token_is", "prefix_is", "seq_is")}
    assert bias["prefix_is"] < 1e-12 and bias["seq_is"] < 1e-12
    assert bias["token_is"] > 0.01 and bias["none"] > 0.01


def test_prefix_ratio_by_hand():
    """T = 2, V = 2: the prefix ratio of token 2 is rho_1 rho_2, of token 1 just rho_1."""
    half, skew = np.log([0.5, 0.5]), np.log([0.8, 0.2])
    toy = add_teacher(ar_toy_from_logits([[half] * 3] * 2, [[skew, half, half], [half] * 3]),
                      phi=np.zeros((2, 3, 2)))
    # the teacher is uniform, so is the student: d = 0 and every estimate is 0 ...
    assert np.abs(opd_estimate(toy, "trainer", "prefix_is")).max() == 0
    # ... but with the sampler's log-probs the gap is log mu - log pi_T = log(0.8 / 0.5) etc.
    est = opd_estimate(toy, "sampler", "prefix_is")
    rho_1 = np.array([0.5 / 0.8, 0.5 / 0.8, 0.5 / 0.2])  # responses (0,0), (0,eos), (eos)
    gap_1 = np.log([0.8 / 0.5, 0.8 / 0.5, 0.2 / 0.5])
    np.testing.assert_allclose(est[:, 0, 0], (rho_1 * gap_1)[:, None] * (np.eye(2)[[0, 0, 1]]
                                                                       - 0.5), rtol=1e-12)


def test_opd_table_on_the_ar_toy():
    rows = opd_mismatch_table([0.0, 0.3], T=3, V=3, autoregressive=True,
                              recipes=OPD_RECIPES + PREFIX_RECIPES)
    assert len(rows) == 2 * 7
    for r in rows:
        exact = r["mismatch"] == 0 or r["weight"] in ("prefix_is", "seq_is")
        assert (r["rel_bias"] < 1e-12) == exact, r
    # the independent table is unchanged by the new arguments
    assert opd_mismatch_table([0.3]) == opd_mismatch_table([0.3], recipes=OPD_RECIPES,
                                                           target="sequence")


# ------------------------------------------------------------------ reductions and discount
def torch_expected_gradient(toy, gamma, reduction, B):
    """sum over all B-tuples of responses of P(batch) grad sampled_token_opd_loss (autograd)."""
    theta = torch.tensor(toy["theta"], requires_grad=True)
    student = gathered(F.log_softmax(theta, -1), toy)
    teacher = gathered(F.log_softmax(torch.tensor(toy["phi"]), -1), toy)
    mask = torch.tensor(toy["mask"])
    p = torch.tensor(toy["p_train"])
    total = 0
    for batch in itertools.product(range(len(p)), repeat=B):
        index = list(batch)
        loss = opd.sampled_token_opd_loss(student[index], teacher[index], mask[index],
                                          gamma=gamma, reduction=reduction)
        total = total + p[index].prod() * loss  # P(batch) is a constant, not differentiated
    total.backward()
    return theta.grad.numpy()


def test_reductions_are_opds_own_tuple():
    assert REDUCTIONS is opd.REDUCTIONS  # one definition, in _numerics, re-exported by both


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_expected_reduced_gradient_matches_aggregate_loss_by_enumeration(gamma, reduction):
    # B = 1 on 15 responses of up to 3 tokens, B = 2 on the 49 pairs of 7 responses
    for T, B in ((3, 1), (2, 2)):
        toy = add_teacher(make_ar_toy(T=T, V=3, seed=3), teacher_seed=5)
        np.testing.assert_allclose(expected_reduced_gradient(toy, gamma, reduction, B),
                                   torch_expected_gradient(toy, gamma, reduction, B),
                                   rtol=1e-10, atol=1e-13, err_msg=f"B={B}")


def test_token_mean_with_three_responses_uses_the_length_convolution():
    toy = add_teacher(make_ar_toy(T=2, V=3, seed=6))  # 7 responses, 343 batches of 3
    np.testing.assert_allclose(expected_reduced_gradient(toy, 1.0, "token-mean", 3),
                               torch_expected_gradient(toy, 1.0, "token-mean", 3),
                               rtol=1e-10, atol=1e-13)


def two_step_toy():
    """tests/opd/test_reductions.py's model as an AR toy: row 0 first, row 1 + y_1 second."""
    theta, phi = (x.numpy() for x in two_step_model())  # (1 + V, V) each, V = 3
    # position 0 reads row 0 (the start symbol), position 1 reads row 1 + y_1
    logits = np.stack([theta, theta])
    return add_teacher(ar_toy_from_logits(logits, logits), phi=np.stack([phi, phi]))


def test_the_two_step_model_figures_of_test_opd_lengths():
    toy = two_step_toy()
    assert len(toy["Y"]) == 7
    for B, angle in TOKEN_MEAN_ANGLE.items():
        g = expected_reduced_gradient(toy, 1.0, "token-mean", B)
        assert angle_degrees(g, toy["kl_grad"]) == pytest.approx(angle, abs=0.01)
    for B in (1, 2):
        g = expected_reduced_gradient(toy, 1.0, "seq-mean-token-mean", B)
        assert angle_degrees(g, toy["kl_grad"]) == pytest.approx(TOKEN_MEAN_ANGLE[1], abs=0.01)
        for reduction, scale in [("sum", B), ("seq-mean-token-sum", 1.0),
                                 ("seq-mean-token-sum-norm", B / 2)]:
            np.testing.assert_allclose(expected_reduced_gradient(toy, 1.0, reduction, B),
                                       scale * toy["kl_grad"], rtol=1e-12, atol=1e-14)


def test_reduction_table_statements():
    """gamma = 1 exact (up to scale) with a fixed normaliser, or with a fixed length; the two
    means biased with <eos>; gamma = 0 biased for the sequence KL whatever the reduction."""
    rows = reduction_table(add_teacher(make_ar_toy(T=4, V=3)), batch_sizes=(1, 4))
    for r in rows:
        fixed = r["reduction"] in ("sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
        if r["gamma"] == 1.0 and fixed:
            assert r["rel_bias"] < 1e-12, r
        else:
            assert r["rel_bias"] > 0.05, r
        assert r["rel_bias"] == pytest.approx(math.sin(math.radians(r["angle"])))
    fixed_length = reduction_table(add_teacher(make_ar_toy(T=4, V=3, eos=False)),
                                   gammas=(1.0,), batch_sizes=(1, 4))
    assert max(r["rel_bias"] for r in fixed_length) < 1e-12


def test_bad_arguments(ar):
    with pytest.raises(ValueError, match="reduction must be one of"):
        expected_reduced_gradient(ar, reduction="mean")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        expected_reduced_gradient(ar, batch_size=0)
    with pytest.raises(ValueError, match="gamma must be <= 1.0, got 1.5"):
        opd_estimate(ar, gamma=1.5)
    with pytest.raises(ValueError, match="weight must be one of"):
        opd_estimate(ar, weight="prefix")
    with pytest.raises(ValueError, match="target must be 'per_state' or 'sequence'"):
        opd_mismatch_table([0.1], target="seq")
    with pytest.raises(ValueError, match=r"phi must be finite with the shape .*\(3, 4, 3\)"):
        add_teacher(make_ar_toy(T=3, V=3), phi=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="angle_degrees needs two non-zero gradients"):
        angle_degrees([0.0], [1.0])
