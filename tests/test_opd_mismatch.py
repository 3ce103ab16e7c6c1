"""OPD under training-inference mismatch: exact biases on the toy with a teacher."""

import numpy as np
import pytest
import torch

from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    add_teacher,
    opd_estimate,
    opd_mismatch_table,
)
from opd_literate.mismatch.toy import estimator_moments, log_softmax, make_toy
from opd_literate.opd import full_vocab_reverse_kl


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
