"""OPD under training-inference mismatch, ``opd_literate.mismatch.opd_mismatch``: exact biases on
the independent toy with a teacher; OPD on the autoregressive toy (the KL gradients against
autograd, the recipes under mismatch, and the exact expected gradient of each loss reduction
against torch's ``aggregate_loss``); and the lines mutation testing found unchecked.
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
from opd_literate.mismatch.toy import (
    ar_toy_from_logits,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
)
from opd_literate.opd import full_vocab_reverse_kl
from tests.opd.test_reductions import TOKEN_MEAN_ANGLE
from tests.opd.test_reductions import model as two_step_model


def test_kl_gradient_matches_torch_autograd_of_the_lab_loss():
    toy = add_teacher(make_toy(T=5, V=4, seed=3), teacher_seed=2)
    theta = torch.tensor(toy["theta"], requires_grad=True)
    phi = torch.tensor(toy["phi"])
    T = toy["T"]
    # Task 3's token-mean over T positions, times T, is the sum of per-position KLs.
    loss = T * full_vocab_reverse_kl(theta[None], phi[None], torch.ones(1, T))
    loss.backward()
    assert loss.item() == pytest.approx(toy["kl"], rel=1e-12)
    np.testing.assert_allclose(theta.grad.numpy(), toy["kl_grad"], rtol=1e-10, atol=1e-14)


def test_kl_gradient_is_the_exact_expectation_of_the_on_policy_estimate():
    """With tokens from the trainer itself, E_pi[d_t s_t] is the KL gradient (enumerated)."""
    toy = add_teacher(make_toy(mismatch=0.7))
    per_seq = opd_estimate(toy, "trainer", "none")
    on_policy_mean = np.einsum("m,mtv->tv", toy["p_train"], per_seq)
    np.testing.assert_allclose(on_policy_mean, toy["kl_grad"], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mismatch", [0.0, 0.3, 1.0, 2.0])
def test_trainer_logp_with_token_is_is_unbiased_in_the_toy(mismatch):
    toy = add_teacher(make_toy(mismatch=mismatch))
    target = dict(toy, true_grad=toy["kl_grad"])
    assert estimator_moments(target, opd_estimate(toy, "trainer", "token_is"))["rel_bias"] < 1e-10


def test_every_recipe_is_unbiased_without_mismatch_and_biased_with_it():
    rows = opd_mismatch_table([0.0, 0.3, 0.6, 1.0])
    for logp, weight in OPD_RECIPES:
        biases = [r["rel_bias"] for r in rows if (r["logp"], r["weight"]) == (logp, weight)]
        assert biases[0] < 1e-12
        if weight != "token_is":
            assert all(a < b for a, b in zip(biases, biases[1:])), (logp, weight)


def test_bad_arguments():
    toy = add_teacher(make_toy(T=2, V=2))
    with pytest.raises(ValueError, match="logp must be 'trainer' or 'sampler', got 'x'"):
        opd_estimate(toy, logp="x")
    with pytest.raises(ValueError, match="weight must be"):
        opd_estimate(toy, weight="seq")
    with pytest.raises(ValueError, match="toy is missing the keys"):
        opd_estimate(make_toy(T=2, V=2))


def test_a_teacher_with_a_zero_probability_is_a_clear_error_not_nan():
    toy = make_toy(T=2, V=3)
    assert np.isfinite(add_teacher(toy, scale=1e300)["kl_grad"]).all()
    with pytest.raises(ValueError, match=r"scale=1e\+308 gives the teacher a token of probability"):
        add_teacher(toy, scale=1e308)


def test_token_is_corrects_a_per_token_reward_because_each_row_sees_only_its_own_token():
    """The module's explanation, step by step: E_mu[rho_t f(y_t)] = E_pi_t[f(y_t)] per row."""
    toy = add_teacher(make_toy(T=3, V=3, mismatch=1.3, seed=6))
    per_seq = opd_estimate(toy, "trainer", "token_is")
    pi = np.exp(log_softmax(toy["theta"]))
    for t in range(3):
        # E_mu[row t] computed by enumeration equals the sum over y_t of pi_t(y_t) * row t
        row_mean = np.einsum("m,mv->v", toy["p_sampler"], per_seq[:, t])
        by_token = np.zeros(3)
        for v in range(3):
            m = int(np.flatnonzero(toy["Y"][:, t] == v)[0])  # any sequence with y_t = v
            by_token += pi[t, v] * per_seq[m, t] / np.exp(toy["logp_train"][m, t]
                                                           - toy["logp_sampler"][m, t])
        np.testing.assert_allclose(row_mean, by_token, rtol=1e-10, atol=1e-14)


def test_an_overflowing_opd_estimate_is_a_clear_error_not_inf():
    toy = add_teacher(make_toy(T=2, V=3, mismatch=100.0), scale=1e306)
    with pytest.raises(ValueError, match="the weights times the log-probability gaps overflow"):
        opd_estimate(toy, "trainer", "token_is")


def test_a_huge_teacher_scale_is_one_clear_error_for_every_seed():
    # At scale 1e308 some draws overflow to +-inf (seeds 2 and 3 gave a NaN RuntimeWarning
    # before the refusal); every seed must give the same ValueError naming the scale.
    import warnings

    from opd_literate.mismatch.opd_mismatch import add_teacher
    from opd_literate.mismatch.toy import make_toy

    for seed in (1, 2, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"scale=1e\+308 gives the teacher a token"):
                add_teacher(make_toy(), teacher_seed=seed, scale=1e308)


# OPD on the autoregressive toy: the KL gradients against autograd, the recipes under mismatch,
# and the exact expected gradient of each loss reduction against torch's ``aggregate_loss``.
#
# The reduction figures of ``tests/opd/test_reductions.py`` (a two-step model with ``<eos>``, built
# in torch) are reproduced here by the numpy toy layer, from the same logits.


def gathered(log_probs, toy):
    """(M, T) log-probs of the sampled tokens at their rows, -inf on the padding (torch)."""
    rows = torch.tensor(toy["prev"])
    tokens = torch.tensor(toy["Y"])
    positions = torch.arange(toy["T"])[None, :].expand_as(rows)
    values = log_probs[positions, rows, tokens]
    return torch.where(torch.tensor(toy["mask"]) > 0, values,
                       torch.full_like(values, -math.inf))


@pytest.fixture(scope="module")
def ar_opd():
    return add_teacher(make_ar_toy(T=3, V=3, mismatch=0.6, seed=1), teacher_seed=4)


def test_sequence_kl_and_its_gradient_match_autograd(ar_opd):
    theta = torch.tensor(ar_opd["theta"], requires_grad=True)
    mask = torch.tensor(ar_opd["mask"]) > 0
    lp = gathered(F.log_softmax(theta, -1), ar_opd)
    lq = gathered(F.log_softmax(torch.tensor(ar_opd["phi"]), -1), ar_opd)
    zero = torch.zeros_like(lp)
    log_ratio = torch.where(mask, lp - lq, zero).sum(1)  # log pi(y) - log pi_T(y)
    kl = (torch.where(mask, lp, zero).sum(1).exp() * log_ratio).sum()
    kl.backward()
    assert kl.item() == pytest.approx(ar_opd["kl"], rel=1e-12)
    np.testing.assert_allclose(ar_opd["kl_grad"], theta.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_per_state_gradient_is_the_full_vocab_loss_with_frozen_states(ar_opd):
    """E_pi[sum_t d_t s_t] = grad of sum_y sg(pi(y)) sum_t KL(pi(.|s_t) || pi_T(.|s_t))."""
    theta = torch.tensor(ar_opd["theta"], requires_grad=True)
    rows = torch.tensor(ar_opd["prev"])
    positions = torch.arange(ar_opd["T"])[None, :].expand_as(rows)
    student = theta[positions, rows]  # (M, T, V): the logits at the visited states
    teacher = torch.tensor(ar_opd["phi"])[positions, rows]
    per_state = opd.reverse_kl_per_position(student, teacher)  # (M, T)
    mask = torch.tensor(ar_opd["mask"])
    weights = torch.tensor(ar_opd["p_train"])  # a constant: the states are frozen
    (weights * (per_state * mask).sum(1)).sum().backward()
    np.testing.assert_allclose(ar_opd["kl_grad_per_state"], theta.grad.numpy(), rtol=1e-10,
                               atol=1e-12)
    # the chain rule: the sequence KL is the expected sum of the per-state KLs
    assert float(ar_opd["p_train"] @ (per_state * mask).sum(1).detach().numpy()) == pytest.approx(
        ar_opd["kl"], rel=1e-12)
    assert angle_degrees(ar_opd["kl_grad_per_state"], ar_opd["kl_grad"]) > 5


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
        for reduction, scale in [("sum", B), ("token-sum", B), ("seq-mean-token-sum", 1.0),
                                 ("seq-mean-token-sum-norm", 1 / 2), ("token-sum-norm", B / 2)]:
            np.testing.assert_allclose(expected_reduced_gradient(toy, 1.0, reduction, B),
                                       scale * toy["kl_grad"], rtol=1e-12, atol=1e-14)


def test_reduction_table_statements():
    """gamma = 1 exact (up to scale) with a fixed normaliser, or with a fixed length; the two
    means biased with <eos>; gamma = 0 biased for the sequence KL whatever the reduction."""
    rows = reduction_table(add_teacher(make_ar_toy(T=4, V=3)), batch_sizes=(1, 4))
    for r in rows:
        fixed = r["reduction"] in ("sum", "token-sum", "seq-mean-token-sum",
                                   "seq-mean-token-sum-norm", "token-sum-norm")
        if r["gamma"] == 1.0 and fixed:
            assert r["rel_bias"] < 1e-12, r
        else:
            assert r["rel_bias"] > 0.05, r
        assert r["rel_bias"] == pytest.approx(math.sin(math.radians(r["angle"])))
    fixed_length = reduction_table(add_teacher(make_ar_toy(T=4, V=3, eos=False)),
                                   gammas=(1.0,), batch_sizes=(1, 4))
    assert max(r["rel_bias"] for r in fixed_length) < 1e-12


def test_bad_arguments_on_the_ar_toy(ar_opd):
    with pytest.raises(ValueError, match="reduction must be one of"):
        expected_reduced_gradient(ar_opd, reduction="mean")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        expected_reduced_gradient(ar_opd, batch_size=0)
    with pytest.raises(ValueError, match="gamma must be <= 1.0, got 1.5"):
        opd_estimate(ar_opd, gamma=1.5)
    with pytest.raises(ValueError, match="weight must be one of"):
        opd_estimate(ar_opd, weight="prefix")
    with pytest.raises(ValueError, match="target must be 'per_state' or 'sequence'"):
        opd_mismatch_table([0.1], target="seq")
    with pytest.raises(ValueError, match=r"phi must be finite with the shape .*\(3, 4, 3\)"):
        add_teacher(make_ar_toy(T=3, V=3), phi=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="angle_degrees needs two non-zero gradients"):
        angle_degrees([0.0], [1.0])


# Found by mutation testing (docs/mutation.md): every expected value is rebuilt here from the
# docstrings: the teacher's documented draw, the recipe formulas w_t G_t s_t written out with
# numpy, the documented defaults, and the exact error messages that name each argument.


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def toy():
    """Mismatch 1.0: some token ratios exceed 2 and some the cap 1.5, so the caps bite."""
    return add_teacher(make_toy(T=3, V=3, mismatch=1.0, seed=0))


@pytest.fixture(scope="module")
def ar():
    return add_teacher(make_ar_toy(T=3, V=3, mismatch=0.7, seed=1))


# -------------------------------------------------------------------------------------------
# add_teacher
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, seed, scale", [
    ({}, 1, 1.0),  # the documented defaults: teacher_seed=1, scale=1.0
    ({"teacher_seed": 5}, 5, 1.0),
    ({"scale": 2.5}, 1, 2.5),
])
def test_teacher_is_the_documented_draw(kwargs, seed, scale):
    base = make_toy(T=2, V=3)
    out = add_teacher(base, **kwargs)
    phi = np.random.default_rng(seed).normal(0.0, 1.0, size=(2, 3)) * scale
    np.testing.assert_array_equal(out["phi"], phi)
    log_q = _log_softmax(phi)
    np.testing.assert_allclose(out["logp_teacher"], log_q[np.arange(2), base["Y"]], rtol=1e-13)
    # the sequence reverse KL, summed over all sequences
    kl = float(base["p_train"] @ (base["logp_train"] - out["logp_teacher"]).sum(axis=1))
    assert math.isclose(out["kl"], kl, rel_tol=1e-12)


def test_teacher_by_hand_is_stored_as_float():
    base = make_toy(T=2, V=3)
    out = add_teacher(base, phi=[[0, 1, 2], [2, 1, 0]])  # integers, as a list
    assert out["phi"].dtype == np.float64 and out["phi"].tolist() == [[0, 1, 2], [2, 1, 0]]


def test_autoregressive_teacher_needs_only_the_documented_keys():
    base = make_ar_toy(T=2, V=3)
    keys = ("Y", "theta", "T", "V", "logp_train", "p_train", "mask", "prev", "score")
    out = add_teacher({k: base[k] for k in keys})
    np.testing.assert_array_equal(out["kl_grad"], add_teacher(base)["kl_grad"])


def test_teacher_needs_only_the_documented_keys():
    base = make_toy(T=2, V=2)
    minimal = {k: base[k] for k in ("Y", "theta", "T", "V", "logp_train", "p_train")}
    out = add_teacher(minimal)
    assert set(out) >= {"phi", "logp_teacher", "kl", "kl_grad", "kl_grad_per_state"}


@pytest.mark.parametrize("kwargs, error, message", [
    ({"scale": float("nan")}, ValueError, "scale must be a finite number, got nan"),
    ({"scale": float("inf")}, ValueError, "scale must be a finite number, got inf"),
    ({"scale": "1"}, TypeError, "scale must be a real number"),
    ({"phi": np.zeros((3, 2))}, ValueError,
     r"phi must be finite with the shape of toy\['theta'\] \(2, 3\), got shape \(3, 2\)"),
    ({"phi": np.full((2, 3), np.nan)}, ValueError,
     r"phi must be finite with the shape of toy\['theta'\] \(2, 3\), got shape \(2, 3\)"),
    ({"scale": 1e308}, ValueError,
     r"scale=1e\+308 gives the teacher a token of probability 0 \(its logits overflow float64 "
     r"or differ by more than it can represent\); use a smaller scale$"),
    # seed 6 draws |z| > 1.8, so z * 1e308 overflows to inf (the same error, no warning)
    ({"scale": 1e308, "teacher_seed": 6}, ValueError,
     r"scale=1e\+308 gives the teacher a token of probability 0 "),
])
def test_teacher_errors_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match="^" + message):
        add_teacher(make_toy(T=2, V=3), **kwargs)


# -------------------------------------------------------------------------------------------
# opd_estimate: each recipe written out
# -------------------------------------------------------------------------------------------
def _recipe(toy, logp, weight, cap=2.0, gamma=0.0):
    """w_t G_t s_t from the docstring's formulas, with G by an upper-triangular matrix."""
    student = toy["logp_train"] if logp == "trainer" else toy["logp_sampler"]
    mask = toy.get("mask", np.ones(toy["logp_train"].shape))
    d = (student - toy["logp_teacher"]) * mask
    T = d.shape[1]
    k, t = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    discount = np.where(k >= t, float(gamma) ** np.maximum(k - t, 0), 0.0)  # (k, t)
    G = (d @ discount) * mask
    log_rho = toy["logp_train"] - toy["logp_sampler"]
    w = {
        "none": np.ones_like(G),
        "token_tis": np.minimum(np.exp(log_rho), cap),
        "token_is": np.exp(log_rho),
        "prefix_is": np.exp(np.cumsum(log_rho, axis=1)),
        "seq_is": np.exp(log_rho.sum(axis=1, keepdims=True)) * np.ones_like(G),
    }[weight]
    extra = (1,) * (toy["score"].ndim - 2)
    return (w * G).reshape(G.shape + extra) * toy["score"]


@pytest.mark.parametrize("logp", ["trainer", "sampler"])
@pytest.mark.parametrize("weight", ["none", "token_tis", "token_is", "prefix_is", "seq_is"])
@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_every_recipe_is_its_formula(toy, ar, logp, weight, gamma):
    for t in (toy, ar):
        np.testing.assert_allclose(opd_estimate(t, logp, weight, gamma=gamma),
                                   _recipe(t, logp, weight, gamma=gamma), rtol=1e-12, atol=1e-14)


def test_the_documented_defaults(toy):
    assert (np.exp(toy["logp_train"] - toy["logp_sampler"]) > 2.0).any()  # the cap bites
    np.testing.assert_allclose(opd_estimate(toy), _recipe(toy, "trainer", "none"),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opd_estimate(toy, weight="token_tis"),
                               _recipe(toy, "trainer", "token_tis", cap=2.0),
                               rtol=1e-12, atol=1e-14)


def test_cap_is_passed_on_and_inf_is_the_plain_ratio(toy):
    np.testing.assert_allclose(opd_estimate(toy, "sampler", "token_tis", cap=1.5),
                               _recipe(toy, "sampler", "token_tis", cap=1.5),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(opd_estimate(toy, "trainer", "token_tis", cap=np.inf),
                                  opd_estimate(toy, "trainer", "token_is"))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"logp": "teacher"}, ValueError, "logp must be 'trainer' or 'sampler', got 'teacher'"),
    ({"weight": "tis"}, ValueError,
     r"weight must be one of \('none', 'token_tis', 'token_is', 'prefix_is', 'seq_is'\), "
     "got 'tis'"),
    ({"cap": 0.0}, ValueError, "cap must be > 0, got 0.0"),
    ({"cap": -1.0}, ValueError, "cap must be > 0, got -1.0"),
    ({"cap": float("nan")}, ValueError, "cap must be a finite number, got nan"),
    ({"gamma": -0.1}, ValueError, "gamma must be >= 0.0, got -0.1"),
    ({"gamma": 1.5}, ValueError, "gamma must be <= 1.0, got 1.5"),
    ({"gamma": float("inf")}, ValueError, "gamma must be a finite number, got inf"),
])
def test_estimate_errors_name_the_argument(toy, kwargs, error, message):
    with pytest.raises(error, match="^" + message):
        opd_estimate(toy, **kwargs)


def test_gamma_one_is_accepted(toy):
    # G_1 = d_1 + d_2 + d_3 for the first token
    np.testing.assert_allclose(opd_estimate(toy, gamma=1.0),
                               _recipe(toy, "trainer", "none", gamma=1.0), rtol=1e-12, atol=1e-14)


def test_overflowing_weighted_gap_is_an_error():
    # rho = e^700 (finite) times a gap of 1e10 overflows float64
    hand = {"logp_train": np.array([[0.0]]), "logp_sampler": np.array([[-700.0]]),
            "logp_teacher": np.array([[-1e10]]), "score": np.zeros((1, 1, 2))}
    with pytest.raises(ValueError, match=r"^the weights times the log-probability gaps overflow "
                       r"float64 \(weight='token_is', largest gap 1e\+10\); use a smaller "
                       "teacher scale or mismatch$"):
        opd_estimate(hand, weight="token_is")
    # an infinite gap is reported as such at gamma = 0 (no discounted sum forms inf * 0)
    hand = dict(hand, logp_sampler=np.zeros((1, 2)), logp_train=np.zeros((1, 2)),
                logp_teacher=np.array([[-1.0, -np.inf]]), score=np.zeros((1, 2, 2)))
    with pytest.raises(ValueError, match=r"\(weight='none', largest gap inf\)"):
        opd_estimate(hand)


def test_overflowing_prefix_ratio_is_an_error_naming_the_level():
    hand = {"logp_train": np.zeros((1, 2)), "logp_sampler": np.array([[-400.0, -400.0]]),
            "logp_teacher": np.zeros((1, 2)), "score": np.zeros((1, 2, 2)), "mismatch": 7.0}
    with pytest.raises(ValueError, match=r"^the prefix importance ratios overflow float64 \(log "
                       r"ratio up to 800 > 709.8\) at mismatch=7.0: "):
        opd_estimate(hand, weight="prefix_is")


def test_discount_stays_inside_the_mask():
    # a hand-made mask with a hole in front and padding behind, a score that is not 0 there:
    # G_t sums the response's own gaps only, and is 0 off the mask
    hand = {"logp_train": np.array([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]),
            "logp_teacher": np.array([[-0.2, -0.4, -0.8], [-1.5, -0.1, -0.6]]),
            "mask": np.array([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
            "score": np.arange(1.0, 13.0).reshape(2, 3, 2)}
    hand["logp_sampler"] = hand["logp_train"]
    for gamma in (0.5, 1.0):
        np.testing.assert_allclose(opd_estimate(hand, gamma=gamma),
                                   _recipe(hand, "trainer", "none", gamma=gamma), rtol=1e-14)


# -------------------------------------------------------------------------------------------
# opd_mismatch_table: a hand-built loop
# -------------------------------------------------------------------------------------------
def _table(mismatches, T, V, seed, teacher_seed, cap, N, ar=False, target="per_state",
           recipes=OPD_RECIPES):
    rows = []
    for mismatch in mismatches:
        base = (make_ar_toy(T=T, V=V, mismatch=mismatch, seed=seed) if ar
                else make_toy(T=T, V=V, mismatch=mismatch, seed=seed))
        t = add_teacher(base, teacher_seed)
        goal = t["kl_grad_per_state"] if target == "per_state" else t["kl_grad"]
        for logp, weight in recipes:
            est = _recipe(t, logp, weight, cap=cap)
            moments = estimator_moments(dict(t, true_grad=goal), est)
            rows.append({"mismatch": float(mismatch), "logp": logp, "weight": weight,
                         "rel_bias": moments["rel_bias"], "rel_rmse": moments["rel_rmse"](N)})
    return rows


def _assert_rows_equal(rows, expected):
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected):
        assert set(row) == set(want)
        for key in ("mismatch", "logp", "weight"):
            assert row[key] == want[key]
        for key in ("rel_bias", "rel_rmse"):
            assert math.isclose(row[key], want[key], rel_tol=1e-9, abs_tol=1e-13)


def test_table_defaults_are_the_documented_ones():
    # T=6, V=4, seed=0, teacher_seed=1, cap=2.0, N=64, make_toy, per-state target
    _assert_rows_equal(opd_mismatch_table([0.3]), _table([0.3], 6, 4, 0, 1, 2.0, 64))


def test_table_passes_every_argument_on():
    rows = opd_mismatch_table([0.0, 0.8], T=3, V=3, seed=2, teacher_seed=5, cap=1.5, N=8)
    _assert_rows_equal(rows, _table([0.0, 0.8], 3, 3, 2, 5, 1.5, 8))


@pytest.mark.parametrize("target", ["per_state", "sequence"])
def test_table_on_the_autoregressive_toy(target):
    rows = opd_mismatch_table([0.5], T=3, V=3, seed=2, autoregressive=True,
                              recipes=PREFIX_RECIPES, target=target)
    _assert_rows_equal(rows, _table([0.5], 3, 3, 2, 1, 2.0, 64, ar=True, target=target,
                                    recipes=PREFIX_RECIPES))


def test_table_without_eos_has_fixed_lengths():
    rows = opd_mismatch_table([0.5], T=2, V=2, autoregressive=True, eos=False,
                              recipes=[("trainer", "none")])
    t = add_teacher(make_ar_toy(T=2, V=2, mismatch=0.5, eos=False), 1)
    moments = estimator_moments(dict(t, true_grad=t["kl_grad_per_state"]),
                                _recipe(t, "trainer", "none"))
    assert math.isclose(rows[0]["rel_bias"], moments["rel_bias"], rel_tol=1e-9)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"target": "kl"}, ValueError, "target must be 'per_state' or 'sequence', got 'kl'"),
    ({"autoregressive": 1}, TypeError, "autoregressive must be True or False, got 1"),
    ({"recipes": [("trainer", "none", 1)]}, ValueError,
     r"each recipe must be a \(logp, weight\) pair, got \('trainer', 'none', 1\)"),
    ({"recipes": ["trainer"]}, ValueError,
     r"each recipe must be a \(logp, weight\) pair, got 'trainer'"),
])
def test_table_errors(kwargs, error, message):
    with pytest.raises(error, match="^" + message):
        opd_mismatch_table([0.1], T=2, V=2, **kwargs)


# -------------------------------------------------------------------------------------------
# expected_reduced_gradient: enumerated over every batch of two
# -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_ar():
    return add_teacher(make_ar_toy(T=2, V=3, mismatch=0.0, seed=3))


def _enumerated(toy, gamma, reduction, B=2):
    g = _recipe(toy, "trainer", "none", gamma=gamma)  # (M, ...)
    n = toy["mask"].sum(axis=1)
    T = toy["mask"].shape[1]
    pi = toy["p_train"]
    total = np.zeros(g.shape[1:])
    for i in range(len(pi)):
        for j in range(len(pi)):
            gs, ns = g[i] + g[j], n[i] + n[j]
            reduced = {"sum": gs, "token-sum": gs, "seq-mean-token-sum": gs / B,
                       "seq-mean-token-mean": (g[i] / n[i] + g[j] / n[j]) / B,
                       "seq-mean-token-sum-norm": gs / (B * T), "token-sum-norm": gs / T,
                       "token-mean": gs / ns}[reduction]
            total += pi[i] * pi[j] * reduced
    return total


@pytest.mark.parametrize("reduction", ["sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                       "seq-mean-token-sum-norm", "token-mean"])
@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_reduced_gradient_equals_the_sum_over_batches(small_ar, reduction, gamma):
    np.testing.assert_allclose(expected_reduced_gradient(small_ar, gamma, reduction, 2),
                               _enumerated(small_ar, gamma, reduction), rtol=1e-11, atol=1e-15)


def test_reduced_gradient_defaults(small_ar):
    # gamma=0, token-mean, batch_size=1: E[g / n]
    g = _recipe(small_ar, "trainer", "none")
    n = small_ar["mask"].sum(axis=1)
    want = np.einsum("m,m...->...", small_ar["p_train"] / n, g)
    np.testing.assert_allclose(expected_reduced_gradient(small_ar), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kwargs, message", [
    ({"reduction": "mean"}, r"reduction must be one of \('token-mean', "),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": 2.0}, "batch_size must be an integer >= 1, got 2.0"),
    ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
])
def test_reduced_gradient_errors(small_ar, kwargs, message):
    with pytest.raises(ValueError, match="^" + message):
        expected_reduced_gradient(small_ar, **kwargs)


def test_reduced_gradient_needs_only_the_documented_keys(small_ar):
    keys = ("logp_train", "logp_sampler", "logp_teacher", "score", "p_train", "kl_grad", "mask")
    minimal = {k: small_ar[k] for k in keys}
    np.testing.assert_array_equal(expected_reduced_gradient(minimal, 1.0, "token-mean", 2),
                                  expected_reduced_gradient(small_ar, 1.0, "token-mean", 2))


def test_numpy_integer_batch_size_is_accepted(small_ar):
    np.testing.assert_array_equal(
        expected_reduced_gradient(small_ar, reduction="sum", batch_size=np.int64(2)),
        expected_reduced_gradient(small_ar, reduction="sum", batch_size=2))


# -------------------------------------------------------------------------------------------
# angle_degrees and reduction_table
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a, b, degrees", [
    ([1.0, 0.0], [0.0, 2.0], 90.0),
    ([1.0, 0.0], [-1.0, 0.0], 180.0),
    ([[1.0, 1.0]], [[1.0, 0.0]], 45.0),  # any shape, read flat
    ([1.0, 0.0], [1.0, 3 ** 0.5], 60.0),
])
def test_angles_by_hand(a, b, degrees):
    assert math.isclose(angle_degrees(a, b), degrees, rel_tol=1e-12)


@pytest.mark.parametrize("which", [0, 1])
def test_angle_is_computed_in_float64(which):
    # float32 inputs are read as float64: the angle is that of the float64 values, to the bit
    vectors = [np.array([1.0, 1e-4, 3e-3], dtype=np.float32), np.array([1.0, 0.0, 1e-3])]
    vectors[1 - which] = vectors[1 - which].astype(np.float64)
    as64 = [v.astype(np.float64) for v in vectors]
    assert angle_degrees(*vectors) == angle_degrees(*as64)
    flipped = [np.float32(np.array([0.3, 1.0, 0.7])), np.float32(np.array([0.31, 1.0, 0.69]))]
    assert angle_degrees(*flipped) == angle_degrees(*[v.astype(np.float64) for v in flipped])


@pytest.mark.parametrize("a, b", [([0.0, 0.0], [1.0, 0.0]), ([1.0, 0.0], [0.0, 0.0])])
def test_angle_of_a_zero_gradient_is_an_error(a, b):
    with pytest.raises(ValueError, match=r"^b must have the shape of a \(2,\), got \(1, 2\)$"):
        angle_degrees(a, [b])
    with pytest.raises(ValueError, match="^angle_degrees needs two non-zero gradients$"):
        angle_degrees(a, b)


def test_reduction_table_rows(small_ar):
    rows = reduction_table(small_ar, gammas=[0.0, 1.0], reductions=["sum", "token-mean"],
                           batch_sizes=[1, 2])
    target = small_ar["kl_grad"]
    assert [(r["gamma"], r["reduction"], r["batch_size"]) for r in rows] == [
        (g, red, B) for g in (0.0, 1.0) for red in ("sum", "token-mean") for B in (1, 2)]
    for r in rows:
        g = expected_reduced_gradient(small_ar, r["gamma"], r["reduction"], r["batch_size"])
        cos = float(np.sum(g * target) / np.linalg.norm(g) / np.linalg.norm(target))
        assert math.isclose(r["angle"], math.degrees(math.acos(min(cos, 1.0))), abs_tol=1e-6)
        assert math.isclose(r["scale"], float(np.sum(g * target) / np.sum(target**2)),
                            rel_tol=1e-12)
        # the distance from target to the line through g, relative to |target|
        nearest = float(np.sum(g * target) / np.sum(g * g)) * g
        residual = np.linalg.norm(nearest - target) / np.linalg.norm(target)
        assert math.isclose(r["rel_bias"], residual, rel_tol=1e-6, abs_tol=1e-9)
    # gamma = 1 with "sum" over B = 2 is exactly 2 grad K: angle 0, scale 2
    exact = [r for r in rows if r["gamma"] == 1.0 and r["reduction"] == "sum" and
             r["batch_size"] == 2][0]
    assert exact["angle"] < 1e-6 and math.isclose(exact["scale"], 2.0, rel_tol=1e-12)


def test_reduction_table_defaults(small_ar):
    rows = reduction_table(small_ar)
    assert [(r["gamma"], r["batch_size"]) for r in rows][:2] == [(0.0, 1), (0.0, 8)]
    assert len(rows) == 2 * 7 * 2
    assert {r["reduction"] for r in rows} == {"token-mean", "seq-mean-token-sum",
                                              "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                              "sum", "token-sum", "token-sum-norm"}
