"""OPD under training-inference mismatch: exact biases on the toy with a teacher."""

import numpy as np
import pytest
import torch

from opd_literate.opd import full_vocab_reverse_kl
from opd_literate.opd_mismatch import OPD_RECIPES, add_teacher, opd_estimate, opd_mismatch_table
from opd_literate.toy import estimator_moments, make_toy


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
