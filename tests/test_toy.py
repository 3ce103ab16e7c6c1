"""The toy reproduces the seed's arrays exactly, and its exact moments agree with loops and MC."""

import pathlib
import types

import numpy as np
import pytest

from opd_literate.toy import (
    MAX_TOY_BYTES,
    estimator_moments,
    log_softmax,
    make_toy,
    sample_from_sampler,
    toy_nbytes,
)

SEED_FILE = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "seeds" / \
    "003_001d8542688b7e4a.txt"


@pytest.fixture(scope="module")
def seed_module():
    """The seed's given code, loaded from ../shared/seeds: an independent reference."""
    if not SEED_FILE.exists():
        pytest.skip(f"seed file not found at {SEED_FILE}")
    module = types.ModuleType("seed_toy")
    exec(compile(SEED_FILE.read_text(), str(SEED_FILE), "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("kwargs", [
    {}, {"T": 3, "V": 5, "mismatch": 1.2, "seed": 7}, {"T": 5, "V": 3, "mismatch": -0.4},
    {"T": 2, "V": 2, "mismatch": 0.0, "seed": 123},
])
def test_same_arrays_as_the_seed(seed_module, kwargs):
    ours, theirs = make_toy(**kwargs), seed_module.make_toy(**kwargs)
    assert set(ours) == set(theirs)
    for key in theirs:
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]), err_msg=key)
    indices = sample_from_sampler(ours, 200, np.random.default_rng(5))
    np.testing.assert_array_equal(
        indices, seed_module.sample_from_sampler(theirs, 200, np.random.default_rng(5)))
    estimate = np.random.default_rng(1).normal(size=ours["score"].shape)
    a, b = estimator_moments(ours, estimate), seed_module.estimator_moments(theirs, estimate)
    np.testing.assert_allclose(a["mean"], b["mean"], rtol=1e-13, atol=1e-15)
    for key in ("bias", "var", "rel_bias"):
        assert a[key] == pytest.approx(b[key], rel=1e-12)
    assert a["rel_rmse"](17) == pytest.approx(b["rel_rmse"](17), rel=1e-12)


def test_true_grad_matches_analytic_formula_on_a_two_token_toy():
    """J = 1 - (1 - pi_1(0)) (1 - pi_2(0)) for T = 2: differentiate by hand."""
    toy = make_toy(T=2, V=3, mismatch=0.7, seed=2)
    pi = np.exp(log_softmax(toy["theta"]))
    a, b = pi[0, 0], pi[1, 0]
    # d pi_t(0) / d theta_t = pi_t(0) (e_0 - pi_t)
    e0 = np.eye(3)[0]
    expected = np.stack([(1 - b) * a * (e0 - pi[0]), (1 - a) * b * (e0 - pi[1])])
    np.testing.assert_allclose(toy["true_grad"], expected, rtol=1e-12, atol=1e-15)


def test_true_grad_matches_finite_differences():
    toy = make_toy(T=3, V=3, mismatch=0.2, seed=4)
    theta = toy["theta"]

    def J(th):
        lp = log_softmax(th)
        logp = lp[np.arange(3), toy["Y"]].sum(1)
        return float(np.exp(logp) @ toy["R"])

    h = 1e-6
    fd = np.zeros_like(theta)
    for t in range(3):
        for v in range(3):
            step = np.zeros_like(theta)
            step[t, v] = h
            fd[t, v] = (J(theta + step) - J(theta - step)) / (2 * h)
    np.testing.assert_allclose(toy["true_grad"], fd, atol=1e-9)


def test_moments_agree_with_a_plain_loop():
    toy = make_toy(T=3, V=3, mismatch=0.5)
    estimate = np.random.default_rng(0).normal(size=toy["score"].shape)
    mean = np.zeros((3, 3))
    for m in range(len(toy["Y"])):
        mean += toy["p_sampler"][m] * estimate[m]
    var = 0.0
    for m in range(len(toy["Y"])):
        var += toy["p_sampler"][m] * np.sum((estimate[m] - mean) ** 2)
    moments = estimator_moments(toy, estimate)
    np.testing.assert_allclose(moments["mean"], mean, rtol=1e-12, atol=1e-15)
    assert moments["var"] == pytest.approx(var, rel=1e-12)
    assert moments["bias"] == pytest.approx(np.linalg.norm(mean - toy["true_grad"]), rel=1e-12)


def test_probabilities_are_normalized():
    toy = make_toy(T=4, V=5, mismatch=2.0)
    assert toy["p_train"].sum() == pytest.approx(1.0, abs=1e-12)
    assert toy["p_sampler"].sum() == pytest.approx(1.0, abs=1e-12)


class TestBadInput:
    @pytest.mark.parametrize("kwargs, message", [
        ({"T": 0}, "T must be >= 1, got 0"),
        ({"V": -2}, "V must be >= 1, got -2"),
        ({"mismatch": float("nan")}, "mismatch must be a finite number"),
        ({"mismatch": float("inf")}, "mismatch must be a finite number"),
    ])
    def test_invalid_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            make_toy(**kwargs)

    def test_non_integer_size(self):
        with pytest.raises(TypeError, match="T must be an integer, got 2.5"):
            make_toy(T=2.5)

    def test_too_large_says_how_much_memory(self):
        assert toy_nbytes(12, 8) > MAX_TOY_BYTES
        with pytest.raises(ValueError, match=r"68,719,476,736 sequences .* GiB"):
            make_toy(T=12, V=8)

    def test_wrong_estimate_shape(self):
        toy = make_toy(T=2, V=2)
        with pytest.raises(ValueError, match=r"per_seq_estimate must have shape .*\(4, 2, 2\)"):
            estimator_moments(toy, np.zeros((4, 2)))

    def test_missing_keys(self):
        with pytest.raises(ValueError, match="toy is missing the keys"):
            estimator_moments({"p_sampler": np.ones(2)}, np.zeros((2, 1, 1)))
