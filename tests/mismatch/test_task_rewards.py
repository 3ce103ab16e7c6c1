"""OPD with task rewards (opd_literate.mismatch.task_rewards): what each mixed estimator averages
to, exactly, against gradients computed independently with torch autograd."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch.opd_mismatch import add_teacher
from opd_literate.mismatch.task_rewards import (
    MIXED_ESTIMATORS,
    mixed_estimate,
    mixed_table,
    mixed_targets,
    teacher_estimate,
)
from opd_literate.mismatch.toy import (
    ar_toy_from_logits,
    estimator_moments,
    make_ar_toy,
    make_toy,
)

COEFS = (0.0, 0.1, 0.3, 1.0, 3.0)  # the mismatch chapter's table


def _ar_teacher_toy(**kwargs):
    return add_teacher(make_ar_toy(mismatch=0.0, **kwargs))


def _mean(toy, estimate):
    return np.einsum("m,m...->...", toy["p_sampler"], estimate)


def _autograd_per_sequence(toy, per_token_loss):
    """For each response, d/d theta of sum_t per_token_loss(log pi_t row, log q_t row, y_t)."""
    theta = torch.tensor(toy["theta"], requires_grad=True)
    log_q = torch.log_softmax(torch.as_tensor(toy["phi"]), dim=-1)
    out = []
    for m in range(len(toy["Y"])):
        log_pi = torch.log_softmax(theta, dim=-1)
        total = torch.zeros((), dtype=torch.float64)
        for t in range(toy["T"]):
            if toy["mask"][m, t] == 0:
                continue
            row = (t, int(toy["prev"][m, t]))
            total = total + per_token_loss(log_pi[row], log_q[row], int(toy["Y"][m, t]))
        (grad,) = torch.autograd.grad(total, theta)
        out.append(grad.numpy())
    return np.stack(out)


SMALL = dict(T=3, V=3, seed=2)


def test_k2_backpropagated_is_the_discount_0_reward_sample_for_sample():
    toy = _ar_teacher_toy(**SMALL)
    k2 = _autograd_per_sequence(toy, lambda lp, lq, y: 0.5 * (lp[y] - lq[y]) ** 2)
    np.testing.assert_allclose(teacher_estimate(toy, "k1_reward"), k2, rtol=0, atol=1e-13)


def test_k3_loss_is_the_gradient_of_k3_backpropagated():
    toy = _ar_teacher_toy(**SMALL)
    k3 = _autograd_per_sequence(
        toy, lambda lp, lq, y: torch.exp(lq[y] - lp[y]) - 1 - (lq[y] - lp[y]))
    np.testing.assert_allclose(teacher_estimate(toy, "k3_loss"), k3, rtol=0, atol=1e-13)


def test_full_vocab_is_the_gradient_of_the_visited_states_kl():
    toy = _ar_teacher_toy(**SMALL)
    kl = _autograd_per_sequence(toy, lambda lp, lq, y: (lp.exp() * (lp - lq)).sum())
    np.testing.assert_allclose(teacher_estimate(toy, "full_vocab"), kl, rtol=0, atol=1e-13)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("coef", [0.3, 2.0])
def test_on_policy_what_each_mixture_averages_to(make, coef):
    toy = add_teacher(make(mismatch=0.0))
    targets = mixed_targets(toy, coef)
    for kind, target in [("k1_return", "sequence"), ("k1_reward", "per_state"),
                         ("full_vocab", "per_state")]:
        np.testing.assert_allclose(_mean(toy, mixed_estimate(toy, coef, kind)), targets[target],
                                   rtol=0, atol=1e-13, err_msg=kind)


def test_k3_loss_averages_to_the_per_state_forward_kl_gradient():
    toy = _ar_teacher_toy()
    log_pi, log_q = (torch.log_softmax(torch.as_tensor(toy[key]), -1).numpy()
                     for key in ("theta", "phi"))
    rows = np.exp(log_pi) - np.exp(log_q)  # d KL(q || pi) / d theta of each row
    expected = np.zeros_like(toy["true_grad"])
    for m in range(len(toy["Y"])):
        for t in range(toy["T"]):
            if toy["mask"][m, t]:
                expected[t, toy["prev"][m, t]] += toy["p_train"][m] * rows[t, toy["prev"][m, t]]
    np.testing.assert_allclose(_mean(toy, teacher_estimate(toy, "k3_loss")), expected,
                               rtol=0, atol=1e-13)


def test_the_discount_0_bias_is_lambda_times_the_gap_between_the_two_kl_gradients():
    toy = _ar_teacher_toy()
    gap = float(np.linalg.norm(toy["kl_grad"] - toy["kl_grad_per_state"]))
    assert gap > 0.1
    for row in mixed_table(toy, COEFS, kinds=["k1_reward", "full_vocab"]):
        norm = float(np.linalg.norm(mixed_targets(toy, row["coef"])["sequence"]))
        assert abs(row["rel_bias"] * norm - row["coef"] * gap) < 1e-12
        assert row["rel_bias_per_state"] < 1e-12


def test_for_independent_positions_every_k1_form_is_unbiased():
    toy = add_teacher(make_toy(mismatch=0.0))
    rows = mixed_table(toy, [1.0], kinds=["k1_reward", "k1_return", "full_vocab"])
    assert all(row["rel_bias"] < 1e-12 for row in rows)


def test_only_lambda_0_makes_the_k3_forms_unbiased():
    toy = _ar_teacher_toy()
    for row in mixed_table(toy, COEFS, kinds=["k3_reward", "k3_loss"]):
        if row["coef"] == 0:
            assert row["rel_bias"] < 1e-12
        else:
            assert row["rel_bias"] > 0.01 and row["rel_bias_per_state"] > 0.01


def test_full_vocab_has_less_variance_than_the_sampled_reward_at_the_tables_weights():
    """The chapter's statement, for the default toy and the weights of its table."""
    toy = _ar_teacher_toy()
    rows = {(r["kind"], r["coef"]): r["var"] for r in mixed_table(toy, COEFS)}
    for coef in COEFS[1:]:
        assert rows[("full_vocab", coef)] < rows[("k1_reward", coef)]


def test_under_mismatch_no_mixture_is_unbiased_without_a_correction():
    toy = add_teacher(make_ar_toy(mismatch=0.3))
    assert all(row["rel_bias"] > 1e-3 for row in mixed_table(toy, [1.0]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(coef=-1.0), "coef must be >= 0.0"),
    (dict(coef=math.nan), "coef must be a finite number"),
    (dict(coef=1.0, kind="k2_loss"), "kind must be one of"),
    (dict(coef=1.0, baseline=math.inf), "baseline must be a finite number"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        mixed_estimate(_ar_teacher_toy(T=2, V=2), **kwargs)


def test_a_toy_without_a_teacher_is_refused():
    with pytest.raises(ValueError, match=r"missing the keys \['logp_teacher', 'phi'\]"):
        teacher_estimate(make_ar_toy(), "k1_reward")


@pytest.mark.properties
@given(T=st.integers(1, 3), V=st.integers(2, 4), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 1.0, 5.0]), coef=st.sampled_from([0.0, 0.5, 10.0]),
       kind=st.sampled_from(MIXED_ESTIMATORS))
def test_every_mixture_is_finite_and_the_return_is_unbiased(T, V, seed, scale, coef, kind):
    g = np.random.default_rng(seed)
    theta = g.normal(0, scale, (T, V + 1, V))
    toy = add_teacher(ar_toy_from_logits(theta, theta), phi=g.normal(0, scale, theta.shape))
    estimate = mixed_estimate(toy, coef, kind)
    assert np.isfinite(estimate).all()
    if kind == "k1_return":
        target = mixed_targets(toy, coef)["sequence"]
        moments = estimator_moments(dict(toy, true_grad=target), estimate)
        assert moments["bias"] <= 1e-10 * max(1.0, float(np.abs(target).max()))


def test_at_lambda_1_the_return_has_the_smallest_error_of_a_batch_of_64():
    """The chapter's sentence under its table (the default autoregressive toy, on-policy)."""
    rows = mixed_table(_ar_teacher_toy(), [1.0], N=64)
    best = min(rows, key=lambda row: row["rel_rmse"])
    assert best["kind"] == "k1_return"
    assert best["var"] > min(row["var"] for row in rows)  # not the smallest variance: the bias
