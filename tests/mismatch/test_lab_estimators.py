"""The mismatch lab's tests: the eight estimators of the lab, exactly, on the enumerable toy.

This file is also the test file of the generated lab handout (``opd_literate.course.handouts``),
where it imports from the lab folder; each test is marked with the task it checks and uses no other
task's function. Expected values are computed here from the toy's arrays, independently.
"""

import numpy as np
import pytest

from opd_literate.mismatch.estimators import (
    geo_rs,
    naive,
    seq_is,
    seq_mis,
    seq_tis,
    token_is,
    token_mis,
    token_tis,
)
from opd_literate.mismatch.toy import estimator_moments, make_toy, sample_from_sampler

SWEEP = [0.0, 0.1, 0.3, 0.6, 1.0, 1.5]


def ratios(toy):
    """(rho_t (M, T), rho (M,)) straight from the toy's log-probabilities."""
    rho_t = np.exp(toy["logp_train"] - toy["logp_sampler"])
    return rho_t, np.exp(np.log(rho_t).sum(axis=1))


def expected_estimate(toy, weights, baseline=0.0):
    """w_t * (R - b) * s_t for (M, T) or (M,) weights."""
    w = weights if weights.ndim == 2 else weights[:, None]
    return (w * (toy["R"] - baseline)[:, None])[:, :, None] * toy["score"]


def assert_matches(estimator, toy, expected_weights, **params):
    """The estimator's weights, and its (M, T, V) estimate, against independent values."""
    np.testing.assert_allclose(estimator(toy, **params, return_weights=True), expected_weights,
                               rtol=1e-12)
    np.testing.assert_allclose(estimator(toy, **params),
                               expected_estimate(toy, expected_weights), rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def toy():
    return make_toy(mismatch=0.8, seed=3)


@pytest.mark.task(1)
def test_naive(toy):
    np.testing.assert_allclose(naive(toy), expected_estimate(toy, np.ones(len(toy["R"]))))
    np.testing.assert_allclose(naive(toy, baseline=0.3),
                               expected_estimate(toy, np.ones(len(toy["R"])), 0.3))
    clean = make_toy(mismatch=0.0)
    assert estimator_moments(clean, naive(clean))["rel_bias"] < 1e-12
    toys = [make_toy(mismatch=m) for m in SWEEP]
    biases = [estimator_moments(t, naive(t))["bias"] for t in toys]
    assert all(a < b for a, b in zip(biases, biases[1:]))  # grows with the mismatch


@pytest.mark.task(2)
def test_token_is(toy):
    rho_t, _ = ratios(toy)
    assert_matches(token_is, toy, rho_t)
    assert estimator_moments(toy, token_is(toy))["rel_bias"] > 1e-3  # biased


@pytest.mark.task(3)
@pytest.mark.parametrize("T, V, seed", [(6, 4, 0), (4, 3, 1), (3, 5, 2), (5, 2, 3)])
@pytest.mark.parametrize("baseline", [0.0, 0.4])
def test_seq_is_is_unbiased_everywhere(T, V, seed, baseline):
    for mismatch in SWEEP:
        t = make_toy(T=T, V=V, mismatch=mismatch, seed=seed)
        assert estimator_moments(t, seq_is(t, baseline=baseline))["rel_bias"] < 1e-9


@pytest.mark.task(3)
def test_seq_is_monte_carlo_within_four_standard_errors(toy):
    per_seq = seq_is(toy)
    exact = estimator_moments(toy, per_seq)["mean"]
    draws = sample_from_sampler(toy, 40_000, np.random.default_rng(0))
    per_coordinate_var = np.einsum("m,mtv->tv", toy["p_sampler"], (per_seq - exact) ** 2)
    se = np.sqrt(per_coordinate_var / len(draws))
    assert (np.abs(per_seq[draws].mean(axis=0) - exact) <= 4 * se + 1e-15).all()


@pytest.mark.task(4)
@pytest.mark.parametrize("cap", [0.5, 2.0, np.inf])
def test_token_tis(toy, cap):
    rho_t, _ = ratios(toy)
    assert_matches(token_tis, toy, np.minimum(rho_t, cap), cap=cap)


@pytest.mark.task(5)
@pytest.mark.parametrize("cap", [0.5, 2.0])
def test_seq_tis(toy, cap):
    _, rho = ratios(toy)
    assert_matches(seq_tis, toy, np.minimum(rho, cap), cap=cap)


@pytest.mark.task(5)
def test_seq_tis_without_cap_is_unbiased(toy):
    assert estimator_moments(toy, seq_tis(toy, cap=np.inf))["rel_bias"] < 1e-9


@pytest.mark.task(6)
@pytest.mark.parametrize("low, high", [(0.0, 2.0), (0.5, 1.5), (0.0, np.inf)])
def test_token_mis(toy, low, high):
    rho_t, _ = ratios(toy)
    expected = np.where((rho_t >= low) & (rho_t <= high), rho_t, 0.0)
    assert_matches(token_mis, toy, expected, low=low, high=high)


@pytest.mark.task(7)
@pytest.mark.parametrize("low, high", [(0.0, 2.0), (0.5, 1.5)])
def test_seq_mis(toy, low, high):
    _, rho = ratios(toy)
    expected = np.where((rho >= low) & (rho <= high), rho, 0.0)
    assert_matches(seq_mis, toy, expected, low=low, high=high)


@pytest.mark.task(7)
def test_seq_mis_with_a_band_containing_every_ratio_is_unbiased(toy):
    _, rho = ratios(toy)
    estimate = seq_mis(toy, low=rho.min() * 0.999, high=rho.max() * 1.001)
    assert estimator_moments(toy, estimate)["rel_bias"] < 1e-9


@pytest.mark.task(8)
@pytest.mark.parametrize("low, high", [(0.999, 1.001), (0.9, 1.1), (0.0, np.inf)])
def test_geo_rs(toy, low, high):
    _, rho = ratios(toy)
    geo = rho ** (1 / toy["T"])
    keep = ((geo >= low) & (geo <= high)).astype(float)
    assert_matches(geo_rs, toy, keep, low=low, high=high)


@pytest.mark.task(8)
def test_geo_rs_keeps_everything_without_mismatch():
    clean = make_toy(mismatch=0.0)
    np.testing.assert_allclose(geo_rs(clean), expected_estimate(clean, np.ones(len(clean["R"]))),
                               rtol=1e-12, atol=1e-15)
